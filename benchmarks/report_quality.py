"""Training quality of A/B runs: time to a target held-out loss, and the tail fidelity at equal
tokens (per run and seed medians); Markdown and plots."""
from __future__ import annotations

import json
import os
import re
import statistics
from typing import Dict, List, Optional, Sequence

from .report import LABELS, ORDER, fmt, pyplot, save_figure


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
    from .advisor_check import setup_key
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
        lines.append(f"| {name} | {r['runs']} | {fmt(r['tokens_per_step'], '.0f')} | {fmt(r['step_s'])} | {ttt} | "
                     f"{vs} | {fmt(r['loss_at_equal_time'], '.4f')} (at {fmt(r['equal_time_s'], '.0f')} s) | "
                     f"{fmt(r['loss_at_equal_tokens'], '.4f')}{_gap(r['loss_at_equal_tokens'], stock_eq)} |")
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
        plt = pyplot()
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
    return paths + [save_figure(plt, fig, out_dir, stem)]


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
