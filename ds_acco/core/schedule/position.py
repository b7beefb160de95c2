"""The schedule's position as one value: where the phases, steps, tallies and the round in flight stand.

:class:`Position` is immutable: the schedule (:mod:`.machine`) replaces it at each transition
(:meth:`Position.moved`) and is the only code that does; the parts read it through the schedule's
read-only names. A checkpoint saves it (:meth:`Position.to_dict`, the keys of
:class:`.state.ScheduleState`'s format) and a load builds a new one (:meth:`Position.from_dict`).
The round in flight is a reference to its :class:`.inflight.InFlight` record, whose own bookkeeping
(result, waits, commit booked, announced) only its methods change.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Optional

from ...comm.lane import RoundHandle
from ..round.kinds import Tally
from ..round.rounds import RoundKind, RoundResult
from .inflight import InFlight
from .phases import PhaseKind


@dataclass(frozen=True)
class Position:
    """Where a schedule stands between two calls of the compute lane."""

    phase: PhaseKind  # the phase in progress
    step_index: int = 0  # t: the optimizer step whose data the compute lane is producing
    committed_steps: int = 0  # commits booked (waited for)
    phase_tally: Tally = Tally()  # the phase in progress
    buffer_tally: Tally = Tally()  # what G holds since it was last cleared
    micro_batches: int = 0  # all micro-batches ever recorded
    accumulated_loss_scale: float = 1.0  # the scale G's contents carry
    last_commit_grad_norm: Optional[float] = None  # the newest collected commit's
    inflight: Optional[InFlight] = None  # the round launched and not yet swapped in
    decision: Optional[tuple] = None  # (micro-batch index, why the phase ends or None); not saved

    def moved(self, **changes) -> "Position":
        """A new position: this one with ``changes`` (what ``dataclasses.replace`` returns, without
        re-running ``__init__``: the schedule moves at least twice per micro-batch)."""
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"Position has no field(s) {sorted(unknown)}")
        new = object.__new__(Position)
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return new

    def to_dict(self) -> dict:
        """The saved keys (:class:`.state.ScheduleState`'s format; the round in flight finished)."""
        inflight = self.inflight
        return {
            "phase": self.phase.value,
            "step_index": self.step_index,
            "committed_steps": self.committed_steps,
            "phase_tally": (self.phase_tally.micro_batches, self.phase_tally.weight),
            "buffer_tally": (self.buffer_tally.micro_batches, self.buffer_tally.weight),
            "micro_batches": self.micro_batches,
            "accumulated_loss_scale": self.accumulated_loss_scale,
            "last_commit_grad_norm": self.last_commit_grad_norm,
            "inflight": None if inflight is None else {
                "kind": inflight.kind.value, "step": inflight.step, "committed": inflight.committed,
                "announced": inflight.announced,  # on_commit called for it: not again after a resume
                "result": inflight.result.to_dict()},
        }

    @classmethod
    def from_dict(cls, state: dict) -> "Position":
        """:meth:`to_dict`'s keys in ``state``; a saved round in flight is a finished round whose
        result sits in B (raises on a result it cannot read, before anything changes)."""
        info = state["inflight"]
        inflight = None
        if info is not None:
            future: Future = Future()
            future.set_result(RoundResult.from_dict(info["result"]))
            inflight = InFlight(RoundHandle(f"{info['kind']} {info['step']} (restored)", future),
                                RoundKind(info["kind"]), info["step"], future.result(), info["committed"],
                                announced=bool(info.get("announced", False)))  # absent: saved before it was
        return cls(phase=PhaseKind(state["phase"]), step_index=state["step_index"],
                   committed_steps=state["committed_steps"], phase_tally=Tally(*state["phase_tally"]),
                   buffer_tally=Tally(*state["buffer_tally"]), micro_batches=state["micro_batches"],
                   accumulated_loss_scale=float(state["accumulated_loss_scale"]),
                   last_commit_grad_norm=state.get("last_commit_grad_norm"), inflight=inflight)


_FIELDS = frozenset(f.name for f in fields(Position))


def position_field(name: str, doc: str) -> property:
    """A read-only property of the schedule that reads its position's ``name``."""
    return property(lambda schedule: getattr(schedule.position, name), doc=doc)
