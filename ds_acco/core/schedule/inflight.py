"""The round in flight: the record the schedule keeps of the one round launched and not yet swapped in.

Its bookkeeping changes only through its methods (the schedule's waits, the drains' wait mark, the
committed weights' announcement), each a fact noted once where it is learnt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...comm.lane import RoundHandle
from ..round.rounds import RoundKind, RoundResult


@dataclass
class InFlight:
    """One round on the lane, as the compute lane sees it (:attr:`.machine.AccoSchedule.inflight`)."""

    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)
    announced: bool = False  # a commit's θ reached the live weights; its observers were called
    wait_s: float = 0.0  # how long the compute lane blocked on it
    wait_mark: Optional[float] = None  # wait_s before a phase-end decision waited for it (dynamic mode)

    def note_wait(self, result: Optional[RoundResult], waited_s: float) -> None:
        """The compute lane blocked ``waited_s`` on the round; ``result``: what it returned."""
        self.result = result
        self.wait_s += waited_s

    def book_commit(self) -> bool:
        """Whether this is a commit not booked yet (then it is booked: once per commit)."""
        first = self.kind is RoundKind.COMMIT and not self.committed
        self.committed = self.committed or first
        return first

    def announce(self) -> bool:
        """Whether this is a commit whose θ reaches the live weights for the first time (then noted)."""
        first = self.kind is RoundKind.COMMIT and not self.announced
        self.announced = self.announced or first
        return first

    def mark_wait(self, keep: bool = True) -> None:
        """A phase-end decision waits for the round: the phase end still books that wait as its own
        (``keep=False``: the phase goes on, the mark is dropped)."""
        self.wait_mark = self.wait_s if keep else None
