"""An A/B run's raw records (every rank's micro-batches, commits, held-out losses) reduced to its
summary: per variant the steady step time, exposed communication, loss curves, time to target."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence

from . import advisor, advisor_check
from .ab_spec import ABSpec
from .variants import VARIANTS, is_fsdp, mode_of


# -- bookkeeping (pure) ----------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    q = lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]  # noqa: E731
    return {"min": xs[0], "p25": q(0.25), "p75": q(0.75), "max": xs[-1], "n": len(xs)}


def steady_steps(commits: Sequence[dict], warmup: int) -> List[dict]:
    """Committed steps that count for timing: after the warm-up, not committed while draining."""
    return [c for c in commits if c["step"] > warmup and not c["drained"]]


def step_tokens(run: dict, world: int, gas: int, tokens_per_mb: int) -> Dict[int, int]:
    """Global tokens of each committed step (fixed modes: A·N micro-batches; dynamic: what the
    commit round counted)."""
    rank0 = run["ranks"][0]
    n = len(rank0["commits"])
    if mode_of(run["variant"]) == "dynamic" and rank0["acco_metrics"]:
        by_step = {m["step"]: m["micro_batches_global"] * tokens_per_mb for m in rank0["acco_metrics"]}
        return {s: by_step.get(s, gas * world * tokens_per_mb) for s in range(1, n + 1)}
    return {s: gas * world * tokens_per_mb for s in range(1, n + 1)}


def boundary_positions(variant: str, gas: int) -> set:
    """Micro-batch positions (index mod ``gas``) whose measured forward+backward includes the
    stock baseline's communication: ZeRO-1 reduces inside the last backward; FSDP2 also gathers
    the parameters in the first forward after the optimizer step. ACCO variants: none."""
    if mode_of(variant) != "stock":
        return set()
    return {gas - 1, 0} if is_fsdp(variant) else {gas - 1}


def inner_compute(rank: dict, gas: int, variant: str, lo: int = 0, hi: Optional[int] = None) -> List[float]:
    """Forward+backward times of the micro-batches in ``[lo, hi)`` that carry no communication."""
    skip = boundary_positions(variant, gas)
    xs = rank["mb_compute_s"]
    hi = len(xs) if hi is None else hi
    return [c for i, c in enumerate(xs) if lo <= i < hi and i % gas not in skip]


def rank_busy(rank: dict, warmup: int, gas: int, variant: str) -> Optional[float]:
    """Fraction of the steady window's wall time this rank spent computing (forward+backward).

    The stock baselines communicate inside some micro-batches (:func:`boundary_positions`), so
    there the compute is the median of the other micro-batches times their count."""
    commits = [c for c in rank["commits"] if not c["drained"]]
    if len(commits) <= warmup + 1:
        return None
    first, last = commits[warmup - 1] if warmup else None, commits[-1]
    lo = first["mb_seen"] if first else 0
    hi = last["mb_seen"]
    window = last["train_s"] - (first["train_s"] if first else 0.0)
    comp = rank["mb_compute_s"][lo:hi]
    if window <= 0 or not comp:
        return None
    if mode_of(variant) == "stock":
        inner = inner_compute(rank, gas, variant, lo, hi)
        total = (statistics.median(inner) if inner else statistics.median(comp)) * len(comp)
    else:
        total = sum(comp)
    return min(1.0, total / window)


def loss_curve(run: dict, tokens: Dict[int, int]) -> List[dict]:
    """Train loss per committed step (mean over the step's micro-batches, then over ranks), with
    cumulative tokens and cumulative training time (rank 0's clock, evaluation excluded)."""
    per_step: Dict[int, List[float]] = {}
    for rank in run["ranks"]:
        sums: Dict[int, List[float]] = {}
        for loss, s in zip(rank["mb_loss"], rank["mb_step"]):
            sums.setdefault(s, []).append(loss)
        for s, ls in sums.items():
            per_step.setdefault(s, []).append(sum(ls) / len(ls))
    commits = {c["step"]: c for c in run["ranks"][0]["commits"]}
    out, cum = [], 0
    for s in sorted(per_step):
        step = s + 1  # data of step index s is committed as step s+1
        if step not in commits:
            continue
        cum += tokens.get(step, 0)
        out.append({"step": step, "loss": sum(per_step[s]) / len(per_step[s]), "tokens": cum,
                    "time_s": commits[step]["train_s"]})
    return out


def heldout_curve(run: dict, tokens: Dict[int, int]) -> List[dict]:
    cum = {}
    total = 0
    for s in sorted(tokens):
        total += tokens[s]
        cum[s] = total
    return [{"step": h["step"], "loss": h["loss"], "tokens": cum.get(h["step"], total), "time_s": h["train_s"]}
            for h in run["ranks"][0]["heldout"]]


def time_to_target(points: Sequence[dict], target: Optional[float]) -> Optional[float]:
    """Training time at which the held-out curve first reaches ``target``, interpolated between
    the evaluations around the crossing as ``python -m benchmarks ttt`` does (None: never)."""
    if target is None:
        return None
    from .report_quality import crossing_time
    return crossing_time(points, target)


def summarize(raw: dict, spec: Optional[ABSpec] = None) -> dict:
    """Per-variant figures (see the module docstring of :mod:`benchmarks`) from the raw records."""
    ws = raw["spec"]
    world, gas = ws["world"], ws["gas"]
    warmup = spec.warmup if spec is not None else ws.get("warmup", 1)
    tok_mb = ws["micro_batch"] * ws["seq_len"]
    probe = advisor.Probe.from_measured(raw["probe"], tokens_per_micro_batch=tok_mb, cores=raw.get("cores"),
                                        ranks_per_machine=world)
    preds = advisor.predict(probe, gas, dynamic_min=ws.get("dynamic_min"))
    n_params = raw["probe"][0]["n_params"]
    grouped: Dict[str, List[dict]] = {}
    for run in raw["runs"]:
        grouped.setdefault(run["variant"], []).append(run)
    variants = {}
    for name, runs in grouped.items():
        steps, tps, busy, exposed, comm, mem, tokens_per_step, mbs = [], [], [], [], [], [], [], []
        train_mem = []
        curves, held = [], []
        for run in runs:
            tokens = step_tokens(run, world, gas, tok_mb)
            r0 = run["ranks"][0]
            steady = steady_steps(r0["commits"], warmup)
            steps += [c["step_time_s"] for c in steady]
            if steady:
                tps.append(sum(tokens[c["step"]] for c in steady) / sum(c["step_time_s"] for c in steady))
            tokens_per_step += [tokens[c["step"]] for c in steady]
            busy += [b for b in (rank_busy(r, warmup, gas, name) for r in run["ranks"]) if b is not None]
            mem += [r["peak_rss_delta"] for r in run["ranks"] if r["peak_rss_delta"] is not None]
            train_mem += [r["peak_rss_train_delta"] for r in run["ranks"] if r.get("peak_rss_train_delta") is not None]
            steady_ids = {c["step"] for c in steady}
            for m in r0["acco_metrics"]:
                if m["step"] in steady_ids:
                    exposed.append(m.get("exposed_comm_s"))
                    comm.append(m.get("comm_s"))
                    mbs.append(m.get("micro_batches"))
            curves.append(loss_curve(run, tokens))
            held.append(heldout_curve(run, tokens))
        med_step = _median(steps)
        mode = mode_of(name)
        if mode == "stock":  # compute inside the loop: median non-boundary micro-batch, slowest rank
            inner = []
            for run in runs:
                for r in run["ranks"]:
                    xs = inner_compute(r, gas, name)
                    if xs:
                        inner.append(statistics.median(xs))
            loop_compute = gas * max(inner) if inner else None
            exp = (med_step - loop_compute) if med_step is not None and loop_compute is not None else None
        else:
            loop_compute = None
            exp = _median(exposed)
        mb_per_rank = _median(mbs) if mbs else gas
        t_compute = probe.micro_batch_s * (mb_per_rank or gas)
        rounds = {"stock": 1, "dpu": 1, "one_round": 1}.get(mode, 2)
        t_comm_iso = rounds * probe.round_s
        overlap = None
        if mode != "stock" and med_step:
            overlap = (t_compute + t_comm_iso - med_step) / min(t_compute, t_comm_iso)
        ideal = max(t_compute, t_comm_iso) if mode in ("fixed", "dpu", "one_round") else None
        pred = preds.get(mode)
        variants[name] = {
            "mode": mode, "framework": "fsdp2" if is_fsdp(name) else "deepspeed",
            "baseline": None if mode == "stock" else baseline(name, grouped),
            "runs": len(runs), "step_s": med_step, "step_spread": _spread(steps), "tokens_per_s": _median(tps),
            "tokens_per_step": _median(tokens_per_step), "micro_batches_per_rank": mb_per_rank,
            "compute_probe_s": t_compute, "compute_in_loop_s": loop_compute, "exposed_comm_s": exp,
            "comm_s": _median(comm), "comm_isolated_s": t_comm_iso, "overlap_efficiency": overlap,
            "ideal_step_s": ideal, "vs_ideal": (med_step / ideal) if ideal and med_step else None,
            "compute_busy": _median(busy), "peak_mem_delta_bytes": max(mem) if mem else None,
            "peak_mem_train_delta_bytes": max(train_mem) if train_mem else None,
            "train_curve": curves[0], "heldout_curve": held[0],
            "final_heldout": held[0][-1]["loss"] if held[0] else None,
            "predicted_step_s": pred.step_s if pred is not None else None,
            "predicted_tokens_per_s": pred.tokens_per_s if pred is not None else None,
        }
        decisions = [run["ranks"][0].get("auto") for run in runs if run["ranks"][0].get("auto")]
        if decisions:  # mode auto: what it chose and why (the first run's; every rank took the same)
            variants[name]["auto"] = decisions[0]
    # Each variant is compared with the stock run of its own framework (FSDP2 ones with stock FSDP2
    # when it ran, else with stock ZeRO-1); the loss target is stock ZeRO-1's (else stock FSDP2's).
    ref = variants.get("stock") or variants.get("fsdp_stock")
    target = spec.target_loss if spec is not None and spec.target_loss is not None else (
        ref["final_heldout"] * 1.01 if ref and ref["final_heldout"] is not None else None)
    for name, v in variants.items():
        v["time_to_target_s"] = time_to_target(v["heldout_curve"], target)
        stock = variants.get(v["baseline"] or "stock")  # the stock runs: against stock ZeRO-1 (itself: 1.00)
        if stock and stock["step_s"] and v["step_s"]:
            v["speedup_step"] = stock["step_s"] / v["step_s"]
            v["speedup_tokens"] = (v["tokens_per_s"] / stock["tokens_per_s"]) if stock["tokens_per_s"] else None
            p = preds.get(v["mode"])
            if p is not None:
                v["predicted_speedup_tokens"] = p.tokens_per_s / preds["stock"].tokens_per_s
            if stock["peak_mem_delta_bytes"] is not None and v["peak_mem_delta_bytes"] is not None:
                v["extra_mem_bytes"] = v["peak_mem_delta_bytes"] - stock["peak_mem_delta_bytes"]
            if stock["final_heldout"] is not None and v["final_heldout"] is not None:
                v["heldout_gap"] = v["final_heldout"] / stock["final_heldout"] - 1.0
    advice = advisor.advise(probe, gas)
    points = [{"label": raw.get("label", ""), "mode": k, "measured_step_s": v["step_s"],
               "predicted_step_s": v["predicted_step_s"]} for k, v in variants.items() if k in VARIANTS and mode_of(k) != "dynamic"
              and not is_fsdp(k)]  # the advisor models DeepSpeed's collectives
    if "dynamic" in variants and variants["dynamic"]["tokens_per_s"]:
        d = variants["dynamic"]  # dynamic steps vary in size: compare time per token instead
        points.append({"label": raw.get("label", ""), "mode": "dynamic",
                       "measured_step_s": d["tokens_per_step"] / d["tokens_per_s"] if d["tokens_per_step"] else None,
                       "predicted_step_s": d["tokens_per_step"] / d["predicted_tokens_per_s"]
                       if d["tokens_per_step"] and d["predicted_tokens_per_s"] else None})
    return {"label": raw.get("label", ""), "setup": raw.get("setup"), "network": raw.get("network"),
            "world": world, "gas": gas, "rate": raw.get("rate"), "n_params": n_params,
            "model_bytes_comm_dtype": n_params * 4, "tokens_per_micro_batch": tok_mb, "warmup": warmup,
            "steps": ws["steps"], "target_loss": target, "probe": dataclasses.asdict(probe),
            "probe_round_s": probe.round_s, "probe_bandwidth_gbit": probe.bandwidth_gbit,
            "advice": advice.as_dict(), "validation": advisor_check.validate(points), "variants": variants,
            "machine": raw.get("machine"), "date": raw.get("date"), "command": raw.get("command"),
            "slow_rank": ws.get("slow_rank", -1), "slow_factor": ws.get("slow_factor", 1.0),
            "slow_jitter": ws.get("slow_jitter", 0.0), "transient": ws.get("transient"),
            "heterogeneity": heterogeneity_note(ws),
            "emulation": _emulation_note(ws.get("emulate"))}


def heterogeneity_note(ws: dict) -> Optional[str]:
    """How the slow rank was slowed (EMULATION), in words; None for a homogeneous run."""
    if ws.get("slow_rank", -1) < 0:
        return None
    parts = [f"rank {ws['slow_rank']} {ws.get('slow_factor', 1.0):g}x slower per micro-batch"]
    if ws.get("slow_jitter"):
        parts.append(f"lognormal jitter sigma {ws['slow_jitter']:g} per micro-batch (mean 1)")
    t = ws.get("transient")
    if t:
        parts.append(f"{t['factor']:g}x slower again for {t['fraction']:.0%} of the steps from {t.get('start', 0.4):.0%}")
    return "EMULATION of heterogeneous hardware: " + ", ".join(parts) + " (a sleep stretching its micro-batches)"


def _emulation_note(emulate: Optional[dict]) -> Optional[str]:
    if not emulate:
        return None
    from .emulation import describe
    return describe(emulate["params"], emulate["compute_s"])


def baseline(name: str, present) -> str:
    """The stock variant a variant is compared with: stock FSDP2 in the same layout when it ran,
    else stock FSDP2, else stock ZeRO-1."""
    if is_fsdp(name):
        for base in (("fsdp_stock_sharded",) if name.endswith("_sharded") else ()) + ("fsdp_stock",):
            if base in present:
                return base
    return "stock"
