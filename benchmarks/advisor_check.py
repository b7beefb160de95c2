"""The advisor's step-time model checked against measured A/B runs: prediction errors per point, and
out of sample (each run predicted from a probe of another run of the same setup)."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from .advisor import Probe, predict


def validate(points: Sequence[dict]) -> dict:
    """Prediction error against measured A/B points.

    Each point: ``{"label", "mode", "measured_step_s", "predicted_step_s"}`` (and optionally
    tokens/s for dynamic). Returns per-point relative errors and their mean absolute value.
    """
    rows = []
    for p in points:
        meas, pred = p.get("measured_step_s"), p.get("predicted_step_s")
        if not meas or pred is None:
            continue
        err = (pred - meas) / meas
        rows.append({**p, "error": err})
    errs = [abs(r["error"]) for r in rows]
    by_mode: Dict[str, List[float]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(abs(r["error"]))
    return {"points": rows, "mean_abs_error": sum(errs) / len(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "mean_abs_error_by_mode": {m: sum(v) / len(v) for m, v in by_mode.items()}}


def setup_key(summary: dict) -> tuple:
    """What a probe depends on besides gradient_accumulation_steps: ranks, network, model, compute."""
    return (summary["world"], summary.get("rate"), summary.get("network"), summary.get("n_params"),
            summary.get("tokens_per_micro_batch"), summary.get("emulation"), summary.get("slow_rank"),
            summary.get("slow_factor"), summary.get("slow_jitter") or 0.0, str(summary.get("transient") or ""))


def _measured(variant: dict, mode: str) -> Optional[float]:
    """Seconds per step (dynamic: per token, its steps vary in size)."""
    if mode == "dynamic":
        return 1.0 / variant["tokens_per_s"] if variant.get("tokens_per_s") else None
    return variant.get("step_s")


def out_of_sample(summaries: Sequence[dict], *, contention: str = "auto") -> dict:
    """The advisor's error out of sample: every run's step times predicted from the probe of
    another run of the same setup (same ranks, network, model and compute; any
    gradient_accumulation_steps), at the predicted run's own gradient_accumulation_steps. Beside
    it, the in-sample error (each run predicted from its own probe) over the same runs.
    ``contention``: the model of :func:`predict` (``kappa`` on new probes compares the models on
    the same runs; ``measured`` skips probes stored without the overlapped timings). The one-round
    mode has DPU's schedule and bytes: its predictions are checked against the measured DPU steps,
    reported by mode and left out of the totals (they would count DPU's points twice)."""
    fields = {f.name for f in dataclasses.fields(Probe)}
    rows, inside = [], []
    for target in summaries:
        for name, v in target["variants"].items():
            if name not in ("stock", "fixed", "dpu", "dynamic"):
                continue
            meas = _measured(v, name)
            if not meas:
                continue
            for source in summaries:
                if setup_key(source) != setup_key(target):
                    continue
                probe = Probe(**{k: x for k, x in source["probe"].items() if k in fields})
                if contention == "measured" and not probe.overlap_measured:
                    continue
                preds = predict(probe, target["gas"], contention=contention)
                for mode in (name, "one_round") if name == "dpu" else (name,):
                    pred = preds[mode]
                    value = (1.0 / pred.tokens_per_s) if name == "dynamic" else pred.step_s
                    row = {"probe_run": source["label"], "run": target["label"], "mode": mode, "gas": target["gas"],
                           "measured": meas, "predicted": value, "error": (value - meas) / meas}
                    (inside if source["label"] == target["label"] else rows).append(row)

    def stats(rs):
        by_mode: Dict[str, List[float]] = {}
        for r in rs:
            by_mode.setdefault(r["mode"], []).append(r["error"])
        errs = [abs(r["error"]) for r in rs if r["mode"] != "one_round"]
        return {"n": len(errs), "mean_abs_error": sum(errs) / len(errs) if errs else None,
                "max_abs_error": max(errs) if errs else None,
                "mean_abs_error_by_mode": {m: sum(map(abs, e)) / len(e) for m, e in sorted(by_mode.items())},
                "mean_error_by_mode": {m: sum(e) / len(e) for m, e in sorted(by_mode.items())}}
    targets = {r["run"] for r in rows}
    return {"out_of_sample": stats(rows), "in_sample": stats([r for r in inside if r["run"] in targets]),
            "rows": rows}
