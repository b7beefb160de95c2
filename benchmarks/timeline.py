"""A traced timeline of the compute lane and the communication lane: stock ZeRO-1 vs ACCO.

    python -m benchmarks timeline --rate 1gbit --gas 4 --steps 3 --out docs/timeline.png

Runs 2 ranks (the emulated cluster when root, loopback otherwise), trains the benchmark GPT for a
few optimizer steps with stock ZeRO-1 and then with ACCO (fixed), records on rank 0 when each
micro-batch computed and when each communication ran, and draws both as lanes. For stock
ZeRO-1 the communication is the blocking gradient reduce at the end of the boundary micro-batch's
backward plus the blocking ``engine.step()`` (optimizer step, all-gather); for ACCO it is each
round as it ran on the lane thread.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _trace_variant(variant: str, spec: dict, base_cfg: dict, rows, rank: int, world: int) -> dict:
    import torch

    import ds_acco
    from benchmarks.data import micro_batches
    from benchmarks.gpt import param_groups

    from .variants import build_model, variant_config
    cfg = variant_config(base_cfg, variant, spec)
    model = build_model(spec)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3, betas=(0.9, 0.95))
    engine, *_ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    finished = []  # every round as collected: its times are the lane's own clock
    schedule = getattr(engine.optimizer, "schedule", None)
    if schedule is not None:
        schedule.round_observers.append(finished.append)
    reduces = []
    if schedule is None:  # stock: the boundary reduce runs inside engine.backward; time it apart
        inner_reduce = engine.allreduce_gradients

        def allreduce_gradients(*a, **k):
            start = time.perf_counter()
            try:
                return inner_reduce(*a, **k)
            finally:
                if time.perf_counter() - start > 1e-3:
                    reduces.append((start, time.perf_counter()))
        engine.allreduce_gradients = allreduce_gradients
    stream = micro_batches(rows, spec["micro_batch"], rank, world, spec["seed"])
    compute, blocking = [], []
    n = spec["gas"] * spec["steps"]
    t0 = time.perf_counter()
    for _ in range(n):
        batch = next(stream)
        a = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        b = time.perf_counter()
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        c = time.perf_counter()
        if reduces and reduces[-1][1] <= b and reduces[-1][0] >= a:  # stock boundary: backward, then reduce
            r0, r1 = reduces.pop()
            compute.append((a - t0, r0 - a))
            blocking.append((r0 - t0, r1 - r0))
        else:
            compute.append((a - t0, b - a))
        if c - b > 1e-3 or boundary:
            blocking.append((b - t0, c - b))  # the compute lane waited (stock: step and all-gather)
    with ds_acco.committed_weights(engine):
        pass
    if schedule is not None:
        schedule.drain()  # the last round too
    rounds = [(f"{r.kind.value} {r.step}", r.started_at - t0, r.duration_s) for r in finished]
    engine.destroy()
    return {"variant": variant, "gas": spec["gas"], "compute": compute, "blocking": blocking, "rounds": rounds,
            "total_s": time.perf_counter() - t0}


def worker_main(spec_path: str) -> None:
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from benchmarks.data import build_splits
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(spec["base_config"]) as f:
        base_cfg = json.load(f)
    rows, _ = build_splits("embedded", seq_len=spec["seq_len"], holdout=0.02, seed=0)
    _trace_variant("stock", dict(spec, steps=1), base_cfg, rows, rank, world)  # warm-up, untraced
    traces = [_trace_variant(v, spec, base_cfg, rows, rank, world) for v in spec["variants"]]
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(traces, f)


def stats(trace: dict) -> dict:
    """Medians over a trace's steps after the first: step time (one step's first micro-batch to the next
    step's, so the last step is not timed), the compute lane's waits per step (stock: its reduce, step and
    all-gather), and each round kind's duration (the rounds of step 0 left out)."""
    import statistics
    gas = trace["gas"]
    ends = [trace["compute"][i][0] for i in range(0, len(trace["compute"]), gas)]  # each step's first micro-batch
    steps = [b - a for a, b in zip(ends[1:], ends[2:])] or [trace["total_s"]]
    waits = [sum(d for s, d in trace["blocking"] if a <= s < b) for a, b in zip(ends[1:], ends[2:])] or [0.0]
    kinds = {}
    for name, _, d in trace["rounds"]:
        kind, step = name.split()
        if int(step) >= 1:
            kinds.setdefault(kind, []).append(d)
    return {"step_s": statistics.median(steps), "wait_s": statistics.median(waits),
            "round_s": {k: statistics.median(v) for k, v in sorted(kinds.items())}}


def plot(traces, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    span = max(t["total_s"] for t in traces)
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.9 * len(traces) + 0.6), sharex=True, squeeze=False)
    axes = axes[:, 0]
    names = {"stock": "stock ZeRO-1", "fixed": "ACCO (fixed)", "dpu": "DPU", "one_round": "one-round"}
    for ax, tr in zip(axes, traces):
        ax.broken_barh(tr["compute"], (10, 8), facecolors="tab:blue")
        if tr["variant"] == "stock":
            ax.broken_barh(tr["blocking"], (0, 8), facecolors="tab:red")
        else:
            est = [(s, d) for name, s, d in tr["rounds"] if name.startswith("estimate")]
            com = [(s, d) for name, s, d in tr["rounds"] if name.startswith("commit")]
            ax.broken_barh(est, (0, 8), facecolors="tab:orange")
            ax.broken_barh(com, (0, 8), facecolors="tab:green")
            waits = [(s, d) for s, d in tr["blocking"] if d > 0.01]
            if waits:
                ax.broken_barh(waits, (10, 8), facecolors="none", edgecolors="tab:red", hatch="//")
        ax.set_yticks([4, 14], ["communication", "compute"])
        ax.set_xlim(0, span)
        st = stats(tr)
        rounds = "".join(f", {k} rounds {v:.3f} s" for k, v in st["round_s"].items())
        ax.set_title(f"{names.get(tr['variant'], tr['variant'])}: {tr['total_s']:.1f} s; per step {st['step_s']:.3f} s, "
                     f"compute waits {st['wait_s']:.3f} s{rounds} (medians)", fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds (rank 0)")
    handles = [matplotlib.patches.Patch(color=c, label=l) for c, l in
               (("tab:blue", "micro-batch (forward+backward)"), ("tab:red", "stock: reduce + step + all-gather "
                                                                 "(compute waits)"),
                ("tab:orange", "ACCO estimate round"), ("tab:green", "ACCO commit round"))]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from ds_acco import configs
    from . import cluster
    ap = argparse.ArgumentParser(prog="python -m benchmarks timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="link rate on the emulated cluster (root only)")
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--variants", default="stock,fixed", help="comma-separated: stock, fixed, dpu, one_round")
    ap.add_argument("--emulate-params", type=float, default=None,
                    help="EMULATION (benchmarks/emulation.py): bring the model to this many parameters")
    ap.add_argument("--emulate-compute-s", type=float, default=None,
                    help="EMULATION: each micro-batch's forward + backward is this many seconds of waiting")
    ap.add_argument("--out", default="bench_results/timeline.png")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    spec = {"seed": 0, "seq_len": 32, "micro_batch": 4, "gas": args.gas, "steps": args.steps,
            "model": {"n_embd": args.n_embd, "n_layer": args.n_layer, "n_head": args.n_head},
            "base_config": configs.path("zero1.json"), "variants": args.variants.split(",")}
    if (args.emulate_params is None) != (args.emulate_compute_s is None):
        ap.error("--emulate-params and --emulate-compute-s go together")
    if args.emulate_params is not None:
        spec["emulate"] = {"params": int(args.emulate_params), "compute_s": args.emulate_compute_s}
    with tempfile.TemporaryDirectory() as tmp:
        spec["out"] = os.path.join(tmp, "trace.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        argv_w = [sys.executable, "-m", "benchmarks.timeline", "--worker", spec_path]
        common = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # the rest of the environment is inherited
        if cluster.is_root():
            with cluster.Cluster(2, args.rate, prefix="accotl", subnet=251) as cl:
                where = f"emulated cluster, 2 nodes, {args.rate} links"
                envs = [{**common, **cl.rank_env(r, 29500)} for r in range(2)]
                try:
                    cluster.launch([cl.wrap(r, argv_w) for r in range(2)], envs, timeout_s=args.timeout)
                finally:
                    cluster.sweep_deepspeed_shm(29500)
        else:
            where = "loopback (not root: no emulated network; little to hide on 2 cores)"
            with cluster.loopback_store(2) as port:
                envs = [{**common, **cluster.loopback_env(r, 2, port)} for r in range(2)]
                try:
                    cluster.launch([argv_w] * 2, envs, timeout_s=args.timeout)
                finally:
                    cluster.sweep_deepspeed_shm(port)
        with open(spec["out"]) as f:
            traces = json.load(f)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = (f"EMULATION: {args.emulate_params:.3g} parameters, {args.emulate_compute_s} s per micro-batch"
             if args.emulate_params is not None else f"GPT-2 {args.n_layer}x{args.n_embd}")
    title = f"2 ranks, {where}; {model}, gradient_accumulation_steps {args.gas}, {args.steps} steps"
    plot(traces, args.out, title)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"command": "python -m benchmarks timeline " + " ".join(argv or sys.argv[1:]),
                   "setup": title, "traces": traces}, f)
    for tr in traces:
        print(tr["variant"], json.dumps(stats(tr)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        sys.exit(main())
