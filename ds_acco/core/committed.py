"""The committed weights θ in the model, as a part of :class:`.schedule.AccoSchedule`.

Between micro-batches the live weights are whatever the compute lane runs on next: after the swap
that launches a commit round, the estimate θ̃ (mode acco) or the previous θ (dpu), while θ itself
arrives in B. Two ways to put θ into the live weights, both by exchanging live weights and B in
place (no copy, nothing allocated on the lane):

* ``committed_weights()``, a block that exchanges back on exit (evaluation, checkpoints);
* a *hold* (``hold_committed_weights``), for what happens outside a block -- an export's
  ``state_dict()``, ``model.eval()`` under ``ds_acco.install()``: θ stays until the compute lane's
  next micro-batch (the adapters' forward hook, ``before_backward``, the phase-end decision, the
  phase end) exchanges back, bit for bit, so training goes on as without it; once closed, for good.
"""
from __future__ import annotations

import contextlib

from .phases import RoundKind
from .schedule_state import _InFlight


class RoundInFlightError(RuntimeError):
    """An export (``state_dict()``) in dynamic accumulation while the round that holds the
    committed weights is still running: it needs peers that may launch it only later."""


def _in_flight_message(inflight: _InFlight) -> str:
    return (f"ACCO dynamic accumulation: the model's weights were read for an export (state_dict(), "
            f"save_pretrained, save_16bit_model, ...) while this rank's {inflight.kind.value} round of step "
            f"{inflight.step} is still running; the committed weights need every rank to finish it, and in dynamic "
            "mode a peer may launch it only later, so an export does not wait for it (on one rank alone it would "
            "hang); fix: export inside `with ds_acco.committed_weights(engine):` entered on every rank at the same "
            "micro-batch count (e.g. `if rank == 0: torch.save(model.state_dict(), path)` inside it), or after "
            "engine.destroy() / acco.close()")


class CommittedWeights:
    """``committed_weights`` and holds, mixed into :class:`.schedule.AccoSchedule` (it reads the
    schedule's round in flight, lane and drains, and exchanges its groups' live weights and B)."""

    def _init_committed_weights(self) -> None:
        self._swapped = False  # live and gathered exchanged: inside committed_weights, or held
        self._held = False  # the exchange is a hold (hold_committed_weights), undone by the next micro-batch
        self._pinned = 0  # committed_weights() blocks entered while held: no release inside them

    @contextlib.contextmanager
    def committed_weights(self):
        """Inside: the live weights hold the newest committed θ; on exit, the live state is restored.

        A commit round in flight is waited for (its θ is the newest); an estimate round is not:
        the live weights already are the committed θ_t and the round may go on. Collective in
        dynamic mode (an agreed drain): every rank enters it at the same micro-batch count. Held
        already (:meth:`hold_committed_weights`): θ stays in place after the block too.
        """
        with self._off_the_clock(), self._swapped_to_committed():  # an evaluation is not micro-batch compute
            yield

    @contextlib.contextmanager
    def _swapped_to_committed(self):
        if self.agrees_drains:
            self.drain()  # on every rank, whatever the kind in flight: drains must pair up
        if self._swapped:  # held: θ is in place; nothing releases it inside the block, the hold resumes after
            self._pinned += 1
            try:
                yield
            finally:
                self._pinned -= 1
            return
        inflight = self._inflight
        swap = inflight is not None and inflight.kind is RoundKind.COMMIT
        if swap:  # B holds θ_{t+1}, live holds θ̃_{t+1} (acco) or θ_t (dpu)
            if not self.agrees_drains:
                self.drain()
            self._swap_live_and_gathered()
        try:
            yield
        finally:
            if swap:
                self._swap_live_and_gathered()

    def hold_committed_weights(self, agreed: bool = False, settle_shards: bool = False) -> None:
        """Put the newest committed θ into the live weights and leave it there until the compute
        lane's next micro-batch (:meth:`release_committed_weights`, which every call of the
        micro-batch protocol makes first), or for good once closed: an export (``state_dict()``)
        or an evaluation outside a ``with committed_weights()`` block. Exchanges live weights and
        B in place (no copy); nothing changes inside a ``committed_weights()`` block or when held.

        Without ``agreed`` this is no collective and waits for nothing a peer has yet to do, so
        one rank alone may call it (an export on rank 0): fixed mode waits for the commit round
        in flight, which every rank launched at the same micro-batch count; in dynamic mode a peer
        may launch that round only later, so it is taken only once it has finished, and before
        that :class:`RoundInFlightError` says how to export. ``agreed``: every rank calls it at
        the same micro-batch count (an evaluation): dynamic mode drains first, as
        ``committed_weights()`` does. ``settle_shards``: the caller reads the master shards too
        (FSDP2's ``state_dict()``), and an estimate round of an optimizer without a functional
        estimate steps them in place (then restores them): it is waited for as well.
        """
        if self._swapped:
            return
        with self._off_the_clock():
            if agreed and self.agrees_drains:
                self.drain()
            inflight = self._inflight
            if inflight is None:
                return  # bootstrap, or everything collected: the live weights are θ
            estimate = inflight.kind is RoundKind.ESTIMATE
            if estimate and not (settle_shards and not self.context.shard_optimizer.functional):
                return  # the live weights are the committed θ_t the round started from
            if self.agrees_drains and inflight.result is None and not inflight.handle.done():
                raise RoundInFlightError(_in_flight_message(inflight))
            self._wait(inflight)
            if estimate:
                return
            self._swap_live_and_gathered()
            self._held = True

    def release_committed_weights(self) -> None:
        """Undo :meth:`hold_committed_weights`: the live weights the schedule runs on are back,
        bit for bit. No-op when nothing is held, inside a ``committed_weights()`` block (even one
        entered while held), and once closed (a closed schedule leaves θ in the model)."""
        if self._held and not self._closed and not self._pinned:
            self._swap_live_and_gathered()
            self._held = False

    @property
    def holds_committed_weights(self) -> bool:
        """Whether :meth:`hold_committed_weights` left θ in the live weights until the next micro-batch
        (False once closed: then θ stays for good)."""
        return self._held and not self._closed

    def _swap_live_and_gathered(self) -> None:
        for g in self.groups:
            g.swap_live_and_gathered()
        self._swapped = not self._swapped
