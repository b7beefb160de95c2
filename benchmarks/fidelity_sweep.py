"""The fidelity sweep (issue: train as well as stock at every LR, size and horizon): settings x
estimate variants x paired seeds through :func:`multirun.run_group`, most important settings first;
the results file is rewritten after every group (a run stopped at its time limit keeps the groups
it finished).

    python -m benchmarks.fidelity_sweep OUT.json [--device cuda] [--budget-s 420] [--tiny]
    python -m benchmarks.fidelity_sweep --table OUT.json      # the table of docs/bench/fidelity-sweep-h200
    python -m benchmarks.fidelity_sweep OUT.json --short --budget-s 7200   # the 300-step horizon (CPU)
    python -m benchmarks.fidelity_sweep OUT.json --one-round --lr-mults 2 --steps 200   # issue 42's predictors
    python -m benchmarks.fidelity_sweep OUT.json --one-round --sizes small,large --lr-mults 0.5,1,2 --beta2s 0.95,0.99
    python -m benchmarks.fidelity_sweep --table OUT.json --variants la2,dpu,ext1,nag,ef
    python -m benchmarks.fidelity_sweep OUT.json --optimizers "sgd:0.1,0.2;lion:1e-4" --steps 150   # issue 43
"""
import argparse
import json
import statistics
import time

import torch

from . import multirun

SMALL = dict(n_embd=128, n_layer=2, n_head=4)  # 0.43M parameters
LARGE = dict(n_embd=272, n_layer=2, n_head=4)  # 1.86M: 4.3x
SIZES = {"small": SMALL, "large": LARGE}
VARIANTS = ["stock", "paper", "keep_v", "dc", "warm", "la1.25", "la1.5", "la2"]


SHORT_VARIANTS = ["stock", "paper", "la1.5", "la2"]  # the horizon where the early lag weighs most: the deciding ones
ONE_ROUND_VARIANTS = ["stock", "la2", "dpu", "ext1", "nag", "ef"]  # issue 42: one round per step, against stock / fixed


def one_round_groups(lr_mults=(1, 2), steps=300, seeds=3, variants=ONE_ROUND_VARIANTS, sizes=("small",),
                     beta2s=(0.95,)):
    """Each size x LR multiplier x β2: stock, the fixed default and the one-round predictors, one group per
    seed (each saved as it ends; :func:`merge_seeds` pools them for the table); seeds outermost, so a run
    stopped early has every setting at its first seeds."""
    return [(dict(SIZES[size], lr=1e-3 * lr, steps=steps, warmup=max(2, steps // 20),
                  eval_every=max(5, steps // 20), beta2=b2),
             {"size": size, "lr_mult": lr, "steps": steps, "beta2": b2},
             [(v, s) for v in variants]) for s in range(seeds) for size in sizes for b2 in beta2s for lr in lr_mults]


def optimizer_groups(spec, steps=150, seeds=3, variants=("stock", "paper", "la2"), sizes=("small",)):
    """Issue 43 item 4: each model size under each (optimizer, peak LR) of ``spec`` (benchmarks.sim_optimizers),
    warm-up 8 steps, one group per pair, its seeds stacked."""
    return [(dict(SIZES[size], lr=lr, steps=steps, warmup=max(2, round(steps / 20)), eval_every=max(5, steps // 15),
                  optimizer=o),
             {"size": size, "optimizer": o, "lr": lr, "lr_mult": lr, "steps": steps, "beta2": 0.95},
             [(v, s) for s in range(seeds) for v in variants]) for size in sizes for o, lr in spec]


def merge_seeds(results: dict) -> dict:
    """One group per setting, the runs of its per-seed groups pooled."""
    merged = {}
    for g in results["groups"]:
        key = (g["size"], g["lr_mult"], g["steps"], g["beta2"], g.get("optimizer"))
        if key in merged:
            merged[key]["runs"] = merged[key]["runs"] + g["runs"]
            merged[key]["wall_s"] += g["wall_s"]
        else:
            merged[key] = dict(g)
    return dict(results, groups=list(merged.values()))


def groups(tiny=False, short=False):
    out = []
    def add(size, lr, steps, seeds, beta2=0.95, variants=VARIANTS):
        warmup = 50 if steps >= 1000 else max(2, steps // 20)
        out.append((dict(size, lr=1e-3 * lr, steps=steps, warmup=warmup, beta2=beta2),
                    {"size": "small" if size is SMALL else "large", "lr_mult": lr, "steps": steps, "beta2": beta2},
                    [(v, s) for s in range(seeds) for v in variants]))
    if short:  # 300 steps (15 of warm-up), 3 paired seeds; sized for a CPU
        for size, lr in ((SMALL, 2), (LARGE, 1), (SMALL, 0.5), (SMALL, 1), (LARGE, 2)):
            add(size, lr, 300, 3, variants=SHORT_VARIANTS)
        return out
    if tiny:
        add(SMALL, 2, 6, 2)
        add(LARGE, 1, 4, 1)
        return out
    for lr in (2, 1, 0.5):
        add(SMALL, lr, 1000, 3)
        add(LARGE, lr, 1000, 5)
    add(SMALL, 2, 1000, 3, beta2=0.99)
    add(LARGE, 2, 1000, 5, beta2=0.99)
    for lr in (2, 1, 0.5):
        add(SMALL, lr, 400, 3)
        add(LARGE, lr, 400, 5)
    add(SMALL, 1, 1000, 3, beta2=0.99)
    return out


def table(results: dict, variants=None) -> str:
    """Markdown: per setting, each variant's median tail-mean gap to stock over the paired seeds,
    its range, and the median drift / cosine of its estimate."""
    variants = variants or [v for v in VARIANTS if v != "stock"]
    head = "| setting | seeds | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (len(variants) + 2)]
    for g in results["groups"]:
        stock = {r["seed"]: r["tail_mean"] for r in g["runs"] if r["variant"] == "stock"}
        cells = []
        for v in variants:
            gaps = [100 * (r["tail_mean"] / stock[r["seed"]] - 1) for r in g["runs"] if r["variant"] == v]
            lags = [r["lag_median"] for r in g["runs"] if r["variant"] == v and r["lag_median"] is not None]
            if not gaps:
                cells.append("")
                continue
            lag = f", drift {statistics.median(lags):.2f}" if lags else ""
            cells.append(f"{statistics.median(gaps):+.2f}% [{min(gaps):+.2f}, {max(gaps):+.2f}]{lag}")
        name = f"{g['size']} LR x{g['lr_mult']:g}, beta2 {g['beta2']:g}, {g['steps']} steps"
        if g.get("optimizer"):
            name = f"{g['optimizer']} LR {g['lr']:g}, {g['steps']} steps"
        lines.append(f"| {name} | {len(stock)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Against the LR multiplier, per model size (beta2 0.95, the longest horizon): each variant's
    median gap to stock (left) and the median drift of its estimate (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [g for g in results["groups"] if g["beta2"] == 0.95]
    longest = max(g["steps"] for g in groups)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for size, style in (("small", "-"), ("large", "--")):
        sel = sorted((g for g in groups if g["size"] == size and g["steps"] == longest), key=lambda g: g["lr_mult"])
        for i, v in enumerate(v for v in VARIANTS if v != "stock"):
            xs, gaps, lags = [], [], []
            for g in sel:
                stock = {r["seed"]: r["tail_mean"] for r in g["runs"] if r["variant"] == "stock"}
                mine = [r for r in g["runs"] if r["variant"] == v]
                if not mine:
                    continue
                xs.append(g["lr_mult"])
                gaps.append(statistics.median(100 * (r["tail_mean"] / stock[r["seed"]] - 1) for r in mine))
                lags.append(statistics.median(r["lag_median"] for r in mine))
            color = f"C{i}"
            axes[0].plot(xs, gaps, style, marker="o", color=color, label=f"{v} ({size})")
            axes[1].plot(xs, lags, style, marker="o", color=color, label=f"{v} ({size})")
    axes[0].axhline(0, color="k", lw=0.8)
    axes[0].set(xscale="log", xlabel="learning rate x base", ylabel="held-out gap to stock (%)",
                title=f"median over paired seeds, {longest} steps")
    axes[1].set(xscale="log", xlabel="learning rate x base", ylabel="drift |θ̃ − θ| / |θ_{t+1} − θ_t|",
                title="the estimate's drift (median over steps and seeds)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--table", action="store_true", help="print the table of an existing results file")
    ap.add_argument("--plot", default=None, help="with --table: also draw the gap and drift against LR here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--short", action="store_true", help="the 300-step groups only (stock, paper, la1.5, la2)")
    ap.add_argument("--one-round", action="store_true", help="issue 42: the small model, one-round predictors")
    ap.add_argument("--lr-mults", default="1,2", help="with --one-round")
    ap.add_argument("--sizes", default="small", help="with --one-round or --optimizers: small, large or both (comma-separated)")
    ap.add_argument("--beta2s", default="0.95", help="with --one-round: AdamW's β2 values (comma-separated)")
    ap.add_argument("--optimizers", default=None, help='issue 43: "sgd:0.1,0.3;adafactor:1e-3" (optimizer: peak LRs)')
    ap.add_argument("--steps", type=int, default=300, help="with --one-round or --optimizers")
    ap.add_argument("--seeds", type=int, default=3, help="with --one-round or --optimizers")
    ap.add_argument("--variants", default=None, help="with --one-round or --table: comma-separated")
    a = ap.parse_args()
    if a.one_round or a.optimizers:
        torch.set_num_threads(1)
    if a.table:
        with open(a.out) as f:
            results = json.load(f)
        print(table(merge_seeds(results), a.variants.split(",") if a.variants else None))
        if a.plot:
            plot(results, a.plot)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
               "groups": []}
    spec = [(o, float(lr)) for part in (a.optimizers or "").split(";") if part
            for o, lrs in [part.split(":")] for lr in lrs.split(",")]
    variants = a.variants.split(",") if a.variants else None
    todo = optimizer_groups(spec, a.steps, a.seeds, variants or ("stock", "paper", "la2"), tuple(a.sizes.split(","))) \
        if spec else \
        (one_round_groups(tuple(float(x) for x in a.lr_mults.split(",")), a.steps, a.seeds,
                          a.variants.split(",") if a.variants else ONE_ROUND_VARIANTS, tuple(a.sizes.split(",")),
                          tuple(float(x) for x in a.beta2s.split(",")))
            if a.one_round else groups(a.tiny, a.short))
    if spec:
        results["optimizers"] = a.optimizers
    for kw, meta, runs in todo:
        if time.time() - t0 > a.budget_s:
            print("budget spent; stopping before", meta, flush=True)
            break
        g0 = time.time()
        s = multirun.Setting(**dict({"eval_every": 50 if kw["steps"] >= 300 else max(1, kw["steps"] // 3)}, **kw))
        recs = multirun.run_group(s, runs, a.device)
        meta = dict(meta, wall_s=time.time() - g0, runs=recs)
        results["groups"].append(meta)
        with open(a.out, "w") as f:
            json.dump(results, f)
        tails = {}
        for r in recs:
            tails.setdefault(r["variant"], []).append(r["tail_mean"])
        stock = tails["stock"]
        summary = {v: round(sorted(100 * (x / y - 1) for x, y in zip(ts, stock))[len(ts) // 2], 2)
                   for v, ts in tails.items()}
        print(f"{time.time() - t0:6.0f}s {meta.get('optimizer', '')} {meta['size']} lr x{meta['lr_mult']:g} "
              f"b2 {meta['beta2']} {meta['steps']} steps "
              f"({meta['wall_s']:.0f}s): median gap % {summary}", flush=True)
    print("done", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
