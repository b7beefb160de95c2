"""Size and horizon (issue 43 items 1 and 2): the default estimate on a larger model with a larger
text, and on the small model over a long run, through the single-process simulator
(:mod:`benchmarks.multirun`); stock against the paper's estimate and the default look-ahead, paired
seeds (one group per seed and setting, the three variants stacked in it).

    python -m benchmarks.long_runs size OUT.json --seed 0 --lr-mult 1     # ~5M parameters, stdlib-source
    python -m benchmarks.long_runs size OUT.json --seed 0 --model 14m     # ~14M (n_embd 384, 8 layers)
    python -m benchmarks.long_runs horizon OUT.json --seed 0 [--steps 5000]
    python -m benchmarks.long_runs report OUT.json [OUT2.json ...] [--plot PNG]

*size*: n_embd 256, 6 layers, 8 heads (4.8M parameters with the byte vocabulary), the Python standard
library's own source as the text (``benchmarks.data``'s ``stdlib-source``, ~12 MB, so the model does
not overfit), 300 steps, warm-up 15, held-out every 25 steps. *horizon*: the fidelity sweep's small
model (0.43M) on the embedded corpus, LR 1e-3, warm-up 5% of the steps then cosine decay to 0.1 of
the peak (DeepSpeed's WarmupCosineLR, as every sweep), held-out every 100 steps.

The report: per setting, each variant's gap to stock of the same seed in the tail mean (the held-out
evaluations of the last 30% of the steps), the gap at every evaluation (the gap along the run: the
plot, and the table's early / middle / last columns), and the estimate's median drift.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from . import multirun
from .fidelity_sweep import SMALL

VARIANTS = ("stock", "paper", "la2")
SIZE_5M = dict(n_embd=256, n_layer=6, n_head=8)
SIZE_14M = dict(n_embd=384, n_layer=8, n_head=6)  # 14.3M parameters with the byte vocabulary
MODELS = {"5m": SIZE_5M, "14m": SIZE_14M}


def setting(kind: str, lr_mult: float = 1.0, steps: int = 0, model: str = "5m") -> multirun.Setting:
    if kind == "size":
        return multirun.Setting(**MODELS[model], lr=1e-3 * lr_mult, steps=steps or 300, warmup=15, eval_every=25,
                                corpus="stdlib-source")
    steps = steps or 5000
    return multirun.Setting(**SMALL, lr=1e-3 * lr_mult, steps=steps, warmup=steps // 20, eval_every=100)


def run(kind: str, out: str, seed: int, lr_mult: float, steps: int, device: str = "cpu", model: str = "5m") -> dict:
    s = setting(kind, lr_mult, steps, model)
    t0 = time.time()
    recs = multirun.run_group(s, [(v, seed) for v in VARIANTS], device,
                              log=lambda m: print(f"{time.time() - t0:.0f}s {m}", flush=True))
    from .gpt import CausalLM
    params = sum(p.numel() for p in CausalLM(s.seq_len, s.n_embd, s.n_layer, s.n_head).parameters())
    res = {"kind": kind, "device": device, "torch": torch.__version__, "params": params, "setting": vars(s),
           "wall_s": time.time() - t0, "runs": recs}
    with open(out, "w") as f:
        json.dump(res, f)
    return res


def gaps_along(res: dict) -> dict:
    """Per variant other than stock: [(step, gap to stock in %)] at every evaluation."""
    stock = dict(next(r for r in res["runs"] if r["variant"] == "stock")["heldout"])
    return {r["variant"]: [(step, 100 * (loss / stock[step] - 1)) for step, loss in r["heldout"]]
            for r in res["runs"] if r["variant"] != "stock"}


def _name(res: dict) -> str:
    s = res["setting"]
    return f"{res['kind']} {res['params'] / 1e6:.2f}M, LR x{s['lr'] / 1e-3:g}, {s['steps']} steps"


def report(results) -> str:
    lines = ["| setting | seeds | variant | tail gap, median [range] | gap at 10% / 50% / end (median) | drift |",
             "|---|---|---|---|---|---|"]
    by_setting = {}
    for res in results:
        by_setting.setdefault(_name(res), []).append(res)
    for name, group in by_setting.items():
        # every variant other than stock that the setting's records hold (alternatives run beside the three
        # of VARIANTS, e.g. docs/bench/long-runs-cpu/lr2-alternatives), each over the records that have it
        present = [r["variant"] for res in group for r in res["runs"] if r["variant"] != "stock"]
        for v in dict.fromkeys([u for u in VARIANTS[1:] if u in present] + present):
            tails, marks, drift = [], [[], [], []], []
            have = [res for res in group if any(r["variant"] == v for r in res["runs"])]
            for res in have:
                stock = next(r for r in res["runs"] if r["variant"] == "stock")["tail_mean"]
                mine = next(r for r in res["runs"] if r["variant"] == v)
                tails.append(100 * (mine["tail_mean"] / stock - 1))
                along = gaps_along(res)[v]
                for i, frac in enumerate((0.1, 0.5, 1.0)):
                    marks[i].append(min(along, key=lambda p: abs(p[0] - frac * res["setting"]["steps"]))[1])
                drift.append(mine["lag_median"])
            at = " / ".join(f"{statistics.median(m):+.2f}%" for m in marks)
            lines.append(f"| {name} | {len(have)} | {v} | {statistics.median(tails):+.2f}% "
                         f"[{min(tails):+.2f}, {max(tails):+.2f}] | {at} | {statistics.median(drift):.2f} |")
    return "\n".join(lines)


def plot(results, path: str) -> None:
    """The gap to stock along the run, per variant and seed (one panel per setting)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(_name(r) for r in results))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for res in (r for r in results if _name(r) == name):
            seed = res["runs"][0]["seed"]
            for i, (v, along) in enumerate(gaps_along(res).items()):
                ax.plot(*zip(*along), color=f"C{i}", lw=1, alpha=0.8, label=f"{v} seed {seed}")
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="step", ylabel="held-out gap to stock (%)", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("size", "horizon", "report"), help="report: the table of existing results files")
    ap.add_argument("out", nargs="+")
    ap.add_argument("--plot", help="with report: the gap along the run, as a PNG")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr-mult", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=0, help="0: 300 (size) / 5000 (horizon)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="5m", help="with size: 5m (4.81M) or 14m (14.3M)")
    a = ap.parse_args()
    if a.kind == "report":
        results = [json.load(open(p)) for p in a.out]
        print(report(results))
        if a.plot:
            plot(results, a.plot)
        return
    torch.set_num_threads(1)
    run(a.kind, a.out[0], a.seed, a.lr_mult, a.steps, a.device, a.model)


if __name__ == "__main__":
    main()
