"""The ACCO / DPU schedule of ACCO.md as a state machine over buffer groups. No DeepSpeed or FSDP.

Phases and rounds (mode 'acco'):
  bootstrap -- compute at θ_0 into G ---------------------------------------> B ← G, round E_0
  phase E_t -- compute g_t at θ_t into G (G still holds Σg̃_t) ---- round E_t: θ̃_{t+1}, discarded S
  swap      -- model ← θ̃_{t+1}; B ← G (full batch); G ← 0; round C_t
  phase C_t -- compute g̃_{t+1} at θ̃_{t+1} into G ------------------ round C_t: θ_{t+1}, S_{t+1} kept
  swap      -- model ← θ_{t+1}; commit callback (LR scheduler); B ← G (Σg̃_{t+1}); round E_{t+1}
Mode 'dpu' has only commit rounds: at each phase end, model ← θ_k, B ← G, G ← 0, round k.

The synchronous warm-up (``acco.sync_warmup_steps`` = K, mode 'acco', fixed accumulation) first runs
stock's schedule with ACCO's buffers: K phases of kind SYNC, each A micro-batches at θ_t into G, then
B ← G, G ← 0, one commit round waited for at once, model ← θ_{t+1} before the next micro-batch (no
overlap: the weights are stock ZeRO-1's). ACCO then bootstraps from θ_K (θ̃_K = θ_K).

G and B are the buffer groups' ``grads`` and ``comm`` (see :mod:`.buffers`); a round is
:func:`.rounds.run_round` on the lane. Dynamic mode's drains agree across ranks: :mod:`.drains`;
the in-flight state of checkpoints: :mod:`.schedule_state`; θ put into the live weights (evaluation,
exports): :mod:`.committed`.

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

import collections
import contextlib
import dataclasses
import math
import time
from typing import Callable, Deque, List, Optional, Sequence

from torch.profiler import record_function

from ..comm.lane import CommLane
from . import chunking
from .buffers import BufferGroup
from .committed import CommittedWeights
from .delay_compensation import DelayCompensation
from .drains import DrainAgreement
from .options import ScheduleOptions
from .phases import FixedPhases, PhaseKind, PhaseRecord, SharedPhases, Tally
from .report import RoundReport
from .rounds import RoundContext, RoundKind, RoundResult, run_round
from .schedule_state import ScheduleState, _InFlight


class AccoSchedule(CommittedWeights, DrainAgreement, ScheduleState):
    """Owns the phases, the rounds and the swaps for a set of buffer groups.

    Args:
        groups: the buffer groups (G, B, live weights, shards).
        shard_optimizer: steps the shards (estimate or commit).
        lane: where rounds run.
        process_group, rank, world: the rounds' dedicated group and this rank's place in it.
        norm_group: tensor parallelism: a dedicated model-parallel group the norm is also summed over.
        options: see :class:`ScheduleOptions`.
        reduce_scatter: reduce with a reduce-scatter (NCCL) rather than all-reduce + slice (gloo).
        loss_scale: returns the loss scale backward passes use now (fp16; None, or it returns None: 1). G always
            carries the current scale: when it changes (the caller updates its scaler in
            ``on_commit``), G is rescaled by the ratio, so a round never mixes scales; each round
            divides by the scale G carried when it was packed.
        report: called on the compute lane at each launch; a :class:`.report.RoundReport` that
            travels with the round's counts to every rank (``RoundResult.peer_report``); the
            schedule fills its drain fields.
        on_commit: called on the compute lane once per committed step, after θ_{t+1} is known and
            before the next round is launched.
        before_launch: called on the compute lane before each round captures the optimizer's
            settings (a learning-rate scheduler step still owed is taken there).
        after_launch: called on the compute lane with the kind of each round just launched.
    """

    def __init__(self, groups: Sequence[BufferGroup], shard_optimizer, lane: CommLane, *, process_group,
                 rank: int, world: int, options: ScheduleOptions, reduce_scatter: bool = False, norm_group=None,
                 loss_scale: Optional[Callable[[], float]] = None,
                 report: Optional[Callable[[], RoundReport]] = None,
                 on_commit: Optional[Callable[[RoundResult], None]] = None,
                 before_launch: Optional[Callable[[], None]] = None,
                 after_launch: Optional[Callable[[RoundKind], None]] = None):
        self.groups = list(groups)
        self.lane = lane
        self.rank, self.world = rank, world
        self.options = options
        self.mode = options.mode
        self.phases = options.phases
        if isinstance(self.phases, SharedPhases):
            self.phases = self.phases.for_rank(rank, world)  # equal shares (fixed mode's) until rates are known
        self.context = RoundContext(
            groups=self.groups, shard_optimizer=shard_optimizer, process_group=process_group, norm_group=norm_group,
            rank=rank, world=world, gas_scale=options.gas_scale, clip_grad=options.clip_grad, nonfinite=options.nonfinite,
            reduce_scatter=reduce_scatter, track_drift=options.track_drift and options.mode == "acco",
            chunk_elems=options.chunk_elems, lr_power=options.lr_power,
            nominal_phase_micro_batches=options.nominal_phase * world,
            commit_phases=2 if options.mode == "acco" else 1,
            read_counts_first=self.agrees_drains,  # set again at each launch (_launch)
            estimate_lr_scale=options.estimate_lr_scale, committed_second_moment=options.committed_second_moment,
            delay=DelayCompensation(self.groups, options.delay_compensation) if options.delay_compensation else None)
        # A step of the synchronous warm-up is stock's: the A micro-batches of two ACCO phases.
        self.sync_phases = (FixedPhases(2 * self.phases.micro_batches) if isinstance(self.phases, FixedPhases)
                            and self.mode == "acco" else None)
        # The rounds' window: the user's, or chosen for the device and the shard (chunking.py).
        device = self.groups[0].comm.device
        self.context.chunk_elems = chunking.chunk_elements(device, sum(g.segment for g in self.groups),
                                                           options.chunk_elems, chunking.free_memory(device))
        shard_optimizer.chunk_elems = self.context.chunk_elems
        self.report = report
        self.on_commit = on_commit
        self.before_launch = before_launch
        self.after_launch = after_launch
        self.loss_scale = loss_scale
        self.accumulated_loss_scale = self._current_loss_scale()  # the scale G's contents carry
        self.phase = self._opening_phase(0)
        self.step_index = 0  # t: the optimizer step whose data the compute lane is producing
        self.committed_steps = 0
        self.phase_tally = Tally()  # the current phase
        self.buffer_tally = Tally()  # what G holds since it was last cleared
        self.micro_batches = 0  # all micro-batches ever recorded
        self.history: Deque[PhaseRecord] = collections.deque(maxlen=options.history)
        self.recent_rounds: Deque[RoundResult] = collections.deque(maxlen=8)
        self.round_observers: List[Callable[[RoundResult], None]] = []  # called as each round is collected
        self._decision: Optional[tuple] = None  # (micro-batch index, why the phase ends or None)
        self._inflight: Optional[_InFlight] = None
        self._init_committed_weights()
        self._closed = False
        self.last_commit_grad_norm: Optional[float] = None  # the newest collected commit's (checkpointed)
        self.drains = 0  # drain() calls so far (dynamic mode: the j-th drain of every rank agrees, see above)
        # This rank's speed, sent with each round (accumulation 'shared' splits phases by it):
        self.seconds_per_micro_batch = math.nan  # over the last measured phase
        self._phase_clock: Optional[tuple] = None  # (phase start, off-clock seconds then); None: not measured
        self._off_clock_s = 0.0  # seconds blocked on rounds and drains, ever
        self._off_clock_depth = 0
        for g in self.groups:
            g.zero_grads()

    # -- the compute lane's calls ---------------------------------------------------------
    def forecast_phase_end(self) -> bool:
        """Whether the phase would end with the micro-batch now being computed, were it decided
        now (a query: a later decision in dynamic mode may see more rounds done). Once
        :meth:`decide_phase_end` has run for this micro-batch, its answer."""
        if self._decision is not None and self._decision[0] == self.micro_batches:
            return self._decision[1] is not None
        return self._why_phase_ends() is not None

    def decide_phase_end(self) -> bool:
        """Decide, once per micro-batch, whether the phase ends with it (later calls agree)."""
        if self._decision is None or self._decision[0] != self.micro_batches:
            self.release_committed_weights()  # a micro-batch runs on the live weights
            self._check_drains_pair_up()
            why = self._why_phase_ends()
            inflight = self._inflight
            if why is not None and self.agrees_drains and inflight is not None:
                # The phase end collects the round anyway: collect it now and keep the phase going
                # if a peer is draining at it (module docstring, step 3).
                inflight.wait_mark = inflight.wait_s
                self._wait(inflight)
                if self._peer_draining():
                    self._check_drains_pair_up()
                    why, inflight.wait_mark = None, None
            self._decision = (self.micro_batches, why)
        return self._decision[1] is not None

    def _why_phase_ends(self) -> Optional[str]:
        inflight = self._inflight
        if self.agrees_drains and self._peer_draining():
            return None
        done = (lambda: True) if inflight is None else inflight.handle.done
        policy = self.sync_phases if self.phase is PhaseKind.SYNC else self.phases
        return policy.ends(self.phase_tally.micro_batches + 1, done)

    def before_backward(self) -> None:
        """Before each backward pass: a loss scale set from outside (e.g. ``override_loss_scale``)
        is applied to G before gradients at the new scale land."""
        self.release_committed_weights()
        self._sync_accumulated_loss_scale()

    def record_micro_batch(self, weight: float = 1.0) -> None:
        """Note one finished backward pass whose gradient now sits in G."""
        one = Tally(1, float(weight))
        self.phase_tally = self.phase_tally.add(one)
        self.buffer_tally = self.buffer_tally.add(one)
        self.micro_batches += 1

    def end_phase(self, exchanged: Optional[tuple] = None, reason: Optional[str] = None) -> None:
        """Phase boundary: collect the round in flight, swap, launch the next round (with
        ``exchanged``: join a round whose counts table a drain probe already exchanged)."""
        with record_function("ACCO::phase_end"):
            self.release_committed_weights()  # the swap below moves the live weights the compute lane ran on
            self._measure_phase()
            ended, wait_s, collected = self.phase, 0.0, self._inflight
            if reason is None and self._decision and self._decision[0] == self.micro_batches - 1:
                reason = self._decision[1]
            step = self.step_index
            if self.mode == "dpu":
                if self.phase is not PhaseKind.BOOTSTRAP:
                    wait_s = self._collect_into_live()  # model ← θ_k
                    self.step_index += 1
                self._launch(RoundKind.COMMIT, clear_grads=True, exchanged=exchanged)
                self.phase = PhaseKind.COMMIT
            elif self.phase is PhaseKind.SYNC:  # stock's step: waited for here, nothing overlaps
                self._launch(RoundKind.COMMIT, clear_grads=True, exchanged=exchanged, sync=True)
                wait_s = self._collect_into_live()  # model ← θ_{t+1} before the next micro-batch
                self.step_index += 1
                self.phase = self._opening_phase(self.step_index)
            elif self.phase is PhaseKind.BOOTSTRAP:
                self._launch(RoundKind.ESTIMATE, clear_grads=False, exchanged=exchanged)
                self.phase = PhaseKind.ESTIMATE
            elif self.phase is PhaseKind.ESTIMATE:
                estimate = self._inflight
                wait_s = self._collect_into_live()  # model ← θ̃_{t+1}
                self._launch(RoundKind.COMMIT, clear_grads=True, exchanged=exchanged,  # the full batch of step t
                             first_half_weight=estimate.result.total.weight)
                self.phase = PhaseKind.COMMIT
            else:
                wait_s = self._collect_into_live()  # model ← θ_{t+1}
                self.step_index += 1
                self._launch(RoundKind.ESTIMATE, clear_grads=False, exchanged=exchanged)  # Σg̃_{t+1}, kept in G
                self.phase = PhaseKind.ESTIMATE
            data_step = step + 1 if ended is PhaseKind.COMMIT else (
                step if ended in (PhaseKind.ESTIMATE, PhaseKind.SYNC) else 0)
            self.history.append(PhaseRecord(ended, data_step, self.phase_tally, wait_s, time.perf_counter(),
                                            reason or "forced"))
            self.phase_tally = Tally()
            if isinstance(self.phases, SharedPhases) and collected is not None and collected.result.peer_report:
                self.phases = self.phases.reshare([p.compute_s_per_micro_batch for p in collected.result.peer_report])
            self._phase_clock = (time.perf_counter(), self._off_clock_s)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abandon` ended this schedule (its lane is gone)."""
        return self._closed

    @property
    def round_in_flight(self) -> Optional[RoundKind]:
        """The kind of the round launched and not yet swapped in (finished or not), if any."""
        return None if self._inflight is None else self._inflight.kind

    def close(self) -> None:
        """Drain, leave the committed θ in the live weights for good (nothing trains after a
        close, and whatever reads the model next, an export, gets θ) and stop the lane (once:
        later calls do nothing)."""
        if self._closed:
            return
        try:
            self.drain()
            self.hold_committed_weights()
        finally:
            self._closed = True
            self.lane.close()

    def abandon(self) -> None:
        """Forget the round in flight without waiting for it (see ``AccoDriver.abandon``); later
        drains and closes do nothing."""
        self._closed = True
        self._inflight = None

    # -- internals ------------------------------------------------------------------------
    def _opening_phase(self, committed_steps: int) -> PhaseKind:
        """The phase a run starts in after ``committed_steps`` optimizer steps: a step of the
        synchronous warm-up while fewer than ``sync_warmup_steps`` are done, else ACCO's bootstrap."""
        return PhaseKind.SYNC if committed_steps < self.options.sync_warmup_steps else PhaseKind.BOOTSTRAP

    def _current_loss_scale(self) -> float:
        scale = None if self.loss_scale is None else self.loss_scale()
        scale = 1.0 if scale is None else float(scale)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scale {scale!r}: must be a finite number > 0")
        return scale

    def _sync_accumulated_loss_scale(self) -> None:
        """After a loss-scale change: G ← G · new/old, so it carries the scale the next backward
        passes will use (compute lane; the round in flight reads B, not G). G is rescaled even
        when no micro-batch has been recorded yet: a backward may have run before its step()."""
        new = self._current_loss_scale()
        if new != self.accumulated_loss_scale:
            for g in self.groups:
                g.scale_grads(new / self.accumulated_loss_scale)
            self.accumulated_loss_scale = new

    def _report(self, drain: int = 0) -> RoundReport:
        """What this rank sends with a round or a probe: the caller's report, with the drain it is
        in (``drain``, 0 outside one), its micro-batch count then and its measured speed."""
        report = self.report() if self.report is not None else RoundReport()
        return dataclasses.replace(report, drain=drain, drain_at=self.micro_batches if drain else 0,
                                   compute_s_per_micro_batch=self.seconds_per_micro_batch)

    @contextlib.contextmanager
    def _off_the_clock(self):
        """Time inside is not this rank's micro-batch compute (a wait for a round, a drain, an
        evaluation): it is left out of :attr:`seconds_per_micro_batch`. Nests."""
        self._off_clock_depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._off_clock_depth -= 1
            if self._off_clock_depth == 0:
                self._off_clock_s += time.perf_counter() - t0

    def _measure_phase(self) -> None:
        """At a phase end: this rank's compute seconds per micro-batch over the phase (host clock,
        no device sync: it counts what the host waited for, e.g. a backward's kernels where the
        caller reads the loss)."""
        clock, n = self._phase_clock, self.phase_tally.micro_batches
        if clock is not None and n > 0:
            started, off = clock
            self.seconds_per_micro_batch = (time.perf_counter() - started - (self._off_clock_s - off)) / n

    def _launch(self, kind: RoundKind, clear_grads: bool, exchanged: Optional[tuple] = None, sync: bool = False,
                first_half_weight: Optional[float] = None) -> None:
        """Pack G into B and submit the round. ``sync``: a step of the synchronous warm-up;
        ``first_half_weight``: a commit's first-half weight, all ranks (the estimate round's)."""
        self._sync_accumulated_loss_scale()  # a scale set after the last backward: G follows it into B
        scale = self.accumulated_loss_scale
        for g in self.groups:
            g.pack_grads(kind, clear_grads)
        tally = self.buffer_tally
        if clear_grads:
            self.buffer_tally = Tally()
        step = self.step_index
        report = self._report() if exchanged is None else None
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
        self._inflight = _InFlight(handle, kind, step)
        if self.after_launch is not None:
            self.after_launch(kind)

    def _wait(self, inflight: _InFlight) -> RoundResult:
        if inflight.result is None:
            t0 = time.perf_counter()
            with self._off_the_clock():
                inflight.result = self.lane.wait(inflight.handle)
            inflight.wait_s += time.perf_counter() - t0
            result = inflight.result
            result.wait_s = inflight.wait_s
            # The lane's clock covers the whole round as it ran on the lane.
            result.started_at = inflight.handle.started_at or result.started_at
            result.finished_at = inflight.handle.finished_at or result.finished_at
            result.collected_at = time.perf_counter()
            self.recent_rounds.append(result)
            for observe in self.round_observers:
                observe(result)
        if inflight.kind is RoundKind.COMMIT and not inflight.committed:
            inflight.committed = True
            self.committed_steps += 1
            self.last_commit_grad_norm = inflight.result.grad_norm
            if self.on_commit is not None:
                self.on_commit(inflight.result)  # may update the loss scaler
            self._sync_accumulated_loss_scale()
        return inflight.result

    def _collect_into_live(self) -> float:
        inflight = self._inflight
        waited_before = inflight.wait_s if inflight.wait_mark is None else inflight.wait_mark
        self._wait(inflight)
        for g in self.groups:
            g.unpack_into_live()
        self._inflight = None
        return inflight.wait_s - waited_before
