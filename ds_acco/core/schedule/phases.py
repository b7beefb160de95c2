"""Phases: what the compute lane does between two swaps, and the policies that end them.

A phase is one stretch of micro-batches that overlaps one communication round (ACCO.md).
The policies answer one question -- does the phase end after its n-th micro-batch? -- and
know nothing about rounds beyond "has the one in flight finished".
"""
from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from ..round.kinds import Tally


class PhaseKind(str, enum.Enum):
    BOOTSTRAP = "bootstrap"  # first phase: nothing in flight yet
    SYNC = "sync"  # a step of the synchronous warm-up (acco.sync_warmup_steps): A micro-batches at θ_t,
    # then one commit round waited for at once; nothing is in flight between two phases
    ESTIMATE = "estimate"  # an estimate round is in flight; the model is at θ_t
    COMMIT = "commit"  # a commit round is in flight; the model is at θ̃_{t+1} (acco) or θ_{k-1} (dpu)


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


SHARE_BAND = 0.1  # shares change only when the new ones shorten the predicted phase by more than this
SHARE_WINDOW = 3  # shares follow each rank's median rate over this many measured phases


def share_by_speed(total: int, seconds_per_micro_batch: Sequence[float], minimum: int = 1,
                   current: Optional[Sequence[int]] = None, band: float = SHARE_BAND) -> Tuple[int, ...]:
    """Every rank's share of ``total`` micro-batches, proportional to its speed (1 / its seconds
    per micro-batch); a pure function of its arguments, so every rank computes the same shares.

    * Each share is at least ``minimum``; they sum to ``total`` exactly (``total`` must be at least
      ``minimum`` × ranks). Quotas ``total · v_i / Σv`` are rounded by largest remainder (ties to
      the lower rank); a rank whose quota is below ``minimum`` gets ``minimum`` and the others
      share the rest in the same way.
    * Unknown rates (any not finite or not > 0, e.g. NaN before a rank's first measured phase):
      ``current``, or equal shares when there is none.
    * Dead band: with ``current`` given, it is kept unless the new shares shorten the predicted
      phase, max_i(n_i · s_i), by more than the fraction ``band`` of it. Ranks of equal speed
      measured with noise therefore keep their (equal) shares; a lasting difference moves them.
    """
    world = len(seconds_per_micro_batch)
    total, minimum = int(total), int(minimum)
    if world < 1 or minimum < 0 or total < minimum * world:
        raise ValueError(f"cannot share {total} micro-batches among {world} ranks with at least {minimum} each")
    if current is not None:
        current = tuple(int(n) for n in current)
        if len(current) != world or sum(current) != total or min(current) < minimum:
            raise ValueError(f"current shares {current} do not share {total} among {world} ranks (>= {minimum})")
    if total % world == 0:
        equal = (total // world,) * world
    else:  # fixed mode's totals divide evenly; any other total: the first ranks get the extra ones
        equal = tuple(total // world + (r < total % world) for r in range(world))
    seconds = [float(s) for s in seconds_per_micro_batch]
    if not all(math.isfinite(s) and s > 0 for s in seconds):
        return current if current is not None else equal
    new = _largest_remainder(total, [1.0 / s for s in seconds], minimum)
    if current is None or new == current:
        return new
    phase = lambda shares: max(n * s for n, s in zip(shares, seconds))  # noqa: E731
    return new if phase(new) < phase(current) * (1.0 - band) else current


def _largest_remainder(total: int, speeds: Sequence[float], minimum: int) -> Tuple[int, ...]:
    shares = [0] * len(speeds)
    free = list(range(len(speeds)))
    left = total
    while True:
        v = sum(speeds[r] for r in free)
        quota = {r: left * speeds[r] / v for r in free}
        pinned = [r for r in free if quota[r] < minimum]
        if not pinned:
            break
        for r in pinned:
            shares[r] = minimum
            free.remove(r)
        left -= minimum * len(pinned)
    for r in free:
        shares[r] = int(math.floor(quota[r]))
    rest = left - sum(shares[r] for r in free)
    for r in sorted(free, key=lambda r: (-(quota[r] - shares[r]), r))[:rest]:
        shares[r] += 1
    return tuple(shares)


def typical_rates(measured: Sequence[Sequence[float]], window: int) -> Tuple[float, ...]:
    """Every rank's seconds per micro-batch over the last ``window`` measured phases (``measured``:
    one vector per phase, oldest first, as the counts tables carried them): its median, or NaN
    (unknown) until ``window`` of them are known (finite and > 0). A pure function of its
    arguments: every rank computes the same rates from the same tables.

    One slow phase in ``window`` (a data-loader stall, a garbage collection, a noisy neighbour on
    the host) does not move the median; a slowdown lasting most of the window does. Noise on ranks
    of equal speed therefore leaves the shares equal, i.e. fixed mode."""
    if not measured:
        return ()
    out = []
    for r in range(len(measured[-1])):
        known = sorted(v[r] for v in measured[-window:] if math.isfinite(v[r]) and v[r] > 0)
        out.append(statistics.median(known) if len(known) >= window else math.nan)
    return tuple(out)


@dataclass(frozen=True)
class SharedPhases:
    """All ranks together run fixed mode's ``micro_batches`` × ranks per phase, shared by measured
    speed: this rank's phase ends after ``shares[rank]`` micro-batches (:func:`share_by_speed` of
    the :func:`typical_rates` over the last ``window`` measured phases). A value: the schedule
    replaces it with :meth:`reshare`'s at each phase end.

    ``aligned``: every phase so far had equal shares, so every rank ended each of them at the same
    micro-batch count, as in fixed mode. The schedule then runs exactly fixed mode (drains need no
    agreement protocol, see drains.py). Once one phase had unequal shares the ranks' phase ends
    fall at different micro-batch counts for good (equal shares later keep the offset), so it
    stays False. Every rank computes the shares from the same table: so is ``aligned``."""
    micro_batches: int  # fixed mode's phase length per rank (the equal share)
    band: float = SHARE_BAND
    window: int = SHARE_WINDOW
    rank: int = 0
    shares: Tuple[int, ...] = ()  # this phase's share of every rank; () before :meth:`for_rank`
    aligned: bool = True
    measured: Tuple[Tuple[float, ...], ...] = ()  # the last ``window`` phases' rates (every rank's), oldest first

    def __post_init__(self):
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"window = {self.window!r}: the shares follow the median of at least 1 measured phase")

    def for_rank(self, rank: int, world: int, shares: Optional[Sequence[int]] = None,
                 aligned: Optional[bool] = None,
                 measured: Optional[Sequence[Sequence[float]]] = None) -> "SharedPhases":
        """This policy for ``rank`` of ``world``, at ``shares`` (default: equal, fixed mode's);
        ``aligned``: whether every phase so far had equal shares (default: this policy's; unequal
        ``shares`` are never aligned); ``measured``: the rates of the phases before (default: this
        policy's; a checkpoint's, on a resume)."""
        shares = tuple(int(n) for n in shares) if shares is not None else (self.micro_batches,) * world
        if len(shares) != world or sum(shares) != self.micro_batches * world or min(shares) < 1:
            raise ValueError(f"shares {shares} do not share {self.micro_batches * world} micro-batches among "
                             f"{world} ranks")
        measured = self.measured if measured is None else tuple(tuple(float(s) for s in v) for v in measured)
        if any(len(v) != world for v in measured):
            raise ValueError(f"measured rates {measured} do not have one rate per rank of {world}")
        new = dataclasses.replace(self, rank=rank, shares=shares, measured=measured[-self.window:])
        return dataclasses.replace(new, aligned=(self.aligned if aligned is None else bool(aligned)) and new.equal)

    @property
    def share(self) -> int:
        return self.shares[self.rank] if self.shares else self.micro_batches

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        """Why the phase ends after its ``n``-th micro-batch, or None if it goes on."""
        return "shared" if n >= self.share else None

    @property
    def equal(self) -> bool:
        """Whether this phase's shares are fixed mode's (every rank ``micro_batches``)."""
        return all(n == self.micro_batches for n in self.shares)

    def reshare(self, seconds_per_micro_batch: Sequence[float]) -> "SharedPhases":
        """The next phase's policy, from every rank's seconds per micro-batch measured over one more
        phase (the newest entry of :attr:`measured`)."""
        measured = (self.measured + (tuple(float(s) for s in seconds_per_micro_batch),))[-self.window:]
        shares = share_by_speed(self.micro_batches * len(self.shares), typical_rates(measured, self.window),
                                current=self.shares, band=self.band)
        new = dataclasses.replace(self, shares=shares, measured=measured)
        return dataclasses.replace(new, aligned=self.aligned and new.equal)


@dataclass
class PhaseRecord:
    """One finished phase as the compute lane saw it (for metrics and replay)."""
    kind: PhaseKind
    data_step: int  # the optimizer step whose gradients this phase computed
    tally: Tally
    wait_s: float  # blocked at its end, waiting for the round that overlapped it
    ended_at: float
    reason: str  # 'fixed', 'shared', 'round_done' or 'max' (the phase policy's answer), 'drain' (ended early so
    # that a drain finishes the round a peer launched, dynamic mode) or 'forced'
