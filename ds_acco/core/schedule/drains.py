"""Drains that agree across ranks: dynamic mode's protocol, a part :class:`.schedule.AccoSchedule` holds.

Drains agree (ACCO.md, dynamic mode). Every round starts with the same small all-gather (the
counts table), so the n-th table exchange on the rounds' group is a *slot* every rank fills once.
In dynamic mode ranks end phases on their own timing and may stand one round apart at a drain;
the j-th ``drain()`` call of every rank (d = j) agrees on the slots as follows:
  1. wait for the round in flight; if its table carries some rank's flag d, it is the agreed
     last round: done;
  2. else *probe* the next slot: the counts table alone, with this rank's flag d and the counts
     it would send were the phase to end now. All probed (nobody launched a round there): the
     slot is dropped on every rank, done. Some rank launched a round there: this rank ends its
     phase now (possibly short, even empty) and joins that round with the table it already
     has; waits for it; done.
  3. outside a drain, a rank that collects a round carrying a peer's flag for its own next
     drain (the peer drains first) does not end its phase -- it keeps accumulating, past the
     maximum if need be -- until its drain, where step 1 finds that round.
  4. drains happen at the same micro-batch count on every rank (a caller's step boundary), and
     each flag travels with the drainer's count. A rank still holding its phase open for a
     peer's drain at a micro-batch past that count has missed the drain: the ranks drained a
     different number of times. It fills the next slot with DRAIN_ABORT (the peer waits there)
     and every rank raises DrainMismatchError at that slot, instead of waiting comm_timeout_s.
No deadlock: a rank launches round n+1 only after collecting round n, which needs every rank
to have filled slot n, so ranks are at most one slot apart; the first rank to probe for drain
d does so at slot P after collecting slot P-1, so no rank can have filled P+1 (that needs slot
P collected without the flag), every rank fills slot P exactly once (a normal launch before
its drain, or its probe), and no rank fills P+1 before its drain d is over (step 3). Each slot's
decision (full round or dropped) is a function of its table, the same on every rank. Fixed mode
(phase ends at equal micro-batch counts everywhere, so drains already agree) sends no flag and
no probe: it is unchanged. So is accumulation 'shared' while every phase so far had equal shares
(``SharedPhases.aligned``): its phase ends then fall at fixed mode's micro-batch counts on every
rank, and it drains as fixed mode does -- no probe, no wait for an estimate round in flight, no
early collection at the phase-end decision, no host read of the counts before a round's reduce.
The shares of a phase are computed by every rank from the same table at the same phase end, so
every rank leaves that state at the same phase end, and (drains being at equal micro-batch
counts) on the same side of every drain; no flag was sent before, so the drain numbering starts
there on every rank alike. A round launched while aligned fills its slot on every rank (no abort
can), so only rounds launched after read their counts first.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import ContextManager, Optional, Protocol, Union

from torch.profiler import record_function

from ...comm.lane import CommLane
from ..round.kinds import Tally
from ..round.report import DRAIN_ABORT, RoundReport
from ..round.rounds import DrainMismatchError, RoundContext, RoundResult, check_no_drain_abort, exchange_tallies
from .inflight import InFlight
from .phases import DynamicPhases, FixedPhases, SharedPhases


class Schedule(Protocol):
    """What the drain protocol reads and drives of the schedule (its public names; its position read-only)."""

    rank: int
    world: int
    lane: CommLane
    context: RoundContext
    phases: Union[FixedPhases, DynamicPhases, SharedPhases]

    @property
    def micro_batches(self) -> int: ...  # all micro-batches ever recorded

    @property
    def phase_tally(self) -> Tally: ...  # the phase in progress

    @property
    def buffer_tally(self) -> Tally: ...  # what G holds

    @property
    def inflight(self) -> Optional[InFlight]: ...

    @property
    def closed(self) -> bool: ...

    def wait_for(self, inflight: InFlight) -> RoundResult: ...

    def end_phase(self, exchanged: Optional[tuple] = None, reason: Optional[str] = None) -> None: ...

    def round_report(self, drain: int = 0) -> RoundReport: ...

    def sync_accumulated_loss_scale(self) -> None: ...

    def off_the_clock(self) -> ContextManager[None]: ...


class DrainAgreement:
    """The drain protocol above, for one schedule: counts this rank's drains, probes slots, and ends
    the schedule's phase early where a peer launched a round (fixed phases skip it entirely).

    Args:
        schedule: through :class:`Schedule` (its round in flight, counts, lane and phase end).
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.count = 0  # drain() calls so far: the j-th drain of every rank agrees (checkpointed)
        self._warned_stretch = False

    def restore_count(self, count: int) -> None:
        """A load: the saving run's drain count, so that flags stay comparable."""
        self.count = int(count)

    @property
    def agrees(self) -> bool:
        """Whether drains run the agreement protocol: whenever the ranks may stand at different phase
        positions -- dynamic phases, and shared phases once their shares have differed (not while
        every phase had equal shares: that is fixed mode, see the module docstring)."""
        phases = self.schedule.phases
        if isinstance(phases, SharedPhases):
            return not phases.aligned
        return not isinstance(phases, FixedPhases)

    def peer_draining(self) -> bool:
        """Whether the collected round in flight carries some rank's flag for this rank's next drain
        (step 3: the phase stays open until this rank's drain)."""
        inflight = self.schedule.inflight
        return (inflight is not None and inflight.result is not None
                and flagged(inflight.result, self.count + 1))

    def keep_phase_open(self, why: Optional[str]) -> Optional[str]:
        """Step 3 at a phase-end decision (``why`` the phase would end, None: it goes on): the phase
        end collects the round in flight anyway, so collect it now; None (the phase goes on) if it
        carries a peer's flag for this rank's next drain, else ``why``."""
        s = self.schedule
        inflight = s.inflight
        if why is None or not self.agrees or inflight is None:
            return why
        inflight.mark_wait()  # the phase end still books this wait as its own
        s.wait_for(inflight)
        if not self.peer_draining():
            return why
        self.check_pair_up()
        inflight.mark_wait(keep=False)
        return None

    def _warn_if_share_stretched(self, drain_at: int) -> None:
        """Accumulation 'shared': a peer drained at a micro-batch count this rank reaches only after
        more than a whole phase of all ranks. The loop counts micro-batches per rank, not committed
        steps, so the phase held open until this rank's drain pools far more than stock's batch."""
        s = self.schedule
        total = s.phases.micro_batches * s.world if isinstance(s.phases, SharedPhases) else 0
        if total and s.phase_tally.micro_batches >= total and not self._warned_stretch:
            self._warned_stretch = True
            logging.getLogger("ds_acco").warning(
                "ACCO accumulation 'shared': rank %d holds its phase open at %d micro-batches (its share: %d, all "
                "ranks' per phase: %d) until its own drain at micro-batch %d, because a peer drained at that count. "
                "Ranks of different speeds reach equal micro-batch counts at different steps: loop on "
                "engine.global_steps and drain (evaluate, save) right after the step() that committed a step "
                "(docs/ACCO.md, 'Drains and checkpoints').", s.rank, s.phase_tally.micro_batches,
                s.phases.share, total, drain_at)

    def check_pair_up(self) -> None:
        """Step 4 of the protocol: raise on every rank if a peer's drain was missed here."""
        if not (self.agrees and self.peer_draining()):
            return
        s = self.schedule
        drainers = {r: p for r, p in enumerate(s.inflight.result.peer_report) if p.drain == self.count + 1}
        at = max(p.drain_at for p in drainers.values())
        if s.micro_batches < at:
            self._warn_if_share_stretched(at)
            return  # this rank's own drain is still ahead (at micro-batch ``at``)
        ranks = sorted(drainers)
        message = (f"ACCO dynamic mode: rank(s) {ranks} drained (committed_weights, save_checkpoint, evaluation) "
                   f"for the {self.count + 1}th time after micro-batch {at}; this rank (rank {s.rank}) has "
                   f"drained {self.count} times and is at micro-batch {s.micro_batches}, so the ranks drained a "
                   "different number of times and cannot agree on which rounds to finish; fix: drain on every rank "
                   "at the same micro-batch count (not on rank 0 only, not on a per-rank condition)")
        ctx, report = s.context, dataclasses.replace(s.round_report(0), drain=DRAIN_ABORT)
        abort = s.lane.submit("drain mismatch", lambda: exchange_tallies(ctx, Tally(), report))
        try:
            s.lane.wait(abort)  # the peer waits in this slot: it learns it there
        except Exception:  # noqa: BLE001 -- a failing peer: the mismatch is still what this rank reports
            pass
        raise DrainMismatchError(message)

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (if any); a finished commit is booked as committed. In
        dynamic mode every rank's j-th drain finishes the same rounds (the protocol above): this
        rank may first end its phase early to join a round a peer launched."""
        s = self.schedule
        if not self.agrees or s.closed:  # closed: the lane is gone (a second destroy())
            return None if s.inflight is None else s.wait_for(s.inflight)
        with record_function("ACCO::drain"):
            self.count += 1
            drain = self.count
            inflight = s.inflight
            if inflight is not None:
                s.wait_for(inflight)
                if flagged(inflight.result, drain):
                    return inflight.result
            # Probe the next slot: the counts this rank would send, were its phase to end now.
            s.sync_accumulated_loss_scale()
            local = s.buffer_tally
            report = s.round_report(drain)
            ctx = s.context
            probe = s.lane.submit(f"drain {drain} probe", lambda: exchange_tallies(ctx, local, report))
            with s.off_the_clock():
                per_rank, reports = s.lane.wait(probe)
            check_no_drain_abort(reports)
            if all(p.drain == drain for p in reports):
                return None if inflight is None else inflight.result  # nobody launched a round there
            s.end_phase(exchanged=(per_rank, reports), reason="drain")
            return s.wait_for(s.inflight)


def flagged(result: RoundResult, drain: int) -> bool:
    """Whether some rank sent ``result``'s round as part of its drain number ``drain``."""
    return any(p.drain == drain for p in result.peer_report or ())

