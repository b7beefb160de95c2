"""Write an A/B summary as JSON, a Markdown table and PNG plots (matplotlib, Agg backend).

Plots per run: loss vs tokens, loss vs training time (train loss lines, held-out points on
committed weights), step-time breakdown (stacked bars: compute, exposed communication, rest),
and measured vs predicted speedup. :func:`write_matrix` combines several runs' summaries;
:mod:`.report_sweep` and :mod:`.report_quality` report across runs (ratio sweeps, time to target,
fidelity).
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Sequence

ORDER = ("stock", "stock_overlap", "fixed", "shared", "dynamic", "dynamic_sqrt", "dynamic_linear", "dpu", "one_round", "auto", "auto_all", "fsdp_stock", "fsdp_fixed", "fsdp_dynamic", "fsdp_dpu")
LABELS = {"stock": "stock ZeRO-1", "stock_overlap": "stock ZeRO-1, overlap_comm", "fixed": "ACCO fixed", "shared": "ACCO shared", "dynamic": "ACCO dynamic", "dpu": "DPU", "one_round": "one-round (ef)", "auto": "auto (stock / fixed)", "auto_all": "auto (stock / fixed / one-round)",
          "dynamic_sqrt": "ACCO dynamic, LR × √(batch ratio)", "dynamic_linear": "ACCO dynamic, LR × batch ratio",
          "fsdp_stock": "stock FSDP2", "fsdp_fixed": "FSDP2 ACCO fixed", "fsdp_dynamic": "FSDP2 ACCO dynamic",
          "fsdp_dpu": "FSDP2 DPU", "fsdp_stock_sharded": "stock FSDP2, resharded",
          "fsdp_fixed_sharded": "FSDP2 ACCO fixed, sharded params"}


def fmt(v, spec: str = ".3f", none: str = "–") -> str:
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
        spread = f"{fmt(sp.get('p25'))}–{fmt(sp.get('p75'))}" if sp else "–"
        lines.append(
            f"| {LABELS.get(k, k)} | {fmt(v['step_s'])} | {spread} | {fmt(v['tokens_per_s'], '.0f')} | "
            f"{fmt(v.get('speedup_tokens'), '.2f')} | {fmt(v['compute_probe_s'])} | {fmt(v['exposed_comm_s'])} | "
            f"{fmt(v['overlap_efficiency'], '.2f')} | {fmt(v['vs_ideal'], '.2f')} | {fmt(v['compute_busy'], '.0%')} | "
            f"{_mib(v['peak_mem_delta_bytes'])} | {fmt(v['final_heldout'], '.4f')} | "
            f"{fmt(v.get('heldout_gap'), '+.2%')} | {fmt(v['predicted_step_s'])} |")
    adv = summary["advice"]
    pr = summary["probe"]
    beside = (f" ({pr['round_overlap_s']:.3f}s and {pr['micro_batch_overlap_s'] * 1e3:.0f} ms while both run)"
              if pr.get("round_overlap_s") else "")
    lines += ["", f"Probe: one round {summary['probe_round_s']:.3f}s isolated, "
              f"{fmt(pr['micro_batch_s'] * 1e3, '.0f')} ms per micro-batch{beside}; advisor: "
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


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_run(summary: dict, out_dir: str, label: str) -> List[str]:
    """The four plots of one run."""
    plt = pyplot()
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
        paths.append(save_figure(plt, fig, out_dir, f"{label}_{suffix}"))
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
    paths.append(save_figure(plt, fig, out_dir, f"{label}_breakdown"))
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
    paths.append(save_figure(plt, fig, out_dir, f"{label}_speedup"))
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
    from .advisor_check import validate
    points = [p for s in summaries for p in s["validation"]["points"]]
    val = validate(points)
    md = [markdown_table(s) + "\n" for s in summaries]
    md.append(f"Advisor over all runs: mean |error| {fmt(val['mean_abs_error'], '.1%')}, max "
              f"{fmt(val['max_abs_error'], '.1%')}; by mode: "
              + ", ".join(f"{m} {e:.1%}" for m, e in val["mean_abs_error_by_mode"].items()))
    path_md = os.path.join(out_dir, "matrix.md")
    with open(path_md, "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out_dir, "matrix_validation.json"), "w") as f:
        json.dump(val, f, indent=1)
    plt = pyplot()
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
    return [path_md, save_figure(plt, fig, out_dir, "matrix_predicted_vs_measured")]


