"""What a round is and what it carries: its kind (estimate or commit) and the tally of the
micro-batches pooled into a buffer (their count and weight)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RoundKind(str, enum.Enum):
    """The round a phase end launches: the estimate (first half of a step, discarded) or the commit."""
    ESTIMATE = "estimate"
    COMMIT = "commit"


@dataclass(frozen=True)
class Tally:
    """Micro-batches and their weight (1 each, or samples / tokens) summed into a buffer (a value: adding
    makes a new one)."""
    micro_batches: int = 0
    weight: float = 0.0

    def add(self, other: "Tally") -> "Tally":
        return Tally(self.micro_batches + other.micro_batches, self.weight + other.weight)
