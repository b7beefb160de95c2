"""One rank of an A/B run (launched by :mod:`benchmarks.runner`, one process per rank).

    python -m benchmarks.worker SPEC.json

Reads the run's spec (written by the runner), then on every rank:
  1. **probe** (no training): compute-only time per micro-batch for this model and micro-batch,
     and the collectives' time for this world size (all-reduce of the model, all-gather of the
     model, a tiny all-reduce for latency, one AdamW step on a shard), then both at once: rounds
     on a side thread while micro-batches run, each timed (what contention costs on this host);
  2. **variants** in the spec's order (e.g. stock, fixed, dynamic, dpu, repeated if asked),
     each from the same seed, initial weights and data order: per micro-batch the loss and the
     forward+backward time, per committed step its wall time, held-out loss on committed
     weights, peak memory.
Nothing in the training loop communicates beyond what DeepSpeed/ACCO do themselves: every
rank keeps its own records and rank 0 gathers them after each variant into ``raw.json``.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.gpt import heldout_loss

from .emulation import Slowdown, slow_down
from .probe import probe
from .trainers import make_trainer
from .variants import build_model, is_fsdp, mode_of, variant_config


# -- memory --------------------------------------------------------------------------------------
def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> Optional[int]:
    """Reset the kernel's peak-RSS mark (Linux ``clear_refs`` 5) and return the current RSS in
    bytes, the baseline of the next measurement."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def peak_rss() -> Optional[int]:
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


# -- one variant ----------------------------------------------------------------------------------
def run_variant(variant: str, spec: dict, base_cfg: dict, train_rows, heldout_rows, rank: int, world: int,
                say) -> dict:
    """Train one variant for ``spec['steps']`` committed steps; this rank's raw records."""
    from benchmarks.data import heldout_batches, micro_batches

    cfg = variant_config(base_cfg, variant, spec)
    gas, steps = spec["gas"], spec["steps"]
    slow = spec.get("slow_factor", 1.0) if rank == spec.get("slow_rank", -1) else 1.0
    slowdown = Slowdown(spec, rank)
    baseline_rss = reset_peak_rss()
    model = build_model(spec, rank)
    engine = make_trainer(variant, model, cfg)
    acco = engine.acco
    stream = micro_batches(train_rows, spec["micro_batch"], rank, world, spec["seed"])
    evals = heldout_batches(heldout_rows, spec.get("eval_batch", 16), rank, world)[:spec.get("eval_batches", 4)]
    dist.barrier()

    mb_loss: List[float] = []  # per micro-batch, this rank
    mb_compute: List[float] = []  # forward+backward seconds (stock: the boundary one includes the reduce)
    mb_step: List[int] = []  # which committed step's data (fixed: i // gas; dynamic, shared: commits so far)
    commits: List[dict] = []  # per committed step: time since the previous one, drained?
    heldout: List[dict] = []
    state = {"seen": engine.global_steps, "t_last": time.perf_counter(), "train_s": 0.0}

    def note_commits(now: float, drained: bool) -> None:
        while state["seen"] < engine.global_steps:
            dt = now - state["t_last"]
            state["train_s"] += dt
            commits.append({"step": state["seen"] + 1, "step_time_s": dt, "drained": drained,
                            "train_s": state["train_s"], "mb_seen": len(mb_loss)})
            state["seen"] += 1
            state["t_last"] = now
            if rank == 0:
                say(f"[{variant}] step {state['seen']}/{steps}  {dt:.3f}s" + ("  (drained)" if drained else ""))

    def evaluate() -> None:
        with engine.committed_weights():
            note_commits(time.perf_counter(), drained=True)
            loss = heldout_loss(engine.module, evals)
        heldout.append({"step": engine.global_steps, "loss": loss, "train_s": state["train_s"]})
        if rank == 0:
            say(f"[{variant}] held-out loss {loss:.4f} on committed weights after step {engine.global_steps}")
        state["t_last"] = time.perf_counter()

    eval_every = spec.get("eval_every", 0)
    next_eval = eval_every
    # Dynamic and shared ranks compute different numbers of micro-batches per step: loop on the
    # committed steps, which every rank reaches at the same phase end (docs/ACCO.md, "Data").
    by_commits = mode_of(variant) in ("dynamic", "shared")
    cap = steps * gas * max(4, spec.get("dynamic_max") or 256)
    i = 0
    t_start = time.perf_counter()
    while (engine.global_steps < steps) if by_commits else (i < steps * gas):
        if i >= cap:
            raise RuntimeError(f"{variant}: {i} micro-batches without reaching {steps} committed steps")
        rows = next(stream)
        t0 = time.perf_counter()
        loss = engine(rows)
        engine.backward(loss)
        elapsed = time.perf_counter() - t0
        slow_down(slowdown(engine.global_steps), elapsed)
        mb_compute.append(time.perf_counter() - t0)
        mb_loss.append(float(loss.detach()))
        mb_step.append(engine.global_steps if by_commits else i // gas)
        engine.step()
        i += 1
        note_commits(time.perf_counter(), drained=False)
        if eval_every and engine.global_steps >= next_eval and engine.global_steps < steps:
            evaluate()
            next_eval = (engine.global_steps // eval_every + 1) * eval_every
    train_peak = peak_rss()  # before the last evaluation (periodic ones, if any, are inside)
    evaluate()  # drains: the last steps commit here
    wall = time.perf_counter() - t_start
    metrics = engine.metrics_history()
    peak = peak_rss()
    fsdp = engine.fsdp
    auto = engine.auto_decision() if hasattr(engine, "auto_decision") else None  # mode auto: its choice, why
    engine.close()
    del engine, model
    gc.collect()
    return {"variant": variant, "mode": mode_of(variant), "fsdp": fsdp, "acco": acco,
            "committed": len(commits), "micro_batches": i,
            "mb_loss": mb_loss, "mb_compute_s": mb_compute, "mb_step": mb_step, "commits": commits,
            "heldout": heldout, "acco_metrics": [_plain(m) for m in metrics], "wall_s": wall,
            "peak_rss_delta": None if peak is None or baseline_rss is None else peak - baseline_rss,
            "peak_rss_train_delta": None if train_peak is None or baseline_rss is None else train_peak - baseline_rss,
            "baseline_rss": baseline_rss, "slow_factor": slow, "auto": auto}


def _plain(record: Dict) -> Dict:
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, (int, float, str, bool, list)) or v is None:
            out[k] = v
    return out


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads", 1))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from benchmarks.data import build_splits, micro_batches

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(msg: str) -> None:
        print(msg, flush=True)

    with open(spec["base_config"]) as f:
        base_cfg = json.load(f)
    train_rows, heldout_rows = build_splits(spec.get("data", "embedded"), seq_len=spec["seq_len"], holdout=0.02,
                                            seed=0)
    probe_stream = micro_batches(train_rows, spec["micro_batch"], rank, world, spec["seed"] + 1)
    memory = spec.get("memory", False)

    def run_probe() -> list:
        if rank == 0:
            say(f"probe: compute per micro-batch and collectives at world size {world}")
        pr = probe(spec, probe_stream, rank, world)
        if rank == 0:
            say(f"probe: {pr['n_params']:,} parameters, {pr['micro_batch_s'] * 1e3:.0f} ms per micro-batch, "
                f"all-reduce {pr['all_reduce_s'] * 1e3:.0f} ms, all-gather {pr['all_gather_s'] * 1e3:.0f} ms, "
                f"latency {pr['latency_s'] * 1e6:.0f} us")
        probes = [None] * world
        dist.all_gather_object(probes, pr)
        return probes

    # A memory measurement (``memory``) runs its one variant first in a fresh process, the probe
    # after: the peak then covers everything the variant allocates from before its model is built,
    # with no heap left behind by another run to hide its transients.
    probes = None if memory else run_probe()
    if not memory and spec["variants"]:
        # One untimed step of stock ZeRO-1 first: one-off allocations (gloo buffers, DeepSpeed's ops,
        # allocator arenas) then do not land in the first measured variant's peak memory. It also
        # lets a later stock run reuse that step's freed heap: use ``memory`` for memory figures.
        if rank == 0:
            say("warm-up: one untimed stock step")
        first = "fsdp_stock" if all(is_fsdp(v) for v in spec["variants"]) else "stock"
        run_variant(first, {**spec, "steps": 1, "eval_batches": 1}, base_cfg, train_rows, heldout_rows, rank, world,
                    lambda msg: None)
        dist.barrier()
    runs = []
    order = [v for _ in range(spec.get("repeat", 1)) for v in spec["variants"]]
    for k, variant in enumerate(order):
        if rank == 0:
            say(f"== variant {k + 1}/{len(order)}: {variant}")
        rec = run_variant(variant, spec, base_cfg, train_rows, heldout_rows, rank, world, say)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, rec)
        if rank == 0:
            runs.append({"variant": variant, "repeat": k // len(spec["variants"]), "ranks": per_rank})
            with open(spec["raw_out"] + ".part", "w") as f:  # survives a later failure
                json.dump({"spec": spec, "probe": probes, "runs": runs}, f)
        dist.barrier()
    if probes is None:
        probes = run_probe()
    if rank == 0:
        with open(spec["raw_out"], "w") as f:
            json.dump({"spec": spec, "probe": probes, "runs": runs}, f)
        say(f"wrote {spec['raw_out']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
