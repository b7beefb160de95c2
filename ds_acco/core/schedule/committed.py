"""The committed weights θ in the model: a part :class:`.schedule.AccoSchedule` holds.

Between micro-batches the live weights are whatever the compute lane runs on next: after the swap
that launches a commit round, the estimate θ̃ (mode acco) or the previous θ (dpu), while θ itself
arrives in B. Two ways to put θ into the live weights, both by exchanging live weights and B in
place (no copy, nothing allocated on the lane):

* ``committed_weights()``, a block (evaluation, checkpoints);
* a *hold* (``hold_committed_weights``), for what happens outside a block -- an export's
  ``state_dict()``, ``model.eval()`` under ``ds_acco.install()``: θ stays until the compute lane's
  next micro-batch (the adapters' forward hook, ``before_backward``, the phase-end decision, the
  phase end) puts the model back onto the weights it runs on, bit for bit, so training goes on as
  without it; once closed, θ stays for good.

The way back depends on the adapter. Where it cannot re-point its parameters (FSDP2), it is the
same exchange again. Where it can (:attr:`.buffers.BufferGroup.lends_live`, DeepSpeed's flat
groups), it is no exchange: the model's parameters are *lent* B's gathered parameters (the weights
the compute lane runs on) and the live weights keep θ, because an export's tensors alias the live
weights, as stock's alias its parameters, and must stay θ until the next optimizer step, as stock's
do. B is idle until the phase end that collects the round, where θ is exactly what would be
unpacked into the live weights: the parameters point back and nothing is copied. A load settles
first (``release(settle=True)``): the parameters view the live weights again, which then hold what
the compute lane runs on. ``on_commit``'s observers are called once per commit, when its θ first
reaches the model (:meth:`CommittedWeights.announce`; a checkpoint records it).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, ContextManager, Dict, Optional, Protocol, Sequence

import torch

from ..checks.refusals import refuse
from ..round.buffers import BufferGroup
from ..round.kinds import RoundKind
from ..round.rounds import RoundResult
from .inflight import InFlight


class RoundInFlightError(RuntimeError):
    """An export (``state_dict()``) in dynamic accumulation while the round that holds the
    committed weights is still running: it needs peers that may launch it only later."""


def _in_flight_message(inflight: InFlight) -> str:
    return (f"ACCO dynamic accumulation: the model's weights were read for an export (state_dict(), "
            f"save_pretrained, save_16bit_model, ...) while this rank's {inflight.kind.value} round of step "
            f"{inflight.step} is still running; the committed weights need every rank to finish it, and in dynamic "
            "mode a peer may launch it only later, so an export does not wait for it (on one rank alone it would "
            "hang); fix: export inside `with ds_acco.committed_weights(engine):` entered on every rank at the same "
            "micro-batch count (e.g. `if rank == 0: torch.save(model.state_dict(), path)` inside it), or after "
            "engine.destroy() / acco.close()")


class Rounds(Protocol):
    """What the committed weights need of the schedule (its public names)."""

    @property
    def inflight(self) -> Optional[InFlight]: ...  # the round launched and not yet swapped in

    @property
    def agrees_drains(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def drain(self) -> Optional[RoundResult]: ...

    def wait_for(self, inflight: InFlight) -> RoundResult: ...

    def off_the_clock(self) -> ContextManager[None]: ...


class CommittedWeights:
    """``committed_weights()`` and holds: owns whether the live weights and B are exchanged.

    Args:
        groups: the buffer groups whose live weights and B it exchanges.
        rounds: the schedule, through :class:`Rounds` (its round in flight, drains and waits).
        shard_optimizer: read at each hold: an estimate round of an optimizer without a functional
            estimate steps the master shards in place, so a hold with ``settle_shards`` waits for it.
        gather: mode one_round, where B and the live weights carry predicted points P and θ is only
            in the master shards: all-gathers a group's gather view (a collective, every rank at
            once). Putting θ into the model then sets this rank's P segment aside, writes θ's shard
            there and all-gathers; the way back exchanges again, restores the segment and all-gathers
            (never lent). So a block is collective, and a hold is refused unless every rank makes it.
    """

    def __init__(self, groups: Sequence[BufferGroup], rounds: Rounds, shard_optimizer,
                 gather: Optional[Callable[[torch.Tensor], None]] = None):
        self.groups = list(groups)
        self.gather = gather
        self._points: Optional[list] = None  # mode one_round, θ gathered: this rank's P segments, per group
        self.rounds = rounds
        self.shard_optimizer = shard_optimizer
        self._swapped = False  # live and gathered exchanged: inside committed_weights, held, or lent
        self._lent = False  # exchanged, and the parameters view B's gathered part (the compute lane's)
        self._held = False  # the exchange is a hold (hold), undone by the next micro-batch
        self._pinned = 0  # committed_weights() blocks entered while held: no release inside them
        # called with t once θ_t is in the live weights (ds_acco.on_commit: RemovableHandle's keys)
        self.observers: Dict[int, Callable[[int], None]] = collections.OrderedDict()

    @property
    def swapped(self) -> bool:
        """Whether the live weights hold θ and B what the compute lane runs on (in a block, held, or
        lent: then the model's parameters view B)."""
        return self._swapped

    @property
    def _on_theta(self) -> bool:
        return self._swapped and not self._lent

    @contextlib.contextmanager
    def committed_weights(self):
        """Inside: the live weights hold the newest committed θ; on exit, the live state is restored.

        A commit round in flight is waited for (its θ is the newest); an estimate round is not:
        the live weights already are the committed θ_t and the round may go on. Collective in
        dynamic mode (an agreed drain): every rank enters it at the same micro-batch count. Held
        already (:meth:`hold`): θ stays in place after the block too.
        """
        with self.rounds.off_the_clock(), self._swapped_to_committed():  # an evaluation is not micro-batch compute
            yield

    @contextlib.contextmanager
    def _swapped_to_committed(self):
        rounds = self.rounds
        if rounds.agrees_drains:
            rounds.drain()  # on every rank, whatever the kind in flight: drains must pair up
        if self._on_theta:  # held: θ is in place; nothing releases it inside the block, the hold resumes after
            self._pinned += 1
            try:
                yield
            finally:
                self._pinned -= 1
            return
        inflight = rounds.inflight
        swap = inflight is not None and inflight.kind is RoundKind.COMMIT
        if swap:  # B holds θ_{t+1}, live holds θ̃_{t+1} (acco) or θ_t (dpu); or lent: the other way round
            if not rounds.agrees_drains:
                rounds.drain()
            self._to_theta(inflight)
        try:
            yield
        finally:
            if swap:
                self._to_compute()

    def points(self, index: int) -> Optional[list]:
        """Mode one_round, θ gathered into B: group ``index``'s P segment set aside (None otherwise)."""
        return None if self._points is None else self._points[index]

    def hold(self, agreed: bool = False, settle_shards: bool = False, final: bool = False) -> None:
        """Put the newest committed θ into the live weights and leave it there until the compute
        lane's next micro-batch (:meth:`release`, which every call of the micro-batch protocol
        makes first), or for good once closed: an export (``state_dict()``) or an evaluation
        outside a ``with committed_weights()`` block. Exchanges live weights and B in place (no
        copy); nothing changes inside a ``committed_weights()`` block or when held.

        Without ``agreed`` this is no collective and waits for nothing a peer has yet to do, so
        one rank alone may call it (an export on rank 0): fixed mode waits for the commit round
        in flight, which every rank launched at the same micro-batch count; in dynamic mode a peer
        may launch that round only later, so it is taken only once it has finished, and before
        that :class:`RoundInFlightError` says how to export. ``agreed``: every rank calls it at
        the same micro-batch count (an evaluation): dynamic mode drains first, as
        ``committed_weights()`` does. ``settle_shards``: the caller reads the master shards too
        (FSDP2's ``state_dict()``), and an estimate round of an optimizer without a functional
        estimate steps them in place (then restores them): it is waited for as well. ``final``: the
        schedule closes (every rank).
        """
        if self._on_theta:
            return
        rounds = self.rounds
        with rounds.off_the_clock():
            if agreed and rounds.agrees_drains:
                rounds.drain()
            inflight = rounds.inflight
            if inflight is None:
                return  # bootstrap, or everything collected: the live weights are θ
            estimate = inflight.kind is RoundKind.ESTIMATE
            if estimate and not (settle_shards and not self.shard_optimizer.functional):
                return  # the live weights are the committed θ_t the round started from
            if self.gather is not None and not (agreed or final):
                raise refuse("one_round_export", f"the model's weights read for an export (state_dict(), "
                             f"save_pretrained, ...) on one rank while it holds the predicted point P (commit round "
                             f"of step {inflight.step} launched)")
            if rounds.agrees_drains and inflight.result is None and not inflight.handle.done():
                raise RoundInFlightError(_in_flight_message(inflight))
            rounds.wait_for(inflight)
            if estimate:
                return
            self._to_theta(inflight)
            self._held = True

    def release(self, settle: bool = False) -> None:
        """Undo :meth:`hold`: the model runs on the weights the schedule runs on, bit for bit
        (lent: by reference, the live weights keep θ). No-op when nothing is held, inside a
        ``committed_weights()`` block (even one entered while held), and once closed (a closed
        schedule leaves θ in the model). ``settle``: a load is about to write the parameters:
        nothing stays lent (the parameters view the live weights, which hold what the compute lane
        runs on)."""
        if self._held and not self.rounds.closed and not self._pinned:
            self._to_compute()
            self._held = False
        if settle and self._lent:
            self._point(at_gathered=False)
            self._swap_live_and_gathered()

    @property
    def holds(self) -> bool:
        """Whether :meth:`hold` left θ in the live weights until the next micro-batch (False once
        closed: then θ stays for good)."""
        return self._held and not self.rounds.closed

    def forget(self) -> None:
        """End an exchange without undoing it: the caller overwrites the live weights and B (a
        load) or takes them as they are (a reset: θ, if held or lent)."""
        if self._lent:
            self._point(at_gathered=False)
        self._swapped = self._held = False
        self._points = None

    def unpack(self, inflight) -> None:
        """The phase end collected ``inflight``: its parameters into the live weights. Lent, the
        live weights hold them already (the hold put them there): the parameters point back."""
        if self._lent:
            self._point(at_gathered=False)
            self._swapped = False
        else:
            for g in self.groups:
                g.unpack_into_live()
        self.announce(inflight)

    def announce(self, inflight) -> None:
        """A commit's θ is in the live weights for the first time: tell the observers (once)."""
        if inflight.announce():
            for observe in list(self.observers.values()):
                observe(inflight.step + 1)

    def _to_theta(self, inflight) -> None:
        """The model onto θ (the commit ``inflight``'s): point back when lent, else exchange."""
        if self._lent:
            self._point(at_gathered=False)
        else:
            if self.gather is not None:
                self._gather_theta()
            self._swap_live_and_gathered()
        self.announce(inflight)

    def _to_compute(self) -> None:
        """The model back onto the compute lane's weights: lent where every group can, else exchanged."""
        if self.gather is not None:
            self._swap_live_and_gathered()
            self._restore_points()
        elif all(g.lends_live for g in self.groups):
            self._point(at_gathered=True)
        else:
            self._swap_live_and_gathered()

    def _gather_theta(self) -> None:
        """Mode one_round: B's gathered parameters ← θ (this rank's P segment set aside)."""
        self._points = []
        for g in self.groups:
            outs = g.param_outputs(RoundKind.COMMIT)
            self._points.append([o.clone() for o in outs])
            for out, value in zip(outs, g.shard_values()):  # a few tensors, at an evaluation only
                out.copy_(value.reshape(-1))
            self.gather(g.gather_view())

    def _restore_points(self) -> None:
        """Mode one_round: B's gathered parameters ← P again (:meth:`_gather_theta` undone)."""
        for g, saved in zip(self.groups, self._points):
            for out, value in zip(g.param_outputs(RoundKind.COMMIT), saved):
                out.copy_(value)
            self.gather(g.gather_view())
        self._points = None

    def _point(self, at_gathered: bool) -> None:
        for g in self.groups:
            g.point_live(at_gathered)
        self._lent = at_gathered

    def _swap_live_and_gathered(self) -> None:
        for g in self.groups:
            g.swap_live_and_gathered()
        self._swapped = not self._swapped
