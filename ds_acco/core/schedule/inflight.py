"""The round in flight: the record the schedule keeps of the one round launched and not yet swapped in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...comm.lane import RoundHandle
from ..round.rounds import RoundKind, RoundResult


@dataclass
class InFlight:
    """One round on the lane, as the compute lane sees it (:attr:`.schedule.AccoSchedule.inflight`)."""

    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)
    announced: bool = False  # a commit's θ reached the live weights; its observers were called
    wait_s: float = 0.0  # how long the compute lane blocked on it
    wait_mark: Optional[float] = None  # wait_s before a phase-end decision waited for it (dynamic mode)
