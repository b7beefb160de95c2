"""Mode 'auto': stock's first steps measure a round against the compute; every rank then runs one mode.

The first ``acco.auto_probe_steps`` = K steps are stock's (the synchronous warm-up's SYNC phases: A
micro-batches at θ_t, one commit round waited for at once). Each but the first (a warm-up: not measured)
gives this rank's compute seconds C (the phase's wall time less what it waited for: the compute clock,
no device synchronisation added) and the round's R (its run on the lane, ``RoundResult.duration_s``).
At the end of step K (later if no step was measured, e.g. after a load) every rank all-reduces its
medians once, on the lane: the slowest rank's compute (max C) and the round as the last rank to arrive
saw it (min R: a rank that arrived early waited inside the round for the others). From these numbers
:func:`decide`, a pure function, picks the mode on every rank alike, by the step-time rules of
benchmarks/scale_model.py (r = R / (C/2), BENCHMARKS.md's ratio):

* stock:     C + R                    (nothing overlaps)
* acco:      2·max(C/2, R)            (fixed accumulation: two rounds per step, one under each half)
* one_round: max(C, R)                (one round under the whole next step)

An ACCO mode is chosen only where its step is predicted more than :data:`AUTO_MARGIN` faster than
stock's ((1 + margin) × its time < stock's), the one-round mode (which trains worse than stock, and is a
candidate only when ``auto_modes`` lists it) only where it also beats fixed's by that margin: where stock
stays, no candidate is predicted more than 5% faster. Stock keeps the SYNC phases for good (the weights
of ``"sync_warmup_steps"`` forever); an ACCO mode is adopted (:meth:`.machine.AccoSchedule.adopt`) and
bootstraps from θ_K, exactly as ``"mode": "acco"`` / ``"one_round"`` with ``"sync_warmup_steps": K``.
The decision, its inputs and the rule go to the log (rank 0) and into checkpoints (:meth:`AutoChoice.state`):
a resume runs the mode chosen without measuring again.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

AUTO_MARGIN = 0.05  # an ACCO mode only where its step is predicted more than this faster (stock / it - 1)
MODES = ("stock", "acco", "one_round")

measure_hook: Optional[Callable[[int, int, float, float], Tuple[float, float]]] = None
"""A test seam: given, ``measure_hook(rank, step, C, R)`` replaces each measured step's (C, R) (tests
make the decision deterministic with it; nothing in the library sets it)."""


def step_times(compute_s: float, round_s: float) -> Dict[str, float]:
    """Each mode's predicted seconds per optimizer step from one step's compute C and one round R."""
    c, r = compute_s, round_s
    return {"stock": c + r, "acco": 2 * max(c / 2, r), "one_round": max(c, r)}


def decide(compute_s: float, round_s: float, candidates: Sequence[str],
           margin: float = AUTO_MARGIN) -> Tuple[str, str]:
    """The mode of ``candidates`` (stock always one) the times predict fastest, and why (the module's rule)."""
    unknown = [m for m in candidates if m not in MODES]
    if unknown or "stock" not in candidates:
        raise ValueError(f"candidates {list(candidates)}: must include 'stock', from {MODES}")
    if not (math.isfinite(compute_s) and compute_s > 0 and math.isfinite(round_s) and round_s >= 0):
        return "stock", f"measured C = {compute_s!r} s, R = {round_s!r} s are not usable: stock"
    t = step_times(compute_s, round_s)
    choice = "stock"
    if "acco" in candidates and (1 + margin) * t["acco"] < t["stock"]:
        choice = "acco"
    beat = min(t[m] for m in ("stock", "acco") if m in candidates)
    if "one_round" in candidates and (1 + margin) * t["one_round"] < beat:
        choice = "one_round"
    rule = (f"an ACCO mode only where (1 + {margin:g}) x its step < stock's"
            + (", one_round's also < fixed's" if "one_round" in candidates and "acco" in candidates else ""))
    if choice == "stock":
        return choice, f"no candidate predicted more than {margin:.0%} faster than stock ({rule})"
    return choice, f"{choice} predicted {t['stock'] / t[choice]:.2f}x stock's speed ({rule})"


class AutoChoice:
    """Mode 'auto''s part of a schedule: its measurements, its decision (the same on every rank) and
    their saved form. ``announce``: called with the decision's log line (the driver's, on rank 0)."""

    def __init__(self, schedule, plan):
        self.schedule = schedule
        self.plan = plan  # options.AutoPlan: probe steps, candidates, each candidate's options
        self.samples: List[Tuple[float, float]] = []  # (C, R) of each measured stock step
        self.decision: Optional[dict] = None
        self.announce: Optional[Callable[[str], None]] = None

    @property
    def runs_stock(self) -> bool:
        """Whether the next step is stock's: before the decision, and for good if it chose stock."""
        return self.decision is None or self.decision["choice"] == "stock"

    def after_stock_step(self, compute_s: float, result) -> None:
        """At the end of a stock step (its round collected; ``compute_s``: NaN if not measured): note it,
        and at the end of step K decide (every rank at once: one collective on the lane)."""
        if self.decision is not None:
            return
        s = self.schedule
        round_s = result.duration_s
        if math.isfinite(compute_s):
            if measure_hook is not None:
                compute_s, round_s = measure_hook(s.rank, result.step, compute_s, round_s)
            self.samples.append((float(compute_s), float(round_s)))
        if s.step_index < self.plan.probe_steps:
            return
        mine = ([statistics.median(c for c, _ in self.samples), statistics.median(r for _, r in self.samples)]
                if self.samples else [math.nan, math.nan])
        c, r, n = self._agree(mine + [float(len(self.samples))])
        if n < 1:
            return  # a rank measured nothing yet (a load): one more stock step, on every rank
        choice, reason = decide(c, r, self.plan.candidates)
        self._adopt({"choice": choice, "compute_s": c, "round_s": r, "step": s.step_index, "reason": reason,
                     "candidates": list(self.plan.candidates)})
        if self.announce is not None:
            self.announce(self.line())

    def _agree(self, values: List[float]) -> List[float]:
        """[max C, min R, min n] over the ranks (NaN, a rank with nothing measured, counts as n = 0)."""
        s = self.schedule
        ctx = s.context
        signed = torch.tensor([values[0], -values[1], -values[2]], dtype=torch.float64)
        signed = torch.nan_to_num(signed, nan=-math.inf)
        if s.world > 1:
            device = s.groups[0].comm.device
            signed = s.lane.wait(s.lane.submit("auto decision", lambda: _max(signed.to(device), ctx.process_group)))
        c, r, n = signed.tolist()
        return [c, -r, -n]

    def _adopt(self, decision: dict) -> None:
        self.decision = decision
        if decision["choice"] != "stock":
            self.schedule.adopt(self.plan.options[decision["choice"]])

    def line(self) -> str:
        """The decision as the log states it: inputs, predictions, choice, rule, and how to force it."""
        d = self.decision
        c, r = d["compute_s"], d["round_s"]
        times = ", ".join(f"{m} {v:.4g} s" for m, v in step_times(c, r).items() if m in d["candidates"])
        k = self.plan.probe_steps
        force = {"stock": '"enabled": false (stock ZeRO-1)',
                 "acco": f'"mode": "acco", "sync_warmup_steps": {k}',
                 "one_round": f'"mode": "one_round", "sync_warmup_steps": {k}'}[d["choice"]]
        return (f"ACCO auto: after step {d['step']} measured C = {c:.4g} s compute per step (slowest rank), R = "
                f"{r:.4g} s per round, r = R/(C/2) = {2 * r / c if c > 0 else math.nan:.3g}; predicted step: "
                f"{times}; chose {d['choice']}: {d['reason']}; to force it: {force}")

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"samples": [list(x) for x in self.samples], "decision": self.decision}

    def load(self, state: Optional[dict]) -> None:
        """A checkpoint's measurements and decision (a decided run goes on in its mode: no new probe)."""
        if not state:
            return
        self.samples = [(float(c), float(r)) for c, r in state["samples"]]
        if state["decision"] is not None and self.decision is None:
            self._adopt(dict(state["decision"]))


def _max(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu()
