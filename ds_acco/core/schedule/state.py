"""The schedule's in-flight state for checkpoints: an exact resume, including the round in flight
(a part :class:`.schedule.AccoSchedule` holds; it owns the format, the schedule the state)."""
from __future__ import annotations

from concurrent.futures import Future

from ...comm import collectives
from ...comm.lane import RoundHandle
from ..round.kinds import Tally
from ..round.rounds import RoundKind, RoundResult
from .inflight import InFlight
from .phases import PhaseKind, SharedPhases


class ScheduleState:
    """``state_dict`` / ``load_state_dict`` / ``reset`` of one schedule.

    It owns nothing that changes: the format (its version, keys and checks) is its concern; what it
    saves and restores is the schedule's, read and set through the schedule's public names (its
    position, tallies and counts, :attr:`~.schedule.AccoSchedule.inflight`, its parts'
    :attr:`~.committed.CommittedWeights.swapped` and drain count).
    """

    STATE_VERSION = 3  # 3: live weights and B's parameters saved as this rank's shard

    def __init__(self, schedule):
        self.schedule = schedule

    def state_dict(self) -> dict:
        """Everything in flight, for an exact resume: G, the live weights and B's gathered
        parameters as the compute lane sees them, the phase position and the finished round's
        result. Drains first (no collective is cut). Tensors are copied to CPU."""
        s = self.schedule
        s.drain()
        inflight, phases = s.inflight, s.phases
        shared = isinstance(phases, SharedPhases)
        return {
            "version": self.STATE_VERSION,
            "mode": s.mode,
            "world": s.world,
            "layout": [g.layout() for g in s.groups],
            "phase": s.phase.value,
            "step_index": s.step_index,
            "committed_steps": s.committed_steps,
            "phase_tally": (s.phase_tally.micro_batches, s.phase_tally.weight),
            "buffer_tally": (s.buffer_tally.micro_batches, s.buffer_tally.weight),
            "micro_batches": s.micro_batches,
            "accumulated_loss_scale": s.accumulated_loss_scale,
            "drains": s.drain_agreement.count,
            "last_commit_grad_norm": s.last_commit_grad_norm,
            "shares": list(phases.shares) if shared else None,
            "shares_aligned": phases.aligned if shared else None,
            "share_rates": [list(v) for v in phases.measured] if shared else None,
            "groups": [g.export_state(s.committed.swapped) for g in s.groups],
            "delay": None if s.context.delay is None else s.context.delay.state(),  # D (delay compensation)
            "inflight": None if inflight is None else {
                "kind": inflight.kind.value, "step": inflight.step, "committed": inflight.committed,
                "announced": inflight.announced,  # on_commit called for it: not again after a resume
                "result": inflight.result.to_dict()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same mode, world size and layout)."""
        s = self.schedule
        s.drain()
        mismatch = [k for k, mine in (("version", self.STATE_VERSION), ("mode", s.mode), ("world", s.world),
                                      ("layout", [g.layout() for g in s.groups])) if state.get(k) != mine]
        if mismatch:
            raise ValueError(f"ACCO in-flight state does not fit this run ({', '.join(mismatch)} differ)")
        info = state["inflight"]
        result = None if info is None else RoundResult.from_dict(info["result"])  # may refuse: before any change
        if PhaseKind(state["phase"]) is PhaseKind.SYNC and s.sync_phases is None:
            raise ValueError("ACCO in-flight state saved during the synchronous warm-up (acco.sync_warmup_steps) does "
                             "not fit this run (its accumulation is not fixed)")
        s.committed.forget()  # a hold ends here: the import below overwrites live weights and B
        ctx, lane = s.context, s.lane
        # The shards are all-gathered on the lane (the rounds' group; drained, so it is free):
        # every rank loads at the same point.
        gather = lambda flat: lane.wait(lane.submit(  # noqa: E731
            "load: all-gather", lambda: collectives.gather_in_place(flat, ctx.rank, ctx.world, ctx.process_group,
                                                ctx.chunk_elems)))
        for g, saved in zip(s.groups, state["groups"]):
            g.import_state(saved, gather)
        if ctx.delay is not None:
            ctx.delay.load(state.get("delay"))
        s.phase = PhaseKind(state["phase"])
        s.step_index = state["step_index"]
        s.committed_steps = state["committed_steps"]
        s.phase_tally = Tally(*state["phase_tally"])
        s.buffer_tally = Tally(*state["buffer_tally"])
        s.micro_batches = state["micro_batches"]
        s.accumulated_loss_scale = float(state["accumulated_loss_scale"])
        drains = s.drain_agreement
        drains.count = int(state.get("drains", drains.count))  # the saving run's count: flags stay comparable
        s.last_commit_grad_norm = state.get("last_commit_grad_norm")
        s.sync_accumulated_loss_scale()  # the restored scaler's scale (the same, unless it was replaced)
        s.forget_phase_in_progress()  # the phase in progress began before the save: not measured
        if isinstance(s.phases, SharedPhases) and state.get("shares"):  # none: saved in another mode
            # Saved before 'shares_aligned' existed: its shares may have differed earlier, which
            # leaves the ranks' phase ends apart, so drains keep the agreement protocol.
            s.phases = s.phases.for_rank(s.rank, s.world, state["shares"],
                                         aligned=state.get("shares_aligned") or False,
                                         measured=state.get("share_rates") or ())
        if info is None:
            s.restore_inflight(None)
        else:  # a finished round whose result sits in B
            future: Future = Future()
            future.set_result(result)
            s.restore_inflight(InFlight(RoundHandle(f"{info['kind']} {info['step']} (restored)", future),
                                        RoundKind(info["kind"]), info["step"], result, info["committed"],
                                        announced=bool(info.get("announced", False))))  # absent: saved before it was

    def reset(self, committed_steps: int) -> None:
        """Forget everything in flight and start a bootstrap phase at the current weights, as after
        ``committed_steps`` optimizer steps (e.g. after loading a stock ZeRO-1 checkpoint); a step of
        the synchronous warm-up instead while ``committed_steps`` is below ``sync_warmup_steps``."""
        s = self.schedule
        s.drain()
        s.committed.forget()  # a hold ends here: the live weights as they are now (θ if held)
        s.restore_inflight(None)
        s.step_index = s.committed_steps = committed_steps
        s.phase = s.opening_phase(committed_steps)  # the synchronous warm-up goes on to its end
        s.phase_tally = Tally()
        s.buffer_tally = Tally()
        s.forget_phase_in_progress()  # a new bootstrap phase: not measured
        s.accumulated_loss_scale = s.current_loss_scale()
        for g in s.groups:
            g.reset()
        if s.context.delay is not None:
            s.context.delay.clear()  # θ̃ = θ: no lead
