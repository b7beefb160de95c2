"""Speedup against the communication / compute ratio over many A/B runs, with the ideal curves:
Markdown table and plot."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from .report import LABELS, fmt


# -- sweeps over the communication / compute ratio ------------------------------------------------
NAMES = ("stock", "fixed", "dpu", "one_round", "dynamic", "auto", "auto_all")
AUTO_CANDIDATES = {"auto": ("stock", "fixed"), "auto_all": ("stock", "fixed", "one_round")}
"""The modes each auto variant may run (its ``auto_modes``): its step is compared with the best of them."""


def sweep_points(summaries: Sequence[dict]) -> List[dict]:
    """One point per run: the measured ratio (one isolated round over half a step's compute, the
    probe's figures), each variant's step time and speedup over stock, and the ideal step times
    (stock C + c, ACCO fixed max(C, 2c), DPU and one-round max(C, c); C the step's compute, c one round)."""
    points = []
    for s in summaries:
        probe, gas, v = s["probe"], s["gas"], s["variants"]
        compute = probe["micro_batch_s"] * gas
        c = s["probe_round_s"]
        point = {"label": s["label"], "world": s["world"], "gas": gas, "emulation": bool(s.get("emulation")),
                 "ratio": c / (compute / 2), "compute_s": compute, "round_s": c,
                 "ideal": {"stock": compute + c, "fixed": max(compute, 2 * c), "dpu": max(compute, c),
                           "one_round": max(compute, c)}}
        stock = v.get("stock", {}).get("step_s")
        for name in NAMES:
            if name not in v or not v[name].get("step_s"):
                continue
            x = v[name]
            # dynamic steps vary in size: its time per stock-sized step, from time per token
            per_token = 1 / x["tokens_per_s"] if x.get("tokens_per_s") else None
            stock_tokens = v.get("stock", {}).get("tokens_per_step")
            step = x["step_s"] if name != "dynamic" or not (per_token and stock_tokens) else per_token * stock_tokens
            point[name] = {"step_s": step, "speedup": stock / step if stock else None,
                           "busy": x.get("compute_busy"), "vs_ideal": (step / point["ideal"][name]
                                                                        if name in point["ideal"] else None)}
            if name in AUTO_CANDIDATES:  # against the best of its candidates measured in the same run
                best = [v[c]["step_s"] for c in AUTO_CANDIDATES[name] if v.get(c, {}).get("step_s")]
                point[name]["vs_best"] = step / min(best) if len(best) == len(AUTO_CANDIDATES[name]) else None
                point[name]["chose"] = (x.get("auto") or {}).get("choice")
        points.append(point)
    return sorted(points, key=lambda p: (p["world"], p["ratio"]))


def sweep_medians(points: Sequence[dict]) -> List[dict]:
    """Repeats of one point (labels that differ only in a ``-rep<k>`` suffix, same world and gas)
    merged: the median of every figure, the number of runs, and the range of each ``vs_ideal``."""
    import re
    import statistics
    groups: Dict[tuple, List[dict]] = {}
    for p in points:
        groups.setdefault((p["world"], p["gas"], re.sub(r"-rep\d+$", "", p["label"])), []).append(p)
    out = []
    for (world, gas, label), ps in groups.items():
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        m = {"label": label, "world": world, "gas": gas, "runs": len(ps), "emulation": any(p["emulation"] for p in ps)}
        for k in ("ratio", "compute_s", "round_s"):
            m[k] = med([p[k] for p in ps])
        m["ideal"] = {k: med([p["ideal"][k] for p in ps]) for k in ps[0]["ideal"]}
        for name in NAMES:
            runs = [p[name] for p in ps if p.get(name)]
            if not runs:
                continue
            m[name] = {k: med([r[k] for r in runs if r.get(k) is not None])
                       for k in ("step_s", "speedup", "busy", "vs_ideal", "vs_best")}
            if name in AUTO_CANDIDATES:
                m[name]["chose"] = [r.get("chose") for r in runs]
                best = [r["vs_best"] for r in runs if r.get("vs_best") is not None]
                m[name]["vs_best_range"] = [min(best), max(best)] if best else None
            ideal = [r["vs_ideal"] for r in runs if r.get("vs_ideal") is not None]
            m[name]["vs_ideal_range"] = [min(ideal), max(ideal)] if ideal else None
        out.append(m)
    return sorted(out, key=lambda p: (p["world"], p["ratio"]))


def write_sweep(summaries: Sequence[dict], out_dir: str, stem: str = "sweep") -> List[str]:
    """A Markdown table and a plot of speedup over stock against the ratio, with the ideal curves;
    repeats of a point (``-rep<k>`` labels) as medians, with the range of "vs ideal"."""
    runs = sweep_points(summaries)
    points = sweep_medians(runs)
    os.makedirs(out_dir, exist_ok=True)
    emulated = any(p["emulation"] for p in points)

    def cell(p, name, extra):
        x = p.get(name)
        if not x:
            return "–"
        return f"{x['step_s']:.3f} ({fmt(x['speedup'], '.2f')}×, {extra(x)})"

    def vs_ideal(x):
        lo_hi = x.get("vs_ideal_range")
        spread = f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi and lo_hi[0] != lo_hi[1] else ""
        return fmt(x["vs_ideal"], ".2f") + spread

    def vs_best(x):
        lo_hi = x.get("vs_best_range")
        spread = f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi and lo_hi[0] != lo_hi[1] else ""
        chose = x.get("chose")
        chose = chose if isinstance(chose, list) else [chose]
        return fmt(x.get("vs_best"), ".2f") + spread + "; chose " + ", ".join(str(c) for c in chose)
    # fixed, DPU and dynamic always (the sweep's original columns); one-round and auto where a run had them
    cols = [("fixed", "fixed s (× stock, vs ideal)", vs_ideal), ("dpu", "DPU s (× stock, vs ideal)", vs_ideal),
            ("one_round", "one-round s (× stock, vs ideal)", vs_ideal),
            ("dynamic", "dynamic s per stock-sized step (× stock, busy)", lambda x: "busy " + fmt(x["busy"], ".0%")),
            ("auto", "auto s (× stock, vs best of stock / fixed; chose)", vs_best),
            ("auto_all", "auto_all s (× stock, vs best of stock / fixed / one-round; chose)", vs_best)]
    cols = [c for c in cols if c[0] in ("fixed", "dpu", "dynamic") or any(p.get(c[0]) for p in points)]
    lines = (["**EMULATION** (accelerator stand-in: compute is a wait, no CPU; real gradients and rounds over "
              "the emulated network)", ""] if emulated else []) + [
        "| point | ranks | runs | round / half-step compute | stock s | " + " | ".join(h for _, h, _ in cols) + " |",
        "|---|---|---|---|---|" + "---|" * len(cols)]
    if any(p["runs"] > 1 for p in points):
        lines[-2:-2] = ["Medians over the runs of each point; [range] of \"vs ideal\" over them (auto columns: of "
                        "\"vs best\").", ""]
    for p in points:
        lines.append(f"| {p['label']} | {p['world']} | {p['runs']} | {p['ratio']:.2f} | "
                     f"{fmt(p.get('stock', {}).get('step_s'))} | " + " | ".join(cell(p, n, e) for n, _, e in cols) + " |")
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"medians": points, "runs": runs}, f, indent=1)
    paths = [md, os.path.join(out_dir, f"{stem}.json")]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for world in sorted({p["world"] for p in points}):
        ps = [p for p in points if p["world"] == world]
        xs = [p["ratio"] for p in ps]
        for name, style in (("fixed", "o-"), ("dpu", "s-"), ("one_round", "D-"), ("dynamic", "^-")):
            if not any(p.get(name) for p in ps):
                continue
            ys = [p[name]["speedup"] if p.get(name) else float("nan") for p in ps]
            note = " (per token, at its larger batches)" if name == "dynamic" else ""
            ax.plot(xs, ys, style, label=f"{LABELS[name]}, {world} ranks{note}")
        for name, style in (("fixed", ":"), ("dpu", "--")):
            ideal = [p["ideal"]["stock"] / p["ideal"][name] for p in ps]
            ax.plot(xs, ideal, style, color="grey", label=f"ideal {LABELS[name]}, {world} ranks")
    ax.set_xscale("log")
    ticks = [0.1, 0.25, 0.5, 1, 2, 4]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("one round / half a step's compute")
    ax.set_ylabel("speedup over stock ZeRO-1 (step time)")
    ax.set_title(("EMULATION: " if emulated else "") + "speedup against the communication / compute ratio")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    png = os.path.join(out_dir, f"{stem}.png")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return paths + [png]
