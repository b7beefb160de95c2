"""Write an A/B summary as JSON, a Markdown table and PNG plots (matplotlib, Agg backend).

Plots per run: loss vs tokens, loss vs training time (train loss lines, held-out points on
committed weights), step-time breakdown (stacked bars: compute, exposed communication, rest),
and measured vs predicted speedup. :func:`write_matrix` combines several runs' summaries.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from typing import Dict, List, Optional, Sequence

ORDER = ("stock", "fixed", "shared", "dynamic", "dynamic_sqrt", "dynamic_linear", "dpu", "fsdp_stock", "fsdp_fixed", "fsdp_dynamic", "fsdp_dpu")
LABELS = {"stock": "stock ZeRO-1", "fixed": "ACCO fixed", "shared": "ACCO shared", "dynamic": "ACCO dynamic", "dpu": "DPU",
          "dynamic_sqrt": "ACCO dynamic, LR × √(batch ratio)", "dynamic_linear": "ACCO dynamic, LR × batch ratio",
          "fsdp_stock": "stock FSDP2", "fsdp_fixed": "FSDP2 ACCO fixed", "fsdp_dynamic": "FSDP2 ACCO dynamic",
          "fsdp_dpu": "FSDP2 DPU", "fsdp_stock_sharded": "stock FSDP2, resharded",
          "fsdp_fixed_sharded": "FSDP2 ACCO fixed, sharded params"}


def _fmt(v, spec: str = ".3f", none: str = "–") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _mib(v) -> str:
    return "–" if v is None else f"{v / 2 ** 20:.0f}"


def ordered(variants: Dict[str, dict]) -> List[str]:
    return [k for k in ORDER if k in variants] + sorted(k for k in variants if k not in ORDER)


def _baseline_note(variants: Dict[str, dict]) -> str:
    if not any(k.startswith("fsdp_") for k in variants):
        return ""
    base = "stock FSDP2" if "fsdp_stock" in variants else "stock ZeRO-1 (stock FSDP2 did not run)"
    return (f"; FSDP2 variants are compared with {base} (× its stock), the others and stock FSDP2 with stock "
            "ZeRO-1; pred. step s is the advisor's model of DeepSpeed's collectives for the variant's mode")


def markdown_table(summary: dict) -> str:
    """One row per variant: the figures the issue asks for."""
    head = ("| variant | step s (median) | spread p25–p75 | tokens/s | × its stock | compute s | exposed comm s | "
            "overlap eff. | vs ideal | busy | peak mem Δ MiB | held-out | gap | pred. step s |")
    lines = [f"**{summary['label']}** — {summary['world']} ranks, gradient_accumulation_steps {summary['gas']}, "
             f"{summary['rate']}, {summary['n_params'] / 1e6:.1f}M params, "
             f"{summary['steps'] - summary['warmup']} timed steps after {summary['warmup']} warm-up"
             + _baseline_note(summary["variants"]),
             "", head, "|" + "---|" * (head.count("|") - 1)]
    if summary.get("heterogeneity"):
        lines[0:0] = [f"**{summary['heterogeneity']}**", ""]
    if summary.get("emulation"):
        lines[0:0] = [f"**{summary['emulation']}**", ""]
    for k in ordered(summary["variants"]):
        v = summary["variants"][k]
        sp = v.get("step_spread") or {}
        spread = f"{_fmt(sp.get('p25'))}–{_fmt(sp.get('p75'))}" if sp else "–"
        lines.append(
            f"| {LABELS.get(k, k)} | {_fmt(v['step_s'])} | {spread} | {_fmt(v['tokens_per_s'], '.0f')} | "
            f"{_fmt(v.get('speedup_tokens'), '.2f')} | {_fmt(v['compute_probe_s'])} | {_fmt(v['exposed_comm_s'])} | "
            f"{_fmt(v['overlap_efficiency'], '.2f')} | {_fmt(v['vs_ideal'], '.2f')} | {_fmt(v['compute_busy'], '.0%')} | "
            f"{_mib(v['peak_mem_delta_bytes'])} | {_fmt(v['final_heldout'], '.4f')} | "
            f"{_fmt(v.get('heldout_gap'), '+.2%')} | {_fmt(v['predicted_step_s'])} |")
    adv = summary["advice"]
    pr = summary["probe"]
    beside = (f" ({pr['round_overlap_s']:.3f}s and {pr['micro_batch_overlap_s'] * 1e3:.0f} ms while both run)"
              if pr.get("round_overlap_s") else "")
    lines += ["", f"Probe: one round {summary['probe_round_s']:.3f}s isolated, "
              f"{_fmt(pr['micro_batch_s'] * 1e3, '.0f')} ms per micro-batch{beside}; advisor: "
              f"**{adv['mode']}** at gradient_accumulation_steps {adv['gradient_accumulation_steps']} — {adv['reason']}"]
    val = summary["validation"]
    if val["mean_abs_error"] is not None:
        lines.append(f"Advisor step-time error: mean |err| {val['mean_abs_error']:.1%}, max {val['max_abs_error']:.1%} ("
                     + ", ".join(f"{p['mode']} {p['error']:+.0%}" for p in val["points"]) + ")")
    return "\n".join(lines)


def write(summary: dict, out_dir: str, label: str) -> List[str]:
    """Write ``<label>.json``, ``<label>.md`` and ``<label>_*.png``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    p = os.path.join(out_dir, f"{label}.json")
    with open(p, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    paths.append(p)
    p = os.path.join(out_dir, f"{label}.md")
    with open(p, "w") as f:
        f.write(markdown_table(summary) + "\n")
    paths.append(p)
    paths += plot_run(summary, out_dir, label)
    return paths


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_run(summary: dict, out_dir: str, label: str) -> List[str]:
    """The four plots of one run."""
    plt = _plt()
    variants = summary["variants"]
    names = ordered(variants)
    paths = []
    for x_key, x_label, suffix in (("tokens", "tokens (global)", "loss_tokens"),
                                   ("time_s", "training wall time (s, rank 0)", "loss_time")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in names:
            v = variants[k]
            line, = ax.plot([p[x_key] for p in v["train_curve"]], [p["loss"] for p in v["train_curve"]],
                            label=f"{LABELS.get(k, k)} train", alpha=0.8)
            held = v["heldout_curve"]
            if held:
                ax.plot([p[x_key] for p in held], [p["loss"] for p in held], "o--", color=line.get_color(),
                        label=f"{LABELS.get(k, k)} held-out")
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss")
        ax.set_title(f"{label}: loss vs {x_key.replace('_s', '')}")
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out_dir, f"{label}_{suffix}"))
    # step-time breakdown
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    comp, exp, rest = [], [], []
    for k in names:
        v = variants[k]
        step = v["step_s"] or 0.0
        # stock: its own in-loop compute (same contention as its steps); others: the probe's
        c = min(step, v.get("compute_in_loop_s") or v["compute_probe_s"] or 0.0)
        e = min(max(0.0, step - c), max(0.0, v["exposed_comm_s"] or 0.0))
        comp.append(c)
        exp.append(e)
        rest.append(max(0.0, step - c - e))
    xs = range(len(names))
    ax.bar(xs, comp, label="compute (stock: in-loop; others: probe)")
    ax.bar(xs, exp, bottom=comp, label="exposed communication")
    ax.bar(xs, rest, bottom=[a + b for a, b in zip(comp, exp)], label="other (contention, copies)")
    ax.set_xticks(list(xs), [LABELS.get(k, k) for k in names], fontsize=8, rotation=25, ha="right")
    ax.set_ylabel("seconds per optimizer step (median)")
    ax.set_title(f"{label}: step-time breakdown")
    ax.legend(fontsize=7)
    paths.append(_save(plt, fig, out_dir, f"{label}_breakdown"))
    # measured vs predicted speedup (tokens/s ratio to stock)
    others = [k for k in names if variants[k].get("speedup_tokens") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(others)), 4.5))
    meas = [variants[k].get("speedup_tokens") or 0.0 for k in others]
    pred = [variants[k].get("predicted_speedup_tokens") or 0.0 for k in others]
    xs = range(len(others))
    ax.bar([x - 0.2 for x in xs], meas, width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], pred, width=0.4, label="predicted (advisor)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(xs), [LABELS.get(k, k) for k in others], fontsize=8, rotation=25, ha="right")
    ax.set_ylabel("tokens/s relative to its stock baseline")
    ax.set_title(f"{label}: measured vs predicted speedup")
    ax.legend(fontsize=7)
    paths.append(_save(plt, fig, out_dir, f"{label}_speedup"))
    return paths


def load_summaries(paths: Sequence[str]) -> List[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            s = json.load(f)
        if isinstance(s, dict) and "variants" in s and "validation" in s:  # not raw records or specs
            out.append(s)
    return out


def write_matrix(summaries: Sequence[dict], out_dir: str) -> List[str]:
    """Combine runs: one Markdown file with every table and a scatter of measured vs predicted
    step time over all runs; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    from .advisor import validate
    points = [p for s in summaries for p in s["validation"]["points"]]
    val = validate(points)
    md = [markdown_table(s) + "\n" for s in summaries]
    md.append(f"Advisor over all runs: mean |error| {_fmt(val['mean_abs_error'], '.1%')}, max "
              f"{_fmt(val['max_abs_error'], '.1%')}; by mode: "
              + ", ".join(f"{m} {e:.1%}" for m, e in val["mean_abs_error_by_mode"].items()))
    path_md = os.path.join(out_dir, "matrix.md")
    with open(path_md, "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out_dir, "matrix_validation.json"), "w") as f:
        json.dump(val, f, indent=1)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    for mode in ORDER:
        ps = [p for p in val["points"] if p["mode"] == mode]
        if not ps:
            continue
        ax.scatter([p["measured_step_s"] for p in ps], [p["predicted_step_s"] for p in ps], label=LABELS[mode])
    hi = max([p["measured_step_s"] for p in val["points"]] + [p["predicted_step_s"] for p in val["points"]] + [1])
    ax.plot([0, hi], [0, hi], color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured s per step (dynamic: per fixed-size token budget)")
    ax.set_ylabel("predicted s")
    ax.set_title("advisor: predicted vs measured")
    ax.legend(fontsize=7)
    return [path_md, _save(plt, fig, out_dir, "matrix_predicted_vs_measured")]


# -- sweeps over the communication / compute ratio ------------------------------------------------
def sweep_points(summaries: Sequence[dict]) -> List[dict]:
    """One point per run: the measured ratio (one isolated round over half a step's compute, the
    probe's figures), each variant's step time and speedup over stock, and the ideal step times
    (stock C + c, ACCO fixed max(C, 2c), DPU max(C, c); C the step's compute, c one round)."""
    points = []
    for s in summaries:
        probe, gas, v = s["probe"], s["gas"], s["variants"]
        compute = probe["micro_batch_s"] * gas
        c = s["probe_round_s"]
        point = {"label": s["label"], "world": s["world"], "gas": gas, "emulation": bool(s.get("emulation")),
                 "ratio": c / (compute / 2), "compute_s": compute, "round_s": c,
                 "ideal": {"stock": compute + c, "fixed": max(compute, 2 * c), "dpu": max(compute, c)}}
        stock = v.get("stock", {}).get("step_s")
        for name in ("stock", "fixed", "dpu", "dynamic"):
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
        for name in ("stock", "fixed", "dpu", "dynamic"):
            runs = [p[name] for p in ps if p.get(name)]
            if not runs:
                continue
            m[name] = {k: med([r[k] for r in runs if r.get(k) is not None]) for k in ("step_s", "speedup", "busy", "vs_ideal")}
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
    lines = (["**EMULATION** (accelerator stand-in: compute is a wait, no CPU; real gradients and rounds over "
              "the emulated network)", ""] if emulated else []) + [
        "| point | ranks | runs | round / half-step compute | stock s | fixed s (× stock, vs ideal) | DPU s (× stock, "
        "vs ideal) | dynamic s per stock-sized step (× stock, busy) |", "|---|---|---|---|---|---|---|---|"]

    def cell(p, name, extra):
        x = p.get(name)
        if not x:
            return "–"
        return f"{x['step_s']:.3f} ({_fmt(x['speedup'], '.2f')}×, {extra(x)})"

    def vs_ideal(x):
        lo_hi = x.get("vs_ideal_range")
        spread = f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi and lo_hi[0] != lo_hi[1] else ""
        return _fmt(x["vs_ideal"], ".2f") + spread
    if any(p["runs"] > 1 for p in points):
        lines[-2:-2] = ["Medians over the runs of each point; [range] of \"vs ideal\" over them.", ""]
    for p in points:
        lines.append(f"| {p['label']} | {p['world']} | {p['runs']} | {p['ratio']:.2f} | "
                     f"{_fmt(p.get('stock', {}).get('step_s'))} | {cell(p, 'fixed', vs_ideal)} | {cell(p, 'dpu', vs_ideal)} | "
                     f"{cell(p, 'dynamic', lambda x: 'busy ' + _fmt(x['busy'], '.0%'))} |")
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
        for name, style in (("fixed", "o-"), ("dpu", "s-"), ("dynamic", "^-")):
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


# -- time to a target loss -----------------------------------------------------------------------
def crossing_time(curve: Sequence[dict], target: float) -> Optional[float]:
    """Training time at which a held-out curve first reaches ``target``, interpolated linearly
    between the two evaluations around the crossing (None: never reached)."""
    prev = None
    for p in curve:
        if p["loss"] <= target:
            if prev is None:
                return p["time_s"]
            f = (prev["loss"] - target) / (prev["loss"] - p["loss"])
            return prev["time_s"] + f * (p["time_s"] - prev["time_s"])
        prev = p
    return None


def loss_at_time(curve: Sequence[dict], t: float, key: str = "time_s") -> Optional[float]:
    """Held-out loss at training time ``t`` (or at ``t`` tokens, ``key="tokens"``), interpolated
    between evaluations (None: outside the curve)."""
    for a, b in zip(curve, curve[1:]):
        if a[key] <= t <= b[key]:
            return a["loss"] + (b["loss"] - a["loss"]) * (t - a[key]) / ((b[key] - a[key]) or 1.0)
    return curve[-1]["loss"] if curve and curve[-1][key] == t else None


def _row_name(name: str, gas: int, main_gas: int) -> str:
    return name if gas == main_gas else f"{name}@gas{gas}"


def time_to_target(summaries: Sequence[dict], target: Optional[float] = None) -> dict:
    """Time to a target held-out loss and loss at equal wall-clock, per variant, over repeated
    launches of one setting (``-rep<k>`` labels; launches at another gradient_accumulation_steps,
    e.g. stock at dynamic's larger batch, become rows ``<variant>@gas<A>``). Ratios are taken
    within each repeat (side by side), then the median over repeats.

    Default target: 1.01 × the median over repeats of stock's last held-out loss (at the main
    gradient_accumulation_steps: that of the launches that ran ACCO fixed)."""
    import re
    import statistics
    if not summaries:
        raise ValueError("no summaries to combine")
    from .advisor import setup_key
    setups = {setup_key(s): s["label"] for s in summaries}
    if len(setups) > 1:
        raise ValueError(f"runs of different setups ({', '.join(sorted(setups.values()))}): time to target compares "
                         "variants of one setting (ranks, network, model, compute); pass one setting's runs")
    main_gas = next((s["gas"] for s in summaries if "fixed" in s["variants"]), summaries[0]["gas"])
    rep = lambda s: int(m.group(1)) if (m := re.search(r"-rep(\d+)$", s["label"])) else 0  # noqa: E731
    curves: Dict[int, Dict[str, dict]] = {}
    for s in summaries:
        for name, v in s["variants"].items():
            if v.get("heldout_curve"):
                key = _row_name(name, s["gas"], main_gas)
                if key in curves.get(rep(s), {}):
                    raise ValueError(f"two runs of {key!r} in repeat {rep(s)} (label {s['label']!r}): give each "
                                     "launch of a setting its own -rep<k> label")
                curves.setdefault(rep(s), {})[key] = {
                    "curve": v["heldout_curve"], "tokens_per_step": v.get("tokens_per_step"), "step_s": v.get("step_s")}
    if target is None:
        finals = [c["stock"]["curve"][-1]["loss"] for c in curves.values() if "stock" in c]
        if not finals:
            raise ValueError("no stock run at the main gradient_accumulation_steps: pass a target loss")
        target = 1.01 * statistics.median(finals)
    per_rep: Dict[str, List[dict]] = {}
    for k, rows in sorted(curves.items()):
        t_equal = min(r["curve"][-1]["time_s"] for r in rows.values())
        tokens_equal = rows["stock"]["curve"][-1]["tokens"] if "stock" in rows else None
        stock_t = crossing_time(rows["stock"]["curve"], target) if "stock" in rows else None
        for name, r in rows.items():
            t = crossing_time(r["curve"], target)
            per_rep.setdefault(name, []).append({
                "rep": k, "time_to_target_s": t, "vs_stock": (stock_t / t) if stock_t and t else None,
                "loss_at_equal_time": loss_at_time(r["curve"], t_equal), "equal_time_s": t_equal,
                "loss_at_equal_tokens": loss_at_time(r["curve"], tokens_equal, "tokens") if tokens_equal else None,
                "tokens_per_step": r["tokens_per_step"], "step_s": r["step_s"],
                "final_loss": r["curve"][-1]["loss"], "final_time_s": r["curve"][-1]["time_s"]})
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    rows = []
    for name in sorted(per_rep, key=lambda n: (ORDER.index(n.split("@")[0]) if n.split("@")[0] in ORDER else 99, n)):
        rs = per_rep[name]
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        ratios = [r["vs_stock"] for r in rs if r["vs_stock"] is not None]
        eq = [r["loss_at_equal_time"] for r in rs if r["loss_at_equal_time"] is not None]
        rows.append({"variant": name, "runs": len(rs), "reached": len(reached),
                     "time_to_target_s": med(reached) if len(reached) == len(rs) else None,
                     "time_to_target_range": [min(reached), max(reached)] if reached else None,
                     "vs_stock": med(ratios) if len(ratios) == len(rs) else None,
                     "vs_stock_range": [min(ratios), max(ratios)] if ratios else None,
                     "loss_at_equal_time": med(eq), "equal_time_s": med([r["equal_time_s"] for r in rs]),
                     "loss_at_equal_tokens": med([r["loss_at_equal_tokens"] for r in rs
                                                  if r["loss_at_equal_tokens"] is not None]),
                     "tokens_per_step": med([r["tokens_per_step"] for r in rs if r["tokens_per_step"]]),
                     "step_s": med([r["step_s"] for r in rs if r["step_s"]]), "repeats": rs})
    return {"target": target, "main_gas": main_gas, "rows": rows,
            "emulation": any(s.get("emulation") for s in summaries),
            "heterogeneity": next((s["heterogeneity"] for s in summaries if s.get("heterogeneity")), None),
            "labels": sorted(s["label"] for s in summaries), "curves": curves}


def time_to_target_markdown(res: dict) -> str:
    """The table of :func:`time_to_target`'s result."""
    lines = (["**EMULATION** (accelerator stand-in: compute is a wait, no CPU; real gradients, real rounds "
              "over the emulated network, real held-out loss of the model trained)", ""] if res["emulation"] else [])
    if res.get("heterogeneity"):
        lines += [f"**{res['heterogeneity']}**", ""]
    stock_eq = next((r["loss_at_equal_tokens"] for r in res["rows"] if r["variant"] == "stock"), None)
    lines += [f"Target held-out loss {res['target']:.4f}. Medians over repeats; [range]. Time = training time "
              "(evaluations excluded), crossing interpolated between evaluations. Ratios within each repeat.", "",
              "| variant | runs | tokens per step | s per step | time to target s [range] | × stock (faster > 1) | "
              "held-out loss at equal time | held-out loss at stock's tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        base = r["variant"].split("@")[0]
        name = LABELS.get(base, base) + (f" (gradient_accumulation_steps {r['variant'].split('@gas')[1]})"
                                         if "@gas" in r["variant"] else "")
        rng = r["time_to_target_range"]
        ttt = (f"{r['time_to_target_s']:.1f} [{rng[0]:.1f}–{rng[1]:.1f}]" if r["time_to_target_s"] is not None
               else f"not reached in {r['runs'] - r['reached']} of {r['runs']}")
        vr = r["vs_stock_range"]
        vs = (f"{r['vs_stock']:.2f} [{vr[0]:.2f}–{vr[1]:.2f}]" if r["vs_stock"] is not None else "–")
        lines.append(f"| {name} | {r['runs']} | {_fmt(r['tokens_per_step'], '.0f')} | {_fmt(r['step_s'])} | {ttt} | "
                     f"{vs} | {_fmt(r['loss_at_equal_time'], '.4f')} (at {_fmt(r['equal_time_s'], '.0f')} s) | "
                     f"{_fmt(r['loss_at_equal_tokens'], '.4f')}{_gap(r['loss_at_equal_tokens'], stock_eq)} |")
    return "\n".join(lines)


def _gap(loss: Optional[float], stock: Optional[float]) -> str:
    """`` (+0.36%)``: a loss relative to stock's, for the tables (empty without both)."""
    if loss is None or not stock:
        return ""
    return f" ({(loss / stock - 1) * 100:+.2f}%)"


def write_time_to_target(summaries: Sequence[dict], out_dir: str, stem: str = "time_to_target",
                         target: Optional[float] = None) -> List[str]:
    """The time-to-target table (Markdown, JSON) and held-out loss against training time (PNG)."""
    res = time_to_target(summaries, target)
    os.makedirs(out_dir, exist_ok=True)
    lines = [time_to_target_markdown(res)]
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    js = os.path.join(out_dir, f"{stem}.json")
    with open(js, "w") as f:
        json.dump({k: v for k, v in res.items()}, f, indent=1)
    paths = [md, js]
    try:
        plt = _plt()
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for k, rows in sorted(res["curves"].items()):
        for name, r in rows.items():
            base = name.split("@")[0]
            label = (LABELS.get(base, base) + (f" ({name.split('@')[1]})" if "@" in name else "")) if k == min(res["curves"]) else None
            line, = ax.plot([p["time_s"] for p in r["curve"]], [p["loss"] for p in r["curve"]], lw=1,
                            color=colors.get(name), label=label, alpha=0.85)
            colors.setdefault(name, line.get_color())
    ax.axhline(res["target"], color="grey", ls=":", lw=1, label=f"target {res['target']:.3f}")
    ax.set_xlabel("training time, s (evaluations excluded)")
    ax.set_ylabel("held-out loss (committed weights)")
    ax.set_title(("EMULATION: " if res["emulation"] else "") + "held-out loss against training time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return paths + [_save(plt, fig, out_dir, stem)]


def tail_fidelity(summaries: Sequence[dict], tail: float = 0.3) -> dict:
    """Long-run fidelity at equal tokens: each variant's held-out loss averaged over the evaluations
    in the last ``tail`` of the run (steps > (1 - tail) × steps), against stock's over the same
    steps, per summary (one launch: one learning rate, one model). Single evaluations wander by
    about ±2% at a constant LR; the tail average is what the fidelity goal (≤ stock + 0.5%) judges.
    Variants of different batches (dynamic) are compared at stock's tokens, interpolated."""
    rows = []
    for s in summaries:
        v = s["variants"]
        stock = v.get("stock") or v.get("fsdp_stock")
        if not stock or not stock.get("heldout_curve"):
            raise ValueError(f"{s.get('label')}: no stock held-out curve to compare with")
        steps = s["steps"]
        first = (1 - tail) * steps
        pts = [p for p in stock["heldout_curve"] if p["step"] > first]
        if not pts:
            raise ValueError(f"{s.get('label')}: no evaluation in the last {tail:.0%} of {steps} steps (--eval-every)")
        base = sum(p["loss"] for p in pts) / len(pts)
        for name, x in v.items():
            curve = x.get("heldout_curve") or []
            losses = [loss_at_time(curve, p["tokens"], "tokens") for p in pts]
            if not curve or any(loss is None for loss in losses):
                continue
            mean = sum(losses) / len(losses)
            rows.append({"label": s.get("label"), "variant": name, "steps": steps, "evaluations": len(pts),
                         "from_step": min(p["step"] for p in pts), "tail_loss": mean, "stock_tail_loss": base,
                         "gap": mean / base - 1.0, "final_loss": curve[-1]["loss"],
                         "final_gap": curve[-1]["loss"] / stock["heldout_curve"][-1]["loss"] - 1.0})
    return {"tail": tail, "rows": rows, "emulation": any(s.get("emulation") for s in summaries)}


def tail_fidelity_markdown(res: dict) -> str:
    lines = (["**EMULATION**", ""] if res["emulation"] else [])
    lines += [f"Held-out loss at equal tokens, averaged over the evaluations in the last {res['tail']:.0%} of each "
              "run, against stock's at the same tokens.", "",
              "| run | variant | steps | evaluations (from step) | tail-mean held-out | stock's | gap | final-point gap |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['label']} | {LABELS.get(r['variant'], r['variant'])} | {r['steps']} | {r['evaluations']} "
                     f"({r['from_step']}) | {r['tail_loss']:.4f} | {r['stock_tail_loss']:.4f} | {r['gap'] * 100:+.2f}% | "
                     f"{r['final_gap'] * 100:+.2f}% |")
    seeded = seed_medians(res["rows"])
    if any(len(g["gaps"]) > 1 for g in seeded):
        lines += ["", "Over seeds (runs labelled `-s<seed>`; no suffix: seed 0): the median tail-mean gap and its range.",
                  "", "| run | variant | seeds | median gap | range |", "|---|---|---|---|---|"]
        for g in seeded:
            lines.append(f"| {g['label']} | {LABELS.get(g['variant'], g['variant'])} | {len(g['gaps'])} | "
                         f"{g['median'] * 100:+.2f}% | {min(g['gaps']) * 100:+.2f}% – {max(g['gaps']) * 100:+.2f}% |")
    return "\n".join(lines)


def seed_medians(rows: Sequence[dict]) -> List[dict]:
    """The tail gaps of runs that differ only in their seed (label suffix ``-s<seed>``), grouped,
    with their median; groups in first-seen order, stock's own (always 0) left out."""
    groups: Dict[tuple, List[float]] = {}
    for r in rows:
        if r["variant"] in ("stock", "fsdp_stock"):
            continue
        groups.setdefault((re.sub(r"-s\d+$", "", str(r["label"])), r["variant"]), []).append(r["gap"])
    return [{"label": label, "variant": variant, "gaps": gaps, "median": statistics.median(gaps)}
            for (label, variant), gaps in groups.items()]
