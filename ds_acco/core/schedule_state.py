"""The schedule's in-flight state for checkpoints: an exact resume, including the round in flight
(a part of :class:`.schedule.AccoSchedule`)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

from ..comm import collectives
from ..comm.lane import RoundHandle
from .phases import PhaseKind, SharedPhases, Tally
from .rounds import RoundKind, RoundResult


@dataclass
class _InFlight:
    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)
    wait_s: float = 0.0  # how long the compute lane blocked on it
    wait_mark: Optional[float] = None  # wait_s before a phase-end decision waited for it (dynamic mode)


class ScheduleState:
    """``state_dict`` / ``load_state_dict`` / ``reset``, mixed into :class:`.schedule.AccoSchedule`."""

    STATE_VERSION = 3  # 3: live weights and B's parameters saved as this rank's shard

    def state_dict(self) -> dict:
        """Everything in flight, for an exact resume: G, the live weights and B's gathered
        parameters as the compute lane sees them, the phase position and the finished round's
        result. Drains first (no collective is cut). Tensors are copied to CPU."""
        self.drain()
        inflight = self._inflight
        return {
            "version": self.STATE_VERSION,
            "mode": self.mode,
            "world": self.world,
            "layout": [g.layout() for g in self.groups],
            "phase": self.phase.value,
            "step_index": self.step_index,
            "committed_steps": self.committed_steps,
            "phase_tally": (self.phase_tally.micro_batches, self.phase_tally.weight),
            "buffer_tally": (self.buffer_tally.micro_batches, self.buffer_tally.weight),
            "micro_batches": self.micro_batches,
            "accumulated_loss_scale": self.accumulated_loss_scale,
            "drains": self.drains,
            "last_commit_grad_norm": self.last_commit_grad_norm,
            "shares": list(self.phases.shares) if isinstance(self.phases, SharedPhases) else None,
            "shares_aligned": self.phases.aligned if isinstance(self.phases, SharedPhases) else None,
            "share_rates": ([list(v) for v in self.phases.measured] if isinstance(self.phases, SharedPhases)
                            else None),
            "groups": [g.export_state(self._swapped) for g in self.groups],
            "delay": None if self.context.delay is None else self.context.delay.state(),  # D (delay compensation)
            "inflight": None if inflight is None else {
                "kind": inflight.kind.value, "step": inflight.step, "committed": inflight.committed,
                "result": inflight.result.to_dict()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same mode, world size and layout)."""
        self.drain()
        mismatch = [k for k, mine in (("version", self.STATE_VERSION), ("mode", self.mode), ("world", self.world),
                                      ("layout", [g.layout() for g in self.groups])) if state.get(k) != mine]
        if mismatch:
            raise ValueError(f"ACCO in-flight state does not fit this run ({', '.join(mismatch)} differ)")
        info = state["inflight"]
        result = None if info is None else RoundResult.from_dict(info["result"])  # may refuse: before any change
        if PhaseKind(state["phase"]) is PhaseKind.SYNC and self.sync_phases is None:
            raise ValueError("ACCO in-flight state saved during the synchronous warm-up (acco.sync_warmup_steps) does "
                             "not fit this run (its accumulation is not fixed)")
        self._swapped = self._held = False  # a hold ends here: the import below overwrites live weights and B
        ctx = self.context
        # The shards are all-gathered on the lane (the rounds' group; drained, so it is free):
        # every rank loads at the same point.
        gather = lambda flat: self.lane.wait(self.lane.submit(  # noqa: E731
            "load: all-gather", lambda: collectives.gather_in_place(flat, ctx.rank, ctx.world, ctx.process_group,
                                                ctx.chunk_elems)))
        for g, saved in zip(self.groups, state["groups"]):
            g.import_state(saved, gather)
        if ctx.delay is not None:
            ctx.delay.load(state.get("delay"))
        self.phase = PhaseKind(state["phase"])
        self.step_index = state["step_index"]
        self.committed_steps = state["committed_steps"]
        self.phase_tally = Tally(*state["phase_tally"])
        self.buffer_tally = Tally(*state["buffer_tally"])
        self.micro_batches = state["micro_batches"]
        self.accumulated_loss_scale = float(state["accumulated_loss_scale"])
        self.drains = int(state.get("drains", self.drains))  # the saving run's count: flags stay comparable
        self.last_commit_grad_norm = state.get("last_commit_grad_norm")
        self._sync_accumulated_loss_scale()  # the restored scaler's scale (the same, unless it was replaced)
        self._decision = None
        self.context.pending_drift = None  # a drift measured before the load belongs to no step after it
        if isinstance(self.phases, SharedPhases) and state.get("shares"):  # none: saved in another mode
            # Saved before 'shares_aligned' existed: its shares may have differed earlier, which
            # leaves the ranks' phase ends apart, so drains keep the agreement protocol.
            self.phases = self.phases.for_rank(self.rank, self.world, state["shares"],
                                               aligned=state.get("shares_aligned") or False,
                                               measured=state.get("share_rates") or ())
        self._phase_clock = None  # the phase in progress began before the save: not measured
        if info is None:
            self._inflight = None
        else:  # a finished round whose result sits in B
            future: Future = Future()
            future.set_result(result)
            self._inflight = _InFlight(RoundHandle(f"{info['kind']} {info['step']} (restored)", future),
                                       RoundKind(info["kind"]), info["step"], result, info["committed"])

    def reset(self, committed_steps: int) -> None:
        """Forget everything in flight and start a bootstrap phase at the current weights, as after
        ``committed_steps`` optimizer steps (e.g. after loading a stock ZeRO-1 checkpoint); a step of
        the synchronous warm-up instead while ``committed_steps`` is below ``sync_warmup_steps``."""
        self.drain()
        self._swapped = self._held = False  # a hold ends here: the live weights as they are now (θ if held)
        self._inflight = None
        self.step_index = self.committed_steps = committed_steps
        self.phase = self._opening_phase(committed_steps)  # the synchronous warm-up goes on to its end
        self.phase_tally = Tally()
        self.buffer_tally = Tally()
        self._decision = None
        self.context.pending_drift = None  # a drift measured before the load belongs to no step after it
        self._phase_clock = None  # a new bootstrap phase: not measured
        self.accumulated_loss_scale = self._current_loss_scale()
        for g in self.groups:
            g.reset()
        if self.context.delay is not None:
            self.context.delay.clear()  # θ̃ = θ: no lead
