"""The schedule's in-flight state for checkpoints: an exact resume, including the round in flight
(a part :class:`.schedule.AccoSchedule` holds; it owns the format, the schedule the state)."""
from __future__ import annotations

import logging

from .phases import PhaseKind, SharedPhases
from .position import Position

OLD_DEFAULT_LR_SCALE = 2.0  # every optimizer's default estimate before the per-family defaults (v0.4 and earlier)


class ScheduleState:
    """``state_dict`` / ``load_state_dict`` / ``reset`` of one schedule.

    It owns nothing that changes: the format (its version, keys and checks) is its concern; what it
    saves and restores is the schedule's, read through the schedule's public names (its
    :class:`.position.Position`, its parts' :attr:`~.committed.CommittedWeights.swapped` and drain
    count) and restored by asking the schedule and its parts (``restore``, ``restore_count``): it
    writes none of their attributes.
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
        phases = s.phases
        shared = isinstance(phases, SharedPhases)
        return {
            "version": self.STATE_VERSION,
            "mode": s.mode,
            "world": s.world,
            "layout": [g.layout() for g in s.groups],
            **s.position.to_dict(),  # phase, step and commit counts, tallies, loss scale, grad norm, round in flight
            "drains": s.drain_agreement.count,
            "shares": list(phases.shares) if shared else None,
            "shares_aligned": phases.aligned if shared else None,
            "share_rates": [list(v) for v in phases.measured] if shared else None,
            "groups": [g.export_state(s.committed.swapped, s.committed.points(i)) for i, g in enumerate(s.groups)],
            "delay": None if s.context.delay is None else s.context.delay.state(),  # D (delay compensation)
            "predictor": None if s.context.predictor is None else s.context.predictor.state(),  # ef's P
            "estimate_lr_scale": s.context.estimate_lr_scale if s.mode == "acco" else None,  # what θ̃ stepped with
            "auto": None if s.auto is None else s.auto.state(),  # mode 'auto': its measurements and decision
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same mode, world size and layout)."""
        s = self.schedule
        s.drain()
        if s.auto is not None:  # mode 'auto': the saved decision's mode, before the mode is compared
            s.auto.load(state.get("auto"))
        mismatch = [k for k, mine in (("version", self.STATE_VERSION), ("mode", s.mode), ("world", s.world),
                                      ("layout", [g.layout() for g in s.groups])) if state.get(k) != mine]
        if mismatch:
            raise ValueError(f"ACCO in-flight state does not fit this run ({', '.join(mismatch)} differ)")
        position = Position.from_dict(state)  # may refuse (the round's result): before any change
        if position.phase is PhaseKind.SYNC and s.sync_phases is None:
            raise ValueError("ACCO in-flight state saved during the synchronous warm-up (acco.sync_warmup_steps) does "
                             "not fit this run (its accumulation is not fixed)")
        s.committed.forget()  # a hold ends here: the import below overwrites live weights and B
        ctx = s.context
        # The shards are all-gathered on the lane (the rounds' group; drained, so it is free):
        # every rank loads at the same point.
        for g, saved in zip(s.groups, state["groups"]):
            g.import_state(saved, s.gather_on_lane)
        if ctx.delay is not None:
            ctx.delay.load(state.get("delay"))
        if ctx.predictor is not None:
            ctx.predictor.load(state.get("predictor"))
        phases = None
        if isinstance(s.phases, SharedPhases) and state.get("shares"):  # none: saved in another mode
            # Saved before 'shares_aligned' existed: its shares may have differed earlier, which
            # leaves the ranks' phase ends apart, so drains keep the agreement protocol.
            phases = s.phases.for_rank(s.rank, s.world, state["shares"], aligned=state.get("shares_aligned") or False,
                                       measured=state.get("share_rates") or ())
        # The saved position (its round in flight a finished round whose result sits in B); the phase
        # in progress began before the save: not measured.
        s.restore(position, phases)
        drains = s.drain_agreement
        drains.restore_count(state.get("drains", drains.count))  # the saving run's count: flags stay comparable
        s.sync_accumulated_loss_scale()  # the restored scaler's scale (the same, unless it was replaced)
        # saved before the value was recorded: that code's estimate had lr_scale 2 unless its config set one
        self._warn_if_estimate_changed(state.get("estimate_lr_scale"), recorded="estimate_lr_scale" in state)

    def _warn_if_estimate_changed(self, saved, recorded: bool = True) -> None:
        """A resume whose estimate's lr_scale differs from the saving run's (another config, or the
        optimizer family's default where the config gives none) goes on with this run's, said on rank 0.
        A state saved before the value was recorded (``recorded`` False) was saved by code whose default
        was lr_scale 2 for every optimizer: a run now at another value is told so."""
        s = self.schedule
        mine = s.context.estimate_lr_scale
        if not recorded and s.mode == "acco" and mine != OLD_DEFAULT_LR_SCALE and s.rank == 0:
            logging.getLogger("ds_acco").warning(
                "ACCO resume: the checkpoint does not record its estimate's lr_scale (saved before the per-family defaults, whose "
                "default was %g for every optimizer); this run's is %g (acco.estimate.lr_scale, or the optimizer "
                "family's default: docs/estimate.md#the-default-per-optimizer-family). If the saving run used the "
                "default, set \"estimate\": {\"lr_scale\": %g} to go on as saved.", OLD_DEFAULT_LR_SCALE, mine,
                OLD_DEFAULT_LR_SCALE)
            return
        if saved is None or s.mode != "acco" or saved == mine or s.rank != 0:
            return
        logging.getLogger("ds_acco").warning(
            "ACCO resume: the checkpoint's run computed its estimates with lr_scale %g, this run's config gives %g "
            "(acco.estimate.lr_scale, or the optimizer family's default: "
            "docs/estimate.md#the-default-per-optimizer-family); the estimates from here use %g. To go on as saved, "
            "set \"estimate\": {\"lr_scale\": %g}.", saved, mine, mine, saved)

    def reset(self, committed_steps: int) -> None:
        """Forget everything in flight and start a bootstrap phase at the current weights, as after
        ``committed_steps`` optimizer steps (e.g. after loading a stock ZeRO-1 checkpoint); a step of
        the synchronous warm-up instead while ``committed_steps`` is below ``sync_warmup_steps``."""
        s = self.schedule
        s.drain()
        s.committed.forget()  # a hold ends here: the live weights as they are now (θ if held)
        # Nothing in flight, empty tallies; the micro-batch count and the last commit's norm go on. The
        # synchronous warm-up goes on to its end; a new phase: not measured.
        s.restore(Position(s.opening_phase(committed_steps), step_index=committed_steps,
                           committed_steps=committed_steps, micro_batches=s.micro_batches,
                           accumulated_loss_scale=s.current_loss_scale(),
                           last_commit_grad_norm=s.last_commit_grad_norm))
        for g in s.groups:
            g.reset()
        if s.context.delay is not None:
            s.context.delay.clear()  # θ̃ = θ: no lead
        if s.context.predictor is not None:
            s.context.predictor.start()  # P = θ: a fresh start
