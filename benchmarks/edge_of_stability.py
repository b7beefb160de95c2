"""The edge of stability (issue 43 item 3): large learning rates through the single-process simulator
(:mod:`benchmarks.multirun`), stock against the paper's estimate and the default look-ahead, paired
seeds; per run whether it diverged and how many loss spikes it had.

    python -m benchmarks.edge_of_stability OUT.json --size small --lr-mults 4,8 [--steps 300 --seeds 3]
    python -m benchmarks.edge_of_stability OUT.json --size small --lr-mults 8 --variants stock,la2+warm
    python -m benchmarks.edge_of_stability --table OUT.json [OUT2.json ...]

A *spike*: a held-out evaluation above 1.1x the lowest one before it. *Diverged*: a non-finite
evaluation, or a last evaluation no lower than the first (the run ends where it stood after its
first evaluations' worth of steps, or worse).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from . import multirun
from .fidelity_sweep import LARGE, SMALL

SPIKE = 1.1
VARIANTS = ("stock", "paper", "la2")  # the default --variants


def spikes(curve) -> int:
    """Evaluations above SPIKE x the running minimum of the evaluations before them."""
    count, low = 0, math.inf
    for _, loss in curve:
        if math.isfinite(low) and loss > SPIKE * low:
            count += 1
        low = min(low, loss)
    return count


def diverged(curve) -> bool:
    losses = [loss for _, loss in curve]
    return not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]


def table(groups) -> str:
    lines = ["| setting | seeds | variant | gap to stock, median [range] | diverged | spikes per run |",
             "|---|---|---|---|---|---|"]
    for g in groups:
        stock = {r["seed"]: r for r in g["runs"] if r["variant"] == "stock"}
        for v in dict.fromkeys(r["variant"] for r in g["runs"]):  # each variant present, in run order
            mine = [r for r in g["runs"] if r["variant"] == v]
            if not mine:
                continue
            gaps = [100 * (r["tail_mean"] / stock[r["seed"]]["tail_mean"] - 1) for r in mine]
            gap = "" if v == "stock" else f"{statistics.median(gaps):+.2f}% [{min(gaps):+.2f}, {max(gaps):+.2f}]"
            div = sum(diverged(r["heldout"]) for r in mine)
            sp = ", ".join(str(spikes(r["heldout"])) for r in sorted(mine, key=lambda r: r["seed"]))
            name = f"{g['size']} LR x{g['lr_mult']:g}, {g['steps']} steps"
            lines.append(f"| {name} | {len(mine)} | {v} | {gap} | {div} of {len(mine)} | {sp} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="+")
    ap.add_argument("--table", action="store_true", help="print the table of existing results files")
    ap.add_argument("--size", choices=("small", "large"), default="small")
    ap.add_argument("--lr-mults", default="4,8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated names from benchmarks.multirun.VARIANTS; stock first (the gaps' reference)")
    a = ap.parse_args()
    if a.table:
        print(table([g for path in a.out for g in json.load(open(path))["groups"]]))
        return
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in multirun.VARIANTS]
    if unknown or variants[0] != "stock":
        ap.error(f"--variants {a.variants!r}: stock first, then names from {sorted(multirun.VARIANTS)}"
                 + (f" (unknown: {unknown})" if unknown else ""))
    torch.set_num_threads(1)
    size = SMALL if a.size == "small" else LARGE
    results = {"device": a.device, "torch": torch.__version__, "groups": []}
    t0 = time.time()
    for mult in (float(x) for x in a.lr_mults.split(",")):
        g0 = time.time()
        s = multirun.Setting(**size, lr=1e-3 * mult, steps=a.steps, warmup=max(2, a.steps // 20), eval_every=25)
        runs = [(v, seed) for seed in range(a.seeds) for v in variants]
        recs = multirun.run_group(s, runs, a.device)
        results["groups"].append({"size": a.size, "lr_mult": mult, "steps": a.steps, "beta2": s.beta2,
                                  "wall_s": time.time() - g0, "runs": recs})
        with open(a.out[0], "w") as f:
            json.dump(results, f)
        print(f"{time.time() - t0:.0f}s {a.size} LR x{mult:g} done ({time.time() - g0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
