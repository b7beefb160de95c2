"""This rank's compute seconds per micro-batch: a phase's wall time less the time blocked on rounds and drains.

Accumulation 'shared' (:class:`.phases.SharedPhases`): each rank measures its compute seconds per
micro-batch over a phase (wall time minus the time it was blocked on rounds and drains) and sends
it with the round it launches at that phase's end. At its n-th phase end every rank collects the
same round n-1, so every rank computes the next phase's shares from the same table (and the same
tables before it: each rank's median over the last few measured phases, :func:`.phases.typical_rates`,
so that one slow phase does not move them): the shares agree with no collective of their own.
(The bootstrap phase, a warm-up, is not measured.) While
every phase has had equal shares (``SharedPhases.aligned``) the schedule is fixed mode, per
micro-batch, per round and per drain: the speeds ride in the counts table every round sends
anyway, and the only extra work is the share rule at each phase end (a few floats).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterator, Optional


class ComputeClock:
    """Measures this rank's speed, which accumulation 'shared' splits phases by (sent with each round).

    The host clock, no device sync: it counts what the host waited for (e.g. a backward's kernels
    where the caller reads the loss). Time inside :meth:`off_the_clock` is not counted.
    """

    def __init__(self):
        self.seconds_per_micro_batch = math.nan  # over the last measured phase
        self.phase_compute_s = math.nan  # the compute seconds of the last phase ended (NaN: it was not measured)
        self._phase_start: Optional[tuple] = None  # (phase start, off-clock seconds then); None: not measured
        self._off_s = 0.0  # seconds off the clock, ever
        self._depth = 0

    @contextlib.contextmanager
    def off_the_clock(self) -> Iterator[None]:
        """Time inside is not this rank's micro-batch compute (a wait for a round, a drain, an
        evaluation): it is left out of :attr:`seconds_per_micro_batch`. Nests."""
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._off_s += time.perf_counter() - t0

    def end_phase(self, micro_batches: int) -> None:
        """At a phase end: the phase that ends had ``micro_batches``; set :attr:`seconds_per_micro_batch`
        if that phase was measured (it was not: the bootstrap, a phase begun before a load or reset)."""
        self.phase_compute_s = math.nan
        if self._phase_start is not None and micro_batches > 0:
            started, off = self._phase_start
            self.phase_compute_s = time.perf_counter() - started - (self._off_s - off)
            self.seconds_per_micro_batch = self.phase_compute_s / micro_batches

    def start_phase(self) -> None:
        """A phase begins now: it is measured at its end."""
        self._phase_start = (time.perf_counter(), self._off_s)

    def skip_phase(self) -> None:
        """The phase in progress began before a load or a reset: it is not measured."""
        self._phase_start = None
