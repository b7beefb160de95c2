"""Drains that agree across ranks: dynamic mode's protocol, as a part of :class:`.schedule.AccoSchedule`.

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
from typing import Optional

from torch.profiler import record_function

from .phases import FixedPhases, SharedPhases, Tally
from .report import DRAIN_ABORT
from .rounds import DrainMismatchError, RoundResult, check_no_drain_abort, exchange_tallies


class DrainAgreement:
    """The drain protocol above, mixed into :class:`.schedule.AccoSchedule` (it reads and moves
    the schedule's round in flight, counts and lane; fixed phases skip it entirely)."""

    @property
    def agrees_drains(self) -> bool:
        """Whether drains run the agreement protocol: whenever the ranks may stand at different phase
        positions -- dynamic phases, and shared phases once their shares have differed (not while
        every phase had equal shares: that is fixed mode, see the module docstring)."""
        phases = self.phases
        if isinstance(phases, SharedPhases):
            return not phases.aligned
        return not isinstance(phases, FixedPhases)

    def _peer_draining(self) -> bool:
        """The collected round in flight carries some rank's flag for this rank's next drain."""
        inflight = self._inflight
        return (inflight is not None and inflight.result is not None
                and _flagged(inflight.result, self.drains + 1))

    def _warn_if_share_stretched(self, drain_at: int) -> None:
        """Accumulation 'shared': a peer drained at a micro-batch count this rank reaches only after
        more than a whole phase of all ranks. The loop counts micro-batches per rank, not committed
        steps, so the phase held open until this rank's drain pools far more than stock's batch."""
        total = self.phases.micro_batches * self.world if isinstance(self.phases, SharedPhases) else 0
        if total and self.phase_tally.micro_batches >= total and not getattr(self, "_warned_stretch", False):
            self._warned_stretch = True
            logging.getLogger("ds_acco").warning(
                "ACCO accumulation 'shared': rank %d holds its phase open at %d micro-batches (its share: %d, all "
                "ranks' per phase: %d) until its own drain at micro-batch %d, because a peer drained at that count. "
                "Ranks of different speeds reach equal micro-batch counts at different steps: loop on "
                "engine.global_steps and drain (evaluate, save) right after the step() that committed a step "
                "(docs/ACCO.md, 'Drains and checkpoints').", self.rank, self.phase_tally.micro_batches,
                self.phases.share, total, drain_at)

    def _check_drains_pair_up(self) -> None:
        """Step 4 of the protocol: raise on every rank if a peer's drain was missed here."""
        if not (self.agrees_drains and self._peer_draining()):
            return
        flagged = {r: p for r, p in enumerate(self._inflight.result.peer_report) if p.drain == self.drains + 1}
        at = max(p.drain_at for p in flagged.values())
        if self.micro_batches < at:
            self._warn_if_share_stretched(at)
            return  # this rank's own drain is still ahead (at micro-batch ``at``)
        ranks = sorted(flagged)
        message = (f"ACCO dynamic mode: rank(s) {ranks} drained (committed_weights, save_checkpoint, evaluation) "
                   f"for the {self.drains + 1}th time after micro-batch {at}; this rank (rank {self.rank}) has "
                   f"drained {self.drains} times and is at micro-batch {self.micro_batches}, so the ranks drained a "
                   "different number of times and cannot agree on which rounds to finish; fix: drain on every rank "
                   "at the same micro-batch count (not on rank 0 only, not on a per-rank condition)")
        ctx, report = self.context, dataclasses.replace(self._report(0), drain=DRAIN_ABORT)
        abort = self.lane.submit("drain mismatch", lambda: exchange_tallies(ctx, Tally(), report))
        try:
            self.lane.wait(abort)  # the peer waits in this slot: it learns it there
        except Exception:  # noqa: BLE001 -- a failing peer: the mismatch is still what this rank reports
            pass
        raise DrainMismatchError(message)

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (if any); a finished commit is booked as committed. In
        dynamic mode every rank's j-th drain finishes the same rounds (the protocol above): this
        rank may first end its phase early to join a round a peer launched."""
        if not self.agrees_drains or self._closed:  # closed: the lane is gone (a second destroy())
            return None if self._inflight is None else self._wait(self._inflight)
        with record_function("ACCO::drain"):
            self.drains += 1
            drain = self.drains
            inflight = self._inflight
            if inflight is not None:
                self._wait(inflight)
                if _flagged(inflight.result, drain):
                    return inflight.result
            # Probe the next slot: the counts this rank would send, were its phase to end now.
            self._sync_accumulated_loss_scale()
            local = self.buffer_tally
            report = self._report(drain)
            ctx = self.context
            probe = self.lane.submit(f"drain {drain} probe", lambda: exchange_tallies(ctx, local, report))
            with self._off_the_clock():
                per_rank, reports = self.lane.wait(probe)
            check_no_drain_abort(reports)
            if all(p.drain == drain for p in reports):
                return None if inflight is None else inflight.result  # nobody launched a round there
            self.end_phase(exchanged=(per_rank, reports), reason="drain")
            return self._wait(self._inflight)


def _flagged(result: RoundResult, drain: int) -> bool:
    """Whether some rank sent ``result``'s round as part of its drain number ``drain``."""
    return any(p.drain == drain for p in result.peer_report or ())
