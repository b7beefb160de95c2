"""Per-committed-step overlap metrics, built from what the schedule already records.

Nothing here communicates or synchronises: counts of every rank travel inside each round's
own small collective, and each rank sends its previous step's timing along with the next
commit round, so the cross-rank timing of step t-1 is reported with step t.
"""
from __future__ import annotations

import collections
import math
from typing import Deque, Dict, Iterable, Optional

from ..round.kinds import RoundKind
from ..round.report import RoundReport
from ..round.rounds import RoundResult
from ..schedule.phases import PhaseRecord


class StepMetrics:
    """Keeps the last committed steps' metrics (bounded) and builds a record per commit."""

    def __init__(self, mode: str, history: int = 1000):
        self.mode = mode
        self.records: Deque[Dict] = collections.deque(maxlen=history)
        self._last_commit_at: Optional[float] = None

    def report(self) -> RoundReport:
        """This rank's figures for the last committed step, sent along with the next round (NaN
        before the first)."""
        if not self.records:
            return RoundReport()
        last = self.records[-1]
        return RoundReport(exposed_comm_s=last["exposed_comm_s"], comm_s=last["comm_s"],
                           micro_batches=float(last["micro_batches"]), step_time_s=last["step_time_s"])

    def on_commit(self, commit: RoundResult, rounds: Iterable[RoundResult], phases: Iterable[PhaseRecord],
                  lr: Optional[float] = None, loss_scale: Optional[float] = None) -> Dict:
        """Build the record of the step ``commit`` belongs to, from the schedule's recent rounds
        and phase history."""
        t = commit.step
        estimate = next((r for r in rounds if r.kind is RoundKind.ESTIMATE and r.step == t), None)
        mine = [p for p in phases if p.data_step == t]
        rounds = [r for r in (estimate, commit) if r is not None]
        comm_s = sum(r.duration_s for r in rounds)
        exposed = sum(r.wait_s for r in rounds)
        now = commit.collected_at
        step_time = (now - self._last_commit_at) if self._last_commit_at is not None else math.nan
        self._last_commit_at = now
        total = commit.total
        rec = {
            "step": t + 1,  # committed steps after this one
            "micro_batches": commit.local.micro_batches,
            "micro_batches_global": total.micro_batches,
            "micro_batches_per_rank": [r.micro_batches for r in commit.per_rank],
            "weight": commit.local.weight,
            "weight_global": total.weight,
            "phase_micro_batches": [p.tally.micro_batches for p in mine],
            "comm_s": comm_s,
            "exposed_comm_s": exposed,
            "overlap": max(0.0, 1.0 - exposed / comm_s) if comm_s > 0 else math.nan,
            "step_time_s": step_time,
            "grad_norm": commit.grad_norm,
            "skipped": commit.skipped,
        }
        if estimate is not None:
            rec["estimate_micro_batches_global"] = estimate.total.micro_batches
            rec["estimate_round_s"] = estimate.duration_s
        rec["commit_round_s"] = commit.duration_s
        if estimate is not None and estimate.prev_commit_drift is not None:
            rec["prev_step_estimate_drift"] = estimate.prev_commit_drift  # measured in the previous commit
        if estimate is not None and estimate.prev_commit_cos is not None:
            rec["prev_step_estimate_cos"] = estimate.prev_commit_cos  # cos(θ̃ − θ_t, θ_{t+1} − θ_t), same commit
        if lr is not None:
            rec["lr"] = lr  # the scheduler's value
        if commit.lr_factor != 1.0:
            rec["lr_factor"] = commit.lr_factor  # dynamic lr_scaling: the commit step used lr × this
        if loss_scale is not None:
            rec["loss_scale"] = loss_scale  # fp16: the scale after this step's update
        peers = commit.peer_report
        if peers and not any(math.isnan(p.exposed_comm_s) for p in peers):  # NaN: a rank had no committed step yet
            rec["prev_step_exposed_comm_s_per_rank"] = [p.exposed_comm_s for p in peers]
            rec["prev_step_micro_batches_per_rank"] = [int(p.micro_batches) for p in peers]
            rec["prev_step_exposed_comm_s_max"] = max(p.exposed_comm_s for p in peers)
        self.records.append(rec)
        return rec

    @property
    def last(self) -> Optional[Dict]:
        return self.records[-1] if self.records else None


def scalar_items(record: Dict):
    """(name, value) pairs of a record's scalar entries, for monitors."""
    for k, v in record.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v):
            yield k, float(v)


def format_line(record: Dict) -> str:
    """A concise one-line summary of a step record."""
    parts = [f"ACCO step {record['step']}",
             f"micro-batches {record['micro_batches']} (global {record['micro_batches_global']}, "
             f"per rank {record['micro_batches_per_rank']})",
             f"comm {record['comm_s']:.3f}s exposed {record['exposed_comm_s']:.3f}s overlap {record['overlap']:.2f}"]
    if "prev_step_estimate_drift" in record:
        parts.append(f"drift (prev step) {record['prev_step_estimate_drift']:.3f}")
    if "prev_step_estimate_cos" in record:
        parts.append(f"cos {record['prev_step_estimate_cos']:.3f}")
    if math.isfinite(record["step_time_s"]):
        parts.append(f"step {record['step_time_s']:.3f}s")
    if record.get("skipped"):
        parts.append("SKIPPED (non-finite gradient)")
    if "loss_scale" in record:
        parts.append(f"loss scale {record['loss_scale']:g}")
    return " | ".join(parts)
