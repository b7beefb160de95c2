"""Phases: what the compute lane does between two swaps, and the policies that end them.

A phase is one stretch of micro-batches that overlaps one communication round (ACCO.md).
The policies answer one question -- does the phase end after its n-th micro-batch? -- and
know nothing about rounds beyond "has the one in flight finished".
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional


class PhaseKind(str, enum.Enum):
    BOOTSTRAP = "bootstrap"  # first phase: nothing in flight yet
    ESTIMATE = "estimate"  # an estimate round is in flight; the model is at θ_t
    COMMIT = "commit"  # a commit round is in flight; the model is at θ̃_{t+1} (acco) or θ_{k-1} (dpu)


@dataclass
class Tally:
    """Micro-batches and their weight (1 each, or samples / tokens) summed into a buffer."""
    micro_batches: int = 0
    weight: float = 0.0

    def add(self, other: "Tally") -> "Tally":
        return Tally(self.micro_batches + other.micro_batches, self.weight + other.weight)


@dataclass(frozen=True)
class FixedPhases:
    """Every phase has exactly ``micro_batches`` micro-batches."""
    micro_batches: int

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        """Why the phase ends after its ``n``-th micro-batch, or None if it goes on."""
        return "fixed" if n >= self.micro_batches else None


@dataclass(frozen=True)
class DynamicPhases:
    """A phase ends once its round has finished (checked every ``check_every`` micro-batches from
    ``min_micro_batches`` on), or at ``max_micro_batches`` (the compute lane then waits)."""
    min_micro_batches: int
    max_micro_batches: int
    check_every: int = 1

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        """Why the phase ends after its ``n``-th micro-batch, or None if it goes on."""
        if n >= self.max_micro_batches:
            return "max"
        if n < self.min_micro_batches or (n - self.min_micro_batches) % self.check_every:
            return None
        return "round_done" if round_done() else None


@dataclass
class PhaseRecord:
    """One finished phase as the compute lane saw it (for metrics and replay)."""
    kind: PhaseKind
    data_step: int  # the optimizer step whose gradients this phase computed
    tally: Tally
    wait_s: float  # blocked at its end, waiting for the round that overlapped it
    ended_at: float
    reason: str  # 'fixed', 'round_done' or 'max' (the phase policy's answer), 'drain' (ended early so
    # that a drain finishes the round a peer launched, dynamic mode) or 'forced'
