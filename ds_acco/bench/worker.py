"""One rank of an A/B run (launched by :mod:`ds_acco.bench.runner`, one process per rank).

    python -m ds_acco.bench.worker SPEC.json

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

import contextlib
import copy
import gc
import json
import logging
import math
import os
import random
import statistics
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ds_acco.gpt import CausalLM, heldout_loss, param_groups

LR_RULES = ("sqrt", "linear")  # dynamic_<rule>: acco.dynamic.lr_scaling = <rule>
DS_VARIANTS = ("stock", "fixed", "dynamic", "dpu", "shared")
FSDP_VARIANTS = ("fsdp_stock", "fsdp_fixed", "fsdp_dynamic", "fsdp_dpu")
# FSDP2 with parameters resharded after forward and backward (FSDP's memory-saving configuration):
# stock with no-sync accumulation, and ACCO with AccoFSDP(sharded_params=True); named explicitly
FSDP_SHARDED_VARIANTS = ("fsdp_stock_sharded", "fsdp_fixed_sharded")
LR_VARIANTS = tuple(f"dynamic_{r}" for r in LR_RULES)  # DeepSpeed, named explicitly (not in 'all')
# ACCO fixed with the paper's estimate ("estimate": "paper"), beside the default look-ahead's: named only
PAPER_VARIANTS = ("fixed_paper",)
VARIANTS = DS_VARIANTS + FSDP_VARIANTS + LR_VARIANTS + FSDP_SHARDED_VARIANTS + PAPER_VARIANTS


def mode_of(variant: str) -> str:
    """The schedule a variant runs ('stock', 'fixed', 'dynamic' or 'dpu'), whatever the framework
    and learning-rate rule."""
    mode = variant[len("fsdp_"):] if variant.startswith("fsdp_") else variant
    mode = mode[:-len("_sharded")] if mode.endswith("_sharded") else mode
    mode = mode[:-len("_paper")] if mode.endswith("_paper") else mode
    return "dynamic" if lr_rule_of(variant) else mode


def is_sharded(variant: str) -> bool:
    """An FSDP2 variant whose parameters stay sharded between uses (FSDP_SHARDED_VARIANTS)."""
    return is_fsdp(variant) and variant.endswith("_sharded")


def lr_rule_of(variant: str) -> Optional[str]:
    """The dynamic learning-rate rule a variant names (``dynamic_sqrt``: 'sqrt'), else None."""
    return next((r for r in LR_RULES if variant.endswith(f"dynamic_{r}")), None)


def is_fsdp(variant: str) -> bool:
    return variant.startswith("fsdp_")


# -- model ---------------------------------------------------------------------------------------
def build_model(spec: dict, rank: int = 0) -> CausalLM:
    """The reference GPT (:mod:`ds_acco.gpt`) at the spec's size, from the spec's seed; with
    ``spec['emulate']``, the accelerator stand-in of :mod:`ds_acco.bench.emulation` instead."""
    torch.manual_seed(spec["seed"])  # same initial weights in every variant
    m = spec["model"]
    emulate = spec.get("emulate")
    if emulate:
        from .emulation import EmulatedLM, compute_for_rank
        return EmulatedLM(spec["seq_len"], emulate["params"], compute_for_rank(emulate["compute_s"], rank),
                          m["n_embd"], m["n_layer"], m["n_head"])
    return CausalLM(spec["seq_len"], m["n_embd"], m["n_layer"], m["n_head"])


# -- configs -------------------------------------------------------------------------------------
def variant_config(base: dict, variant: str, spec: dict) -> dict:
    """The DeepSpeed config of one variant: the base config, with or without an ``acco`` block
    (the FSDP variants read the same JSON: its ``acco`` block, accumulation, clipping and the
    AdamW settings of its ``optimizer`` block)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    rule = lr_rule_of(variant)
    paper = variant in PAPER_VARIANTS
    variant = mode_of(variant)
    cfg = copy.deepcopy(base)
    # The base config's estimate variant (docs/estimate.md) applies to every variant with an estimate
    estimate = "paper" if paper else (cfg.pop("acco", None) or {}).get("estimate")
    cfg.pop("acco", None)
    cfg["train_micro_batch_size_per_gpu"] = spec["micro_batch"]
    cfg["gradient_accumulation_steps"] = spec["gas"]
    cfg.pop("train_batch_size", None)
    cfg["steps_per_print"] = 10 ** 9
    if variant == "stock":
        return cfg
    if variant == "fixed":
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "fixed"}
    elif variant == "dpu":
        cfg["acco"] = {"enabled": True, "mode": "dpu", "accumulation": "fixed"}
    elif variant == "shared":  # stock's batch per step, shared among the ranks by measured speed
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "shared"}
    elif variant == "dynamic":
        lo = spec.get("dynamic_min") or max(1, spec["gas"] // 2)
        hi = max(lo, spec.get("dynamic_max") or 256)
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "dynamic",
                       "dynamic": {"min_micro_batches": lo, "max_micro_batches": hi, "check_every": 1}}
        if rule:
            cfg["acco"]["dynamic"]["lr_scaling"] = rule
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    if estimate is not None and cfg["acco"]["mode"] == "acco":
        cfg["acco"]["estimate"] = estimate
    return cfg


# -- trainers: one interface over DeepSpeed, stock FSDP2 and AccoFSDP ------------------------------
class _Delegating:
    """A trainer whose engine (DeepSpeed's, or AccoFSDP) has ``backward``, ``step``,
    ``global_steps`` and works with :func:`ds_acco.committed_weights`."""

    def __init__(self, inner, forward):
        self.inner, self._forward = inner, forward

    def __call__(self, rows):
        return self._forward(rows)

    def backward(self, loss):
        self.inner.backward(loss)

    def step(self):
        self.inner.step()

    @property
    def global_steps(self) -> int:
        return self.inner.global_steps

    def committed_weights(self):
        import ds_acco
        return ds_acco.committed_weights(self.inner)


class DeepSpeedTrainer(_Delegating):
    """Stock ZeRO-1 (``ds_acco.initialize`` without an ``acco`` block is plain
    ``deepspeed.initialize``) or ACCO / DPU on DeepSpeed."""

    fsdp = False

    def __init__(self, model: torch.nn.Module, cfg: dict):
        import ds_acco
        engine, _, _, _ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        super().__init__(engine, engine)
        self.module = engine.module
        self.acco = getattr(engine.optimizer, "schedule", None) is not None

    def metrics_history(self) -> List[dict]:
        return list(self.inner.acco_metrics_history) if self.acco else []

    def close(self):
        self.inner.destroy()


def shard_fsdp(model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module:
    """FSDP2's usual recipe (``fully_shard`` each transformer block, then the root) on a 1-D CPU
    mesh, by default with ``reshard_after_forward=False``: parameters are gathered once per optimizer
    step, the same traffic as ZeRO-1 (one reduce-scatter and one all-gather of the model per step).
    ``sharded``: FSDP's defaults (blocks resharded after forward, re-gathered for backward), the
    configuration that keeps one block unsharded at a time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.lm.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=sharded)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def check_fsdp_config(cfg: dict) -> None:
    """What the FSDP variants do not build from the JSON, refused rather than silently dropped."""
    for key in ("scheduler", "bf16", "fp16"):
        block = cfg.get(key)
        if block and (key == "scheduler" or block.get("enabled", False)):
            raise ValueError(f"base config block \"{key}\": the FSDP variants train in fp32 with torch AdamW and no "
                             "LR schedule; fix: remove it from the base config, or run the DeepSpeed variants only")


def fsdp_adamw(model: torch.nn.Module, cfg: dict) -> torch.optim.AdamW:
    """torch AdamW over FSDP's sharded parameters with the settings of the config's optimizer
    block (the DeepSpeed variants build the same optimizer from it, ``torch_adam``)."""
    opt = cfg.get("optimizer") or {}
    if opt and str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        raise ValueError(f"optimizer.type = {opt.get('type')!r}: the FSDP variants build torch AdamW; fix: use an "
                         "AdamW optimizer block or run the DeepSpeed variants only")
    p = dict(opt.get("params") or {})
    return torch.optim.AdamW(param_groups(model), lr=p.get("lr", 1e-3), betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.01))


class StockFSDPTrainer:
    """Stock FSDP2 with gradient accumulation: gradient sync (reduce-scatter) only on the last
    micro-batch of each step (no-sync accumulation of unsharded gradients before it), then clipping
    and the optimizer step on the shards. Resharding after backward on the last micro-batch only,
    or (``sharded``) after every forward and backward."""

    fsdp = True
    acco = False

    def __init__(self, model: torch.nn.Module, cfg: dict, sharded: bool = False):
        check_fsdp_config(cfg)
        self.sharded = sharded
        self.module = shard_fsdp(model, sharded)
        self.optimizer = fsdp_adamw(model, cfg)
        self.gas = cfg["gradient_accumulation_steps"]
        self.clip = float(cfg.get("gradient_clipping") or 0.0)
        self.micro = 0
        self.global_steps = 0

    def __call__(self, rows):
        last = self.micro % self.gas == self.gas - 1
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last or self.sharded)  # the next step's forward gathers the new shards
        return self.module(rows)

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.gas == 0:
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1

    @contextlib.contextmanager
    def committed_weights(self):
        """The shards are the committed weights. An evaluation forward gathers them and, with
        ``reshard_after_forward=False``, leaves them gathered: reshard on exit, so the next timed
        step pays its all-gather as every step does."""
        from torch.distributed.fsdp import FSDPModule
        try:
            yield
        finally:
            for m in self.module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def metrics_history(self) -> List[dict]:
        return []

    def close(self):
        pass


class AccoFSDPTrainer(_Delegating):
    """ACCO / DPU on the same FSDP2 model (:class:`ds_acco.fsdp.AccoFSDP`)."""

    fsdp = True
    acco = True

    def __init__(self, model: torch.nn.Module, cfg: dict, sharded: bool = False):
        from ds_acco.fsdp import AccoFSDP
        check_fsdp_config(cfg)
        self.module = shard_fsdp(model, sharded)
        super().__init__(AccoFSDP(self.module, fsdp_adamw(model, cfg), cfg, sharded_params=sharded), self.module)

    def metrics_history(self) -> List[dict]:
        return self.inner.acco_metrics_history

    def close(self):
        self.inner.close()


def make_trainer(variant: str, model: torch.nn.Module, cfg: dict):
    if not is_fsdp(variant):
        return DeepSpeedTrainer(model, cfg)
    trainer = StockFSDPTrainer if mode_of(variant) == "stock" else AccoFSDPTrainer
    return trainer(model, cfg, sharded=is_sharded(variant))


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


# -- probe ---------------------------------------------------------------------------------------
def _timed(fn, reps: int) -> List[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def probe(spec: dict, stream, rank: int, world: int) -> dict:
    """Compute-only and communication-only timings on this setup (see the module docstring)."""
    gc.collect()  # a memory run probes after its variant: let that run's engine go first
    model = build_model(spec, rank)
    n_params = sum(p.numel() for p in model.parameters())
    slow = spec.get("slow_factor", 1.0) if rank == spec.get("slow_rank", -1) else 1.0

    def micro():
        t0 = time.perf_counter()
        model(next(stream)).backward()
        _slow_down(slow, time.perf_counter() - t0)

    dist.barrier()  # every rank computes at once: same contention as in training
    _timed(micro, 2)
    mb = _timed(micro, spec.get("probe_micro_batches", 6))
    model.zero_grad(set_to_none=True)
    dist.barrier()
    padded = -(-n_params // world) * world
    # A memory run's probe (after its measured peak; it feeds only the advice line) times its
    # collectives and the shard step on at most ``probe_comm_elements`` and scales the times to the
    # model's size: model-sized buffers here would double a large model's footprint after training.
    cap = spec.get("probe_comm_elements")
    timed = padded if not cap else min(padded, max(world, int(cap) // world * world))
    scale = padded / timed
    flat = torch.zeros(timed, dtype=torch.float32)
    shard = torch.zeros(timed // world, dtype=torch.float32)
    tiny = torch.zeros(8, dtype=torch.float32)
    reps = spec.get("probe_comm_reps", 2)
    scaled = lambda ts: [t * scale for t in ts]  # noqa: E731
    _timed(lambda: dist.all_reduce(flat), 1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ar = scaled(_timed(lambda: dist.all_reduce(flat), reps))
    ag = scaled(_timed(lambda: dist.all_gather_into_tensor(flat, shard), reps))
    cpu_frac = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    lat = _timed(lambda: dist.all_reduce(tiny), 20)
    half = flat[:timed // 2].clone()
    ar_half = scaled(_timed(lambda: dist.all_reduce(half), reps))
    p = torch.nn.Parameter(torch.zeros(timed // world))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()
    opt_s = scaled(_timed(opt.step, 3))

    def one_round():  # what an ACCO round does on gloo: in-place all-reduce, shard step, all-gather
        dist.all_reduce(flat)
        opt.step()
        dist.all_gather_into_tensor(flat, shard)
    alone = torch.tensor([statistics.median(mb), (statistics.median(ar) + statistics.median(ag)) / scale])
    dist.all_reduce(alone, op=dist.ReduceOp.MAX)  # every rank must run the same number of rounds
    rounds = min(20, max(reps, math.ceil(3 * alone[0].item() / max(1e-6, alone[1].item()))))
    mb_ov, round_ov = overlapped(micro, one_round, rounds)
    round_ov *= scale
    del flat, shard, half, p, opt, model
    return {"n_params": n_params, "padded_params": padded, "comm_timed_elements": timed,
            "micro_batch_s": statistics.median(mb),
            "micro_batch_samples_s": mb, "all_reduce_s": statistics.median(ar), "all_reduce_half_s":
            statistics.median(ar_half), "all_gather_s": statistics.median(ag), "latency_s": statistics.median(lat),
            "opt_step_s": statistics.median(opt_s), "comm_bytes": padded * 4, "comm_cpu_fraction": cpu_frac,
            "micro_batch_overlap_s": mb_ov, "round_overlap_s": round_ov, "overlap_rounds": rounds}


def overlapped(micro, one_round, rounds: int, barrier=None) -> tuple:
    """Compute and rounds at once, as ACCO runs them: ``rounds`` rounds back to back on a side
    thread while this thread computes micro-batches until they end. Returns (seconds per
    micro-batch while a round ran, median seconds per round while compute ran). The rate counts
    each micro-batch by the fraction of it inside the rounds' window, so a window shorter than
    a micro-batch still measures (assuming even work through a micro-batch; the caller sizes the
    window to about 3 micro-batches, within 2-20 rounds). A failed round is re-raised here, and
    the launcher then stops every rank."""
    window = [0.0, 0.0]
    per_round: List[float] = []
    failure: List[BaseException] = []

    def comm():
        try:
            for _ in range(rounds):
                t0 = time.perf_counter()
                one_round()
                per_round.append(time.perf_counter() - t0)
        except BaseException as e:  # re-raised on the main thread
            failure.append(e)
        window[1] = time.perf_counter()

    (barrier or dist.barrier)()
    side = threading.Thread(target=comm, name="probe-rounds", daemon=True)
    window[0] = time.perf_counter()
    side.start()
    spans = []
    try:
        while side.is_alive():
            a = time.perf_counter()
            micro()
            spans.append((a, time.perf_counter()))
    finally:
        side.join()  # bounded: a fixed number of rounds; leaves no collective in flight if compute failed
    if failure:
        raise failure[0]
    return seconds_per_item(spans, *window), statistics.median(per_round)


def seconds_per_item(spans, w0: float, w1: float) -> float:
    """Seconds per item inside the window [w0, w1], each (start, end) span counted by the
    fraction of it that lies inside (work assumed even within an item)."""
    done = sum((min(b, w1) - max(a, w0)) / (b - a) for a, b in spans if b > a and min(b, w1) > max(a, w0))
    if done <= 0:
        raise ValueError(f"no item overlaps the window [{w0}, {w1}]")
    return (w1 - w0) / done


def _slow_down(factor: float, elapsed: float) -> None:
    """Heterogeneous runs: stretch this rank's micro-batch to ``factor`` x its compute time
    (sleeping, so the slow rank does not also steal CPU from the fast ones)."""
    if factor > 1.0:
        time.sleep((factor - 1.0) * elapsed)


class Slowdown:
    """The slow rank's factor for each micro-batch (EMULATION of heterogeneous hardware): the spec's
    ``slow_factor``; times a lognormal jitter of ``slow_jitter`` = σ per micro-batch (mean 1, seeded
    per rank, the same sequence in every variant: a straggler whose speed varies); times
    ``transient['factor']`` while the committed steps are in ``[start, start + fraction)`` of the
    run (a throttled GPU or a noisy neighbour for part of the run). Other ranks: 1."""

    def __init__(self, spec: dict, rank: int):
        self.slow = rank == spec.get("slow_rank", -1)
        self.factor = float(spec.get("slow_factor", 1.0))
        self.sigma = float(spec.get("slow_jitter", 0.0) or 0.0)
        t = spec.get("transient") or {}
        steps = spec["steps"]
        first = round(t.get("start", 0.4) * steps)
        self.window = (first, first + max(1, round(t.get("fraction", 0.2) * steps)))  # committed steps
        self.transient = float(t.get("factor", 1.0))
        self.rng = random.Random(spec.get("seed", 0) * 7919 + rank)

    def __call__(self, step: int) -> float:
        if not self.slow:
            return 1.0
        f = self.factor
        if self.sigma > 0:
            f *= math.exp(self.rng.gauss(-self.sigma ** 2 / 2, self.sigma))
        if self.transient != 1.0 and self.window[0] <= step < self.window[1]:
            f *= self.transient
        return f


# -- one variant ----------------------------------------------------------------------------------
def run_variant(variant: str, spec: dict, base_cfg: dict, train_rows, heldout_rows, rank: int, world: int,
                say) -> dict:
    """Train one variant for ``spec['steps']`` committed steps; this rank's raw records."""
    from ds_acco.data import heldout_batches, micro_batches

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
        _slow_down(slowdown(engine.global_steps), elapsed)
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
    engine.close()
    del engine, model
    gc.collect()
    return {"variant": variant, "mode": mode_of(variant), "fsdp": fsdp, "acco": acco,
            "committed": len(commits), "micro_batches": i,
            "mb_loss": mb_loss, "mb_compute_s": mb_compute, "mb_step": mb_step, "commits": commits,
            "heldout": heldout, "acco_metrics": [_plain(m) for m in metrics], "wall_s": wall,
            "peak_rss_delta": None if peak is None or baseline_rss is None else peak - baseline_rss,
            "peak_rss_train_delta": None if train_peak is None or baseline_rss is None else train_peak - baseline_rss,
            "baseline_rss": baseline_rss, "slow_factor": slow}


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

    from ds_acco.data import build_splits, micro_batches

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
