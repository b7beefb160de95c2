"""The ACCO / DPU schedule of ACCO.md as a state machine over buffer groups. No DeepSpeed or FSDP.

Phases and rounds (mode 'acco'):
  bootstrap -- compute at θ_0 into G ---------------------------------------> B ← G, round E_0
  phase E_t -- compute g_t at θ_t into G (G still holds Σg̃_t) ---- round E_t: θ̃_{t+1}, discarded S
  swap      -- model ← θ̃_{t+1}; B ← G (full batch); G ← 0; round C_t
  phase C_t -- compute g̃_{t+1} at θ̃_{t+1} into G ------------------ round C_t: θ_{t+1}, S_{t+1} kept
  swap      -- model ← θ_{t+1}; commit booked (``on_commit``); B ← G (Σg̃_{t+1}); round E_{t+1}
Mode 'dpu' has only commit rounds: at each phase end, model ← θ_k, B ← G, G ← 0, round k.
Each phase end is a row of :data:`.transitions.TRANSITIONS` (by mode and phase ended).

The LR scheduler's step for step t falls due when C_t is launched (``after_launch``), is taken right
after (``before_launch`` at the latest: :mod:`..lifecycle.lr_bookkeeping`) and booked, or undone for a
skipped commit, at the commit's collection (``on_commit``): both rounds of step t use step t's rate.

The synchronous warm-up (``acco.sync_warmup_steps`` = K, fixed accumulation) runs stock's step with
ACCO's buffers: K phases SYNC of A micro-batches at θ_t, then B ← G, G ← 0, a commit round waited for at
once, model ← θ_{t+1} (stock ZeRO-1's weights); then mode 'acco' (θ̃_K = θ_K) or 'one_round' (P = θ_K)
bootstraps from θ_K. Mode 'auto' runs stock's steps until its part (:mod:`.auto`) decides, then stays
there (stock) or adopts the mode chosen (:meth:`AccoSchedule.adopt`).

G and B are the buffer groups' ``grads`` and ``comm`` (see :mod:`.buffers`); a round is
:func:`.rounds.run_round` on the lane. The schedule holds its parts, each an object with a public
interface that reaches the schedule only through its public names: dynamic mode's drains that agree
across ranks (:mod:`.drains`), θ put into the live weights for evaluations and exports
(:mod:`.committed`), the in-flight state of checkpoints (:mod:`.state`) and this rank's
compute clock (:mod:`.compute_clock`). Where the schedule stands is one value, :class:`.position.Position`,
which only the schedule replaces; the parts read it through the schedule's read-only names.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable, ContextManager, Deque, List, Optional, Sequence

from torch.profiler import record_function

from ...comm import collectives
from ...comm.lane import CommLane
from ..round.buffers import BufferGroup
from ..round.kinds import Tally
from ..round.report import RoundReport
from ..round.rounds import RoundKind, RoundResult, run_round
from .committed import CommittedWeights
from .auto import AutoChoice
from .compute_clock import ComputeClock
from .drains import DrainAgreement
from .inflight import InFlight
from .options import ScheduleOptions
from .phases import PhaseKind, PhaseRecord, SharedPhases
from .position import Position, position_field
from .state import ScheduleState
from .transitions import TRANSITIONS


class AccoSchedule:
    """Owns the phases, the rounds and the swaps for a set of buffer groups.

    Args:
        groups: the buffer groups (G, B, live weights, shards).
        shard_optimizer: steps the shards (estimate or commit).
        lane: where rounds run.
        process_group, rank, world: the rounds' dedicated group and this rank's place in it.
        norm_group: tensor parallelism: a dedicated model-parallel group the norm is also summed over.
        options: see :class:`ScheduleOptions`.
        reduce_scatter: reduce with a reduce-scatter (NCCL) rather than all-reduce + slice (gloo).
        loss_scale: the loss scale backward passes use now (fp16; None, or it returns None: 1). G always carries
            the current scale (rescaled when it changes, in ``on_commit``): a round divides by G's when packed.
        report: called on the compute lane at each launch; a :class:`.report.RoundReport` that travels with the
            round's counts to every rank (``RoundResult.peer_report``); the schedule fills its drain fields.
        on_commit: called on the compute lane once per committed step, θ_{t+1} known, before the next launch.
        before_launch: called on the compute lane before each round captures the optimizer's settings.
        after_launch: called on the compute lane with the kind of each round just launched.
    """

    def __init__(self, groups: Sequence[BufferGroup], shard_optimizer, lane: CommLane, *, process_group,
                 rank: int, world: int, options: ScheduleOptions, reduce_scatter: bool = False, norm_group=None,
                 loss_scale: Optional[Callable[[], float]] = None, report: Optional[Callable[[], RoundReport]] = None,
                 on_commit: Optional[Callable[[RoundResult], None]] = None,
                 before_launch: Optional[Callable[[], None]] = None, after_launch: Optional[Callable[[RoundKind], None]] = None):
        self.groups = list(groups)
        self.lane = lane
        self.rank, self.world = rank, world
        self.options, self.mode, self.phases = options, options.mode, options.phases
        if isinstance(self.phases, SharedPhases):
            self.phases = self.phases.for_rank(rank, world)  # equal shares (fixed mode's) until rates are known
        self._closed = False
        # The parts (see the module docstring): each reads the schedule only through its public names.
        self.drain_agreement = DrainAgreement(self)
        self.committed = CommittedWeights(self.groups, self, shard_optimizer,
                                          gather=self.gather_on_lane if options.mode == "one_round" else None)
        self.checkpoint = ScheduleState(self)
        self.clock = ComputeClock()
        self.context = options.round_context(self.groups, shard_optimizer, process_group=process_group,
                                             norm_group=norm_group, rank=rank, world=world,
                                             reduce_scatter=reduce_scatter,
                                             read_counts_first=self.agrees_drains)  # set again at each launch
        self.sync_phases = options.sync_phases()  # a step of the synchronous warm-up is stock's: A micro-batches
        self.auto = AutoChoice(self, options.auto) if options.auto is not None else None  # mode 'auto'
        self.report = report
        self.on_commit = on_commit
        self.before_launch = before_launch
        self.after_launch = after_launch
        self.loss_scale = loss_scale
        self.position = Position(self.opening_phase(0), accumulated_loss_scale=self.current_loss_scale())
        self.history: Deque[PhaseRecord] = collections.deque(maxlen=options.history)
        self.recent_rounds: Deque[RoundResult] = collections.deque(maxlen=8)
        self.round_observers: List[Callable[[RoundResult], None]] = []  # called as each round is collected
        for g in self.groups:
            g.zero_grads()

    # -- the position (:class:`.position.Position`), read-only: only the schedule replaces it ---------
    phase = position_field("phase", "The phase in progress.")
    step_index = position_field("step_index", "t: the optimizer step whose data the compute lane is producing.")
    committed_steps = position_field("committed_steps", "Commits booked (waited for).")
    phase_tally = position_field("phase_tally", "The micro-batches of the phase in progress.")
    buffer_tally = position_field("buffer_tally", "What G holds since it was last cleared.")
    micro_batches = position_field("micro_batches", "All micro-batches ever recorded.")
    accumulated_loss_scale = position_field("accumulated_loss_scale", "The loss scale G's contents carry.")
    last_commit_grad_norm = position_field("last_commit_grad_norm", "The newest collected commit's gradient norm.")
    inflight = position_field("inflight", "The round launched and not yet swapped in (finished or not), if any.")

    def _move(self, **changes) -> None:
        self.position = self.position.moved(**changes)

    # -- the compute lane's calls ---------------------------------------------------------
    def forecast_phase_end(self) -> bool:
        """Whether the phase would end with the micro-batch now being computed, were it decided
        now (a query: a later decision in dynamic mode may see more rounds done). Once
        :meth:`decide_phase_end` has run for this micro-batch, its answer."""
        decision = self.position.decision
        if decision is not None and decision[0] == self.micro_batches:
            return decision[1] is not None
        return self._why_phase_ends() is not None

    def decide_phase_end(self) -> bool:
        """Decide, once per micro-batch, whether the phase ends with it (later calls agree)."""
        decision = self.position.decision
        if decision is None or decision[0] != self.micro_batches:
            self.committed.release()  # a micro-batch runs on the live weights
            self.drain_agreement.check_pair_up()
            why = self.drain_agreement.keep_phase_open(self._why_phase_ends())
            self._move(decision=(self.micro_batches, why))
        return self.position.decision[1] is not None

    def _why_phase_ends(self) -> Optional[str]:
        inflight = self.inflight
        if self.agrees_drains and self.drain_agreement.peer_draining():
            return None
        done = (lambda: True) if inflight is None else inflight.handle.done
        policy = self.sync_phases if self.phase is PhaseKind.SYNC else self.phases
        return policy.ends(self.phase_tally.micro_batches + 1, done)

    def before_backward(self) -> None:
        """Before each backward pass: a loss scale set from outside (e.g. ``override_loss_scale``)
        is applied to G before gradients at the new scale land."""
        self.committed.release()
        self.sync_accumulated_loss_scale()

    def record_micro_batch(self, weight: float = 1.0) -> None:
        """Note one finished backward pass whose gradient now sits in G."""
        one, p = Tally(1, float(weight)), self.position
        self._move(phase_tally=p.phase_tally.add(one), buffer_tally=p.buffer_tally.add(one),
                   micro_batches=p.micro_batches + 1)

    def end_phase(self, exchanged: Optional[tuple] = None, reason: Optional[str] = None) -> None:
        """Phase boundary: collect the round in flight, swap, launch the next round (with
        ``exchanged``: join a round whose counts table a drain probe already exchanged)."""
        with record_function("ACCO::phase_end"):
            self.committed.release()  # the swap below moves the live weights the compute lane ran on
            self.clock.end_phase(self.phase_tally.micro_batches)
            ended, wait_s, collected, step = self.phase, 0.0, self.inflight, self.step_index
            decision = self.position.decision
            if reason is None and decision and decision[0] == self.micro_batches - 1:
                reason = decision[1]
            row = TRANSITIONS[(self.mode, ended)]
            if row.collect and not row.sync:
                wait_s = self._collect_into_live(row.advance_step)  # model ← θ̃_{t+1} (estimate) or θ_{t+1}
            self._launch(row.launch, clear_grads=row.clear_grads, exchanged=exchanged, sync=row.sync,
                         first_half_weight=collected.result.total.weight if row.first_half_weight else None)
            if row.sync:  # stock's step: waited for here, model ← θ_{t+1} before the next micro-batch
                wait_s = self._collect_into_live(row.advance_step)
            if row.sync and self.auto is not None:
                self.auto.after_stock_step(self.clock.phase_compute_s, self.recent_rounds[-1])  # may adopt a mode
            nxt = self.opening_phase(self.step_index) if row.next_phase is None else row.next_phase
            if row.sync and nxt is PhaseKind.BOOTSTRAP and self.context.predictor is not None:
                self.context.predictor.start()  # one_round after stock steps: P = θ_K, as a run from θ_K
            self._move(phase=nxt)
            data_step = 0 if row.data_step is None else step + row.data_step
            self.history.append(PhaseRecord(ended, data_step, self.phase_tally, wait_s, time.perf_counter(),
                                            reason or "forced"))
            self._move(phase_tally=Tally())
            if isinstance(self.phases, SharedPhases) and collected is not None and collected.result.peer_report:
                self.phases = self.phases.reshare([p.compute_s_per_micro_batch for p in collected.result.peer_report])
            self.clock.start_phase()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abandon` ended this schedule (its lane is gone)."""
        return self._closed

    @property
    def round_in_flight(self) -> Optional[RoundKind]:
        """The kind of :attr:`inflight`, if any."""
        return None if self.inflight is None else self.inflight.kind

    def close(self) -> None:
        """Drain, leave the committed θ in the live weights for good (nothing trains after a
        close, and whatever reads the model next, an export, gets θ) and stop the lane (once:
        later calls do nothing)."""
        if self._closed:
            return
        try:
            self.drain()
            self.committed.hold(final=True)
        finally:
            self._closed = True
            self.lane.close()

    def abandon(self) -> None:
        """Forget the round in flight without waiting for it (see ``AccoDriver.abandon``); later
        drains and closes do nothing."""
        self._closed = True
        self._move(inflight=None)

    # -- the parts' delegates: the public API the driver, the adapters and the tests call ------
    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight, agreed across ranks in dynamic mode (:meth:`.drains.DrainAgreement.drain`)."""
        return self.drain_agreement.drain()

    @property
    def agrees_drains(self) -> bool:
        """Whether drains run the agreement protocol (:attr:`.drains.DrainAgreement.agrees`)."""
        return self.drain_agreement.agrees

    def committed_weights(self) -> ContextManager[None]:
        """A block with θ in the live weights (:meth:`.committed.CommittedWeights.committed_weights`)."""
        return self.committed.committed_weights()

    def hold_committed_weights(self, agreed: bool = False, settle_shards: bool = False) -> None:
        """θ in the live weights until the next micro-batch (:meth:`.committed.CommittedWeights.hold`)."""
        self.committed.hold(agreed=agreed, settle_shards=settle_shards)

    def release_committed_weights(self, settle: bool = False) -> None:
        """Undo a hold (:meth:`.committed.CommittedWeights.release`)."""
        self.committed.release(settle)

    @property
    def holds_committed_weights(self) -> bool:
        """Whether a hold left θ in the live weights (:attr:`.committed.CommittedWeights.holds`)."""
        return self.committed.holds

    def state_dict(self) -> dict:
        """Everything in flight, for an exact resume (:meth:`.state.ScheduleState.state_dict`)."""
        return self.checkpoint.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (:meth:`.state.ScheduleState.load_state_dict`)."""
        self.checkpoint.load_state_dict(state)

    def reset(self, committed_steps: int) -> None:
        """Start over at the current weights (:meth:`.state.ScheduleState.reset`)."""
        self.checkpoint.reset(committed_steps)

    @property
    def seconds_per_micro_batch(self) -> float:
        """This rank's compute speed over the last measured phase (:class:`.compute_clock.ComputeClock`)."""
        return self.clock.seconds_per_micro_batch

    # -- what the parts use: public, so that no part reads the schedule's private state -----
    def off_the_clock(self) -> ContextManager[None]:
        """Time inside is not micro-batch compute (:meth:`.compute_clock.ComputeClock.off_the_clock`)."""
        return self.clock.off_the_clock()

    def restore(self, position: Position, phases=None) -> None:
        """A load or reset: the schedule stands at ``position`` (its round in flight a restored,
        finished round, or None) and, given, runs ``phases`` from here; the phase in progress began
        before: no phase-end decision was taken for it, it is not measured, and a drift measured
        before belongs to no step after it."""
        self.position = position.moved(decision=None)
        self.phases = self.phases if phases is None else phases
        self.context.pending_drift = None
        self.clock.skip_phase()

    def gather_on_lane(self, flat) -> None:
        """All-gather each rank's segment of a rank-major flat tensor in place, on the idle lane: a collective."""
        ctx, why = self.context, "all-gather (every rank at once: a load, or one_round's committed_weights() block)"
        self.lane.wait(self.lane.submit(why, lambda: collectives.gather_in_place(
            flat, ctx.rank, ctx.world, ctx.process_group, ctx.chunk_elems)))

    def opening_phase(self, committed_steps: int) -> PhaseKind:
        """The phase a run starts in after ``committed_steps`` optimizer steps: a step of the
        synchronous warm-up while fewer than ``sync_warmup_steps`` are done or mode 'auto' runs stock (or has
        not decided yet), else ACCO's bootstrap."""
        stock = committed_steps < self.options.sync_warmup_steps or (self.auto is not None and self.auto.runs_stock)
        return PhaseKind.SYNC if stock else PhaseKind.BOOTSTRAP

    def adopt(self, options: ScheduleOptions) -> None:
        """Run ``options``' mode from the next phase on (mode 'auto', after a stock step: nothing in flight)."""
        ctx = self.context
        self.options, self.mode, self.phases = options, options.mode, options.phases
        self.committed.gather = self.gather_on_lane if options.mode == "one_round" else None
        self.context = options.round_context(self.groups, ctx.shard_optimizer, process_group=ctx.process_group,
                                             norm_group=ctx.norm_group, rank=self.rank, world=self.world,
                                             reduce_scatter=ctx.reduce_scatter, read_counts_first=self.agrees_drains)

    def current_loss_scale(self) -> float:
        """The loss scale backward passes use now (1 without fp16 loss scaling)."""
        scale = None if self.loss_scale is None else self.loss_scale()
        scale = 1.0 if scale is None else float(scale)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scale {scale!r}: must be a finite number > 0")
        return scale

    def sync_accumulated_loss_scale(self) -> None:
        """After a loss-scale change: G ← G · new/old, so it carries the scale the next backward
        passes will use (compute lane; the round in flight reads B, not G). G is rescaled even
        when no micro-batch has been recorded yet: a backward may have run before its step()."""
        new = self.current_loss_scale()
        if new != self.accumulated_loss_scale:
            for g in self.groups:
                g.scale_grads(new / self.accumulated_loss_scale)
            self._move(accumulated_loss_scale=new)

    def round_report(self, drain: int = 0) -> RoundReport:
        """What this rank sends with a round or a probe: the caller's report, with the drain it is
        in (``drain``, 0 outside one), its micro-batch count then and its measured speed."""
        report = self.report() if self.report is not None else RoundReport()
        return dataclasses.replace(report, drain=drain, drain_at=self.micro_batches if drain else 0,
                                   compute_s_per_micro_batch=self.seconds_per_micro_batch)

    def _launch(self, kind: RoundKind, clear_grads: bool, exchanged: Optional[tuple] = None, sync: bool = False,
                first_half_weight: Optional[float] = None) -> None:
        """Pack G into B and submit the round. ``sync``: a step of the synchronous warm-up;
        ``first_half_weight``: a commit's first-half weight, all ranks (the estimate round's)."""
        self.sync_accumulated_loss_scale()  # a scale set after the last backward: G follows it into B
        scale = self.accumulated_loss_scale
        for g in self.groups:
            g.pack_grads(kind, clear_grads)
        tally = self.buffer_tally
        if clear_grads:
            self._move(buffer_tally=Tally())
        step = self.step_index
        report = self.round_report() if exchanged is None else None
        ctx = self.context
        # Only where drains run the agreement protocol can a peer fill this round's slot with a drain
        # abort (drains.py); shared phases leave fixed mode's path at a phase end. The lane is idle
        # here (the previous round was collected), so no round reads the field while it changes.
        ctx.read_counts_first = self.agrees_drains
        if self.before_launch is not None:
            self.before_launch()
        # The round's step uses the settings of now: a scheduler stepped meanwhile on this thread
        # (the caller's, as Accelerate and HF Trainer do) must not change them (ACCO.md: both
        # rounds of step t use step t's learning rate).
        settings = ctx.shard_optimizer.settings()
        handle = self.lane.submit(f"{kind.value} {step}",
                                  lambda: run_round(ctx, kind, step, tally, report, scale, exchanged, settings,
                                                    sync=sync, first_half_weight=first_half_weight),
                                  keep=settings)  # a tensor setting (cloned here) lives until the round is waited for
        self._move(inflight=InFlight(handle, kind, step))
        if self.after_launch is not None:
            self.after_launch(kind)

    def wait_for(self, inflight: InFlight) -> RoundResult:
        """Wait for ``inflight`` (off the clock) and note its result once; a commit is booked once
        (``committed_steps``, ``on_commit``, the loss scale it may change)."""
        if inflight.result is None:
            t0 = time.perf_counter()
            with self.off_the_clock():
                result = self.lane.wait(inflight.handle)
            inflight.note_wait(result, time.perf_counter() - t0)
            result = inflight.result
            result.wait_s = inflight.wait_s
            # The lane's clock covers the whole round as it ran on the lane.
            result.started_at = inflight.handle.started_at or result.started_at
            result.finished_at = inflight.handle.finished_at or result.finished_at
            result.collected_at = time.perf_counter()
            self.recent_rounds.append(result)
            for observe in self.round_observers:
                observe(result)
        if inflight.book_commit():
            self._move(committed_steps=self.committed_steps + 1, last_commit_grad_norm=inflight.result.grad_norm)
            if self.on_commit is not None:
                self.on_commit(inflight.result)  # may update the loss scaler
            self.sync_accumulated_loss_scale()
        return inflight.result

    def _collect_into_live(self, advance_step: bool) -> float:
        """Wait for the round in flight, its weights into the live ones, the step moved on if
        ``advance_step``; the seconds this phase end waited for it."""
        inflight = self.inflight
        waited_before = inflight.wait_s if inflight.wait_mark is None else inflight.wait_mark
        self.wait_for(inflight)
        self.committed.unpack(inflight)
        self._move(inflight=None, step_index=self.step_index + advance_step)
        return inflight.wait_s - waited_before
