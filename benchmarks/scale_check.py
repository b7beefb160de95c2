"""The scale model (:mod:`.scale_model`) checked against every emulated A/B point in the committed
records: each record's measured inputs go in, its measured step medians are what it must predict.

A point: one variant (stock, fixed or dpu, one-round's schedule) of one A/B summary JSON whose
``emulation`` is set (compute a wait, real rounds over ``tc``-shaped links), with a nominal
``rate``. Inputs fed to the model, all from the record: ``world`` ranks, each its own node (one
link per namespace, no NVLink level); the bytes of a round (``model_bytes_comm_dtype``, both ways:
CPU runs in fp32); gloo's reduce costing an all-reduce (``f`` = 2); the link's nominal rate; ``α``
from the probe's tiny all-reduce (``latency_s / (2·(world−1))``); compute per micro-batch and the
shard step as the probe measured them (slowest rank); the variant's micro-batches per step.
Loopback records (no link rate) are left out. The one constant, ``η`` (the fraction of the nominal
rate a round achieves in training), is fitted on one sweep (:data:`FIT_ON`) by the median absolute
error over a grid, and the error is reported on every other point (out of sample).
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Dict, List, Optional, Sequence

from .scale_model import Link, Setup, step_times

RATES = {"1gbit": 1e9, "100mbit": 1e8, "10gbit": 1e10}  # the emulation's tc rates, bits/s
MODES = ("stock", "fixed", "dpu")
FIT_ON = "emulation-one-round"  # the headline 2-rank sweep (BENCHMARKS.md, "Step time against r")
ETA_GRID = tuple(x / 100 for x in range(20, 101))


def points(root: str = "docs/bench") -> List[dict]:
    """Every emulated point under ``root``: the model's inputs and the measured median step."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if not (isinstance(rec, dict) and rec.get("emulation") and rec.get("rate") in RATES
                and isinstance(rec.get("probe"), dict) and isinstance(rec.get("variants"), dict)):
            continue
        probe, world = rec["probe"], int(rec["world"])
        for mode in MODES:
            v = rec["variants"].get(mode)
            if not v or not v.get("step_s"):
                continue
            out.append({"record": os.path.relpath(path, root), "sweep": os.path.relpath(path, root).split(os.sep)[0],
                        "mode": mode, "measured_s": float(v["step_s"]), "world": world,
                        "gas": int(v.get("micro_batches_per_rank") or rec["gas"]),
                        "bytes": int(rec["model_bytes_comm_dtype"]), "link_bps": RATES[rec["rate"]] / 8,
                        "alpha_s": float(probe.get("latency_s", 0.0)) / (2 * max(1, world - 1)),
                        "micro_batch_s": float(probe["micro_batch_s"]), "opt_step_s": float(probe.get("opt_step_s", 0.0))})
    return out


def predict(point: dict, eta: float) -> Dict[str, float]:
    """The model's step times and r for one point's inputs at ``eta``."""
    s = Setup(params=point["bytes"] / 4, gpus=point["world"], gpus_per_node=1, wire_bytes=4, eta=eta,
              reduce_factor=2.0, gas=point["gas"], micro_batch_s=point["micro_batch_s"],
              opt_step_s=point["opt_step_s"])
    return step_times(s, Link("emulated", point["link_bps"], point["alpha_s"]))


def errors(pts: Sequence[dict], eta: float) -> List[dict]:
    rows = []
    for p in pts:
        st = predict(p, eta)
        rows.append({**p, "predicted_s": st[p["mode"]], "r": st["r"],
                     "error": (st[p["mode"]] - p["measured_s"]) / p["measured_s"]})
    return rows


def stats(rows: Sequence[dict]) -> Optional[dict]:
    if not rows:
        return None
    a = sorted(abs(r["error"]) for r in rows)
    return {"n": len(rows), "median_abs": statistics.median(a), "max_abs": a[-1],
            "p90_abs": a[min(len(a) - 1, int(0.9 * len(a)))], "mean_signed": statistics.fmean(r["error"] for r in rows)}


def fit_eta(pts: Sequence[dict], grid: Sequence[float] = ETA_GRID) -> float:
    """The ``η`` of the grid with the smallest median absolute error on ``pts`` (ties: the larger)."""
    if not pts:
        raise ValueError("no points to fit eta on")
    return min(grid, key=lambda e: (stats(errors(pts, e))["median_abs"], -e))


def check(root: str = "docs/bench", fit_on: str = FIT_ON) -> dict:
    """Fit ``η`` on the sweep ``fit_on``, report the error on it (in sample) and on the rest."""
    pts = points(root)
    train = [p for p in pts if p["sweep"] == fit_on]
    test = [p for p in pts if p["sweep"] != fit_on]
    eta = fit_eta(train)
    rows = errors(test, eta)
    by = lambda key: {k: stats([r for r in rows if key(r) == k]) for k in sorted({key(r) for r in rows})}  # noqa: E731
    return {"eta": eta, "fit_on": fit_on, "records": len({p["record"] for p in pts}),
            "in_sample": stats(errors(train, eta)), "out_of_sample": stats(rows),
            "by_mode": by(lambda r: r["mode"]), "by_sweep": by(lambda r: r["sweep"]),
            "by_r": by(lambda r: "r <= 1" if r["r"] <= 1 else "r > 1"),
            "by_world_r": by(lambda r: f"{r['world']} ranks, " + ("r <= 1" if r["r"] <= 1 else "r > 1")),
            "ideal_eta_1": stats(errors(test, 1.0)), "rows": rows}


def report(res: dict) -> str:
    def line(name: str, st: Optional[dict]) -> str:
        if not st:
            return f"| {name} | 0 | | | | |"
        return (f"| {name} | {st['n']} | {st['median_abs']:.1%} | {st['p90_abs']:.1%} | {st['max_abs']:.1%} | "
                f"{st['mean_signed']:+.1%} |")
    out = [f"eta fitted on {res['fit_on']}: {res['eta']:.2f} ({res['records']} records)", "",
           "| points | n | median abs error | 90th pct | max | mean signed |", "|---|---|---|---|---|---|",
           line(f"in sample ({res['fit_on']})", res["in_sample"]), line("**out of sample (all others)**", res["out_of_sample"]),
           line("out of sample at eta 1 (nominal rate)", res["ideal_eta_1"])]
    for group in ("by_mode", "by_r", "by_world_r", "by_sweep"):
        out += [line(f"{k}", v) for k, v in res[group].items()]
    return "\n".join(out)
