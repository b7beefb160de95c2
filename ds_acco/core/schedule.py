"""The ACCO / DPU schedule of ACCO.md as a state machine over buffer groups. No DeepSpeed or FSDP.

Phases and rounds (mode 'acco'):
  bootstrap -- compute at θ_0 into G ---------------------------------------> B ← G, round E_0
  phase E_t -- compute g_t at θ_t into G (G still holds Σg̃_t) ---- round E_t: θ̃_{t+1}, discarded S
  swap      -- model ← θ̃_{t+1}; B ← G (full batch); G ← 0; round C_t
  phase C_t -- compute g̃_{t+1} at θ̃_{t+1} into G ------------------ round C_t: θ_{t+1}, S_{t+1} kept
  swap      -- model ← θ_{t+1}; commit callback (LR scheduler); B ← G (Σg̃_{t+1}); round E_{t+1}
Mode 'dpu' has only commit rounds: at each phase end, model ← θ_k, B ← G, G ← 0, round k.

G and B are the buffer groups' ``grads`` and ``comm`` (see :mod:`.buffers`); a round is
:func:`.rounds.run_round` on the lane.

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
no probe: it is unchanged.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Sequence

from torch.profiler import record_function

from ..comm import collectives
from ..comm.lane import CommLane, RoundHandle
from . import chunking
from .buffers import BufferGroup
from .phases import FixedPhases, PhaseKind, PhaseRecord, Tally
from .report import DRAIN_ABORT, RoundReport
from .rounds import (DrainMismatchError, RoundContext, RoundKind, RoundResult, check_no_drain_abort, exchange_tallies,
                     run_round)


@dataclass(frozen=True)
class ScheduleOptions:
    """How the schedule runs; built from the ``"acco"`` config by :meth:`from_config`."""
    mode: str  # 'acco' or 'dpu'
    phases: object  # FixedPhases or DynamicPhases: when a phase ends
    gas_scale: float = 1.0  # the factor each micro-batch gradient carries in G (DeepSpeed's 1/A)
    clip_grad: float = 0.0  # clip each round's global mean gradient to this norm (0: off)
    nonfinite: str = "skip"  # 'skip' or 'raise' on a non-finite global mean gradient
    track_drift: bool = False  # measure the estimate drift in commit rounds (mode acco)
    chunk_elems: Optional[int] = None  # a round's window (elements); None: per device (chunking.py)
    history: int = 4096  # phases kept for metrics
    lr_power: float = 0.0  # a round's LR × (its global micro-batches / the fixed-mode count) ** lr_power
    nominal_phase: int = 0  # micro-batches per rank of a fixed-mode phase (the count lr_power compares to)

    def __post_init__(self):
        if self.mode not in ("acco", "dpu"):
            raise ValueError(f"mode must be 'acco' or 'dpu', got {self.mode!r}")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.lr_power and self.nominal_phase < 1:
            raise ValueError(f"lr_power {self.lr_power} needs the fixed-mode phase length (nominal_phase >= 1), "
                             f"got {self.nominal_phase}")

    @classmethod
    def from_config(cls, acco, gradient_accumulation_steps: int, clip_grad: float = 0.0) -> "ScheduleOptions":
        """From an :class:`~ds_acco.config.AccoConfig` and the framework's accumulation count and clip."""
        return cls(mode=acco.mode, phases=acco.phase_policy(gradient_accumulation_steps),
                   gas_scale=1.0 / gradient_accumulation_steps, clip_grad=float(clip_grad or 0.0),
                   nonfinite=acco.nonfinite, track_drift=acco.metrics.estimate_drift and acco.mode == "acco",
                   chunk_elems=None if acco.chunk_elements == "auto" else acco.chunk_elements,
                   lr_power=(acco.dynamic_bounds(gradient_accumulation_steps).lr_power
                             if acco.accumulation == "dynamic" else 0.0),
                   nominal_phase=acco.phase_length(gradient_accumulation_steps))


@dataclass
class _InFlight:
    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)
    wait_s: float = 0.0  # how long the compute lane blocked on it
    wait_mark: Optional[float] = None  # wait_s before a phase-end decision waited for it (dynamic mode)


class AccoSchedule:
    """Owns the phases, the rounds and the swaps for a set of buffer groups.

    Args:
        groups: the buffer groups (G, B, live weights, shards).
        shard_optimizer: steps the shards (estimate or commit).
        lane: where rounds run.
        process_group, rank, world: the rounds' dedicated group and this rank's place in it.
        options: see :class:`ScheduleOptions`.
        reduce_scatter: reduce with a reduce-scatter (NCCL) rather than all-reduce + slice (gloo).
        loss_scale: returns the loss scale backward passes use now (fp16; None: 1). G always
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

    STATE_VERSION = 3  # 3: live weights and B's parameters saved as this rank's shard

    def __init__(self, groups: Sequence[BufferGroup], shard_optimizer, lane: CommLane, *, process_group,
                 rank: int, world: int, options: ScheduleOptions, reduce_scatter: bool = False,
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
        self.context = RoundContext(
            groups=self.groups, shard_optimizer=shard_optimizer, process_group=process_group, rank=rank, world=world,
            gas_scale=options.gas_scale, clip_grad=options.clip_grad, nonfinite=options.nonfinite,
            reduce_scatter=reduce_scatter, track_drift=options.track_drift and options.mode == "acco",
            chunk_elems=options.chunk_elems, lr_power=options.lr_power,
            nominal_phase_micro_batches=options.nominal_phase * world,
            commit_phases=2 if options.mode == "acco" else 1,
            read_counts_first=not isinstance(options.phases, FixedPhases))
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
        self.phase = PhaseKind.BOOTSTRAP
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
        self._swapped = False  # inside committed_weights: live and gathered exchanged
        self._closed = False
        self.last_commit_grad_norm: Optional[float] = None  # the newest collected commit's (checkpointed)
        self.drains = 0  # drain() calls so far (dynamic mode: the j-th drain of every rank agrees, see above)
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

    @property
    def agrees_drains(self) -> bool:
        """Whether drains run the agreement protocol (any policy but fixed phases)."""
        return not isinstance(self.phases, FixedPhases)

    def _why_phase_ends(self) -> Optional[str]:
        inflight = self._inflight
        if self.agrees_drains and self._peer_draining():
            return None
        done = (lambda: True) if inflight is None else inflight.handle.done
        return self.phases.ends(self.phase_tally.micro_batches + 1, done)

    def _peer_draining(self) -> bool:
        """The collected round in flight carries some rank's flag for this rank's next drain."""
        inflight = self._inflight
        return (inflight is not None and inflight.result is not None
                and _flagged(inflight.result, self.drains + 1))

    def _check_drains_pair_up(self) -> None:
        """Module docstring, step 4: raise on every rank if a peer's drain was missed here."""
        if not (self.agrees_drains and self._peer_draining()):
            return
        flagged = {r: p for r, p in enumerate(self._inflight.result.peer_report) if p.drain == self.drains + 1}
        at = max(p.drain_at for p in flagged.values())
        if self.micro_batches < at:
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

    def before_backward(self) -> None:
        """Before each backward pass: a loss scale set from outside (e.g. ``override_loss_scale``)
        is applied to G before gradients at the new scale land."""
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
            ended, wait_s = self.phase, 0.0
            if reason is None and self._decision and self._decision[0] == self.micro_batches - 1:
                reason = self._decision[1]
            step = self.step_index
            if self.mode == "dpu":
                if self.phase is not PhaseKind.BOOTSTRAP:
                    wait_s = self._collect_into_live()  # model ← θ_k
                    self.step_index += 1
                self._launch(RoundKind.COMMIT, clear_grads=True, exchanged=exchanged)
                self.phase = PhaseKind.COMMIT
            elif self.phase is PhaseKind.BOOTSTRAP:
                self._launch(RoundKind.ESTIMATE, clear_grads=False, exchanged=exchanged)
                self.phase = PhaseKind.ESTIMATE
            elif self.phase is PhaseKind.ESTIMATE:
                wait_s = self._collect_into_live()  # model ← θ̃_{t+1}
                self._launch(RoundKind.COMMIT, clear_grads=True, exchanged=exchanged)  # the full batch of step t
                self.phase = PhaseKind.COMMIT
            else:
                wait_s = self._collect_into_live()  # model ← θ_{t+1}
                self.step_index += 1
                self._launch(RoundKind.ESTIMATE, clear_grads=False, exchanged=exchanged)  # Σg̃_{t+1}, kept in G
                self.phase = PhaseKind.ESTIMATE
            data_step = step + 1 if ended is PhaseKind.COMMIT else (step if ended is PhaseKind.ESTIMATE else 0)
            self.history.append(PhaseRecord(ended, data_step, self.phase_tally, wait_s, time.perf_counter(),
                                            reason or "forced"))
            self.phase_tally = Tally()

    @property
    def round_in_flight(self) -> Optional[RoundKind]:
        """The kind of the round launched and not yet swapped in (finished or not), if any."""
        return None if self._inflight is None else self._inflight.kind

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (if any); a finished commit is booked as committed. In
        dynamic mode every rank's j-th drain finishes the same rounds (module docstring): this
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
            per_rank, reports = self.lane.wait(probe)
            check_no_drain_abort(reports)
            if all(p.drain == drain for p in reports):
                return None if inflight is None else inflight.result  # nobody launched a round there
            self.end_phase(exchanged=(per_rank, reports), reason="drain")
            return self._wait(self._inflight)

    @contextlib.contextmanager
    def committed_weights(self):
        """Inside: the live weights hold the newest committed θ; on exit, the live state is restored.

        A commit round in flight is waited for (its θ is the newest); an estimate round is not:
        the live weights already are the committed θ_t and the round may go on.
        """
        if self.agrees_drains:
            self.drain()  # on every rank, whatever the kind in flight: drains must pair up
        inflight = self._inflight
        swap = inflight is not None and inflight.kind is RoundKind.COMMIT
        if swap:  # B holds θ_{t+1}, live holds θ̃_{t+1} (acco) or θ_t (dpu)
            if not self.agrees_drains:
                self.drain()
            for g in self.groups:
                g.swap_live_and_gathered()
            self._swapped = True
        try:
            yield
        finally:
            if swap:
                for g in self.groups:
                    g.swap_live_and_gathered()
                self._swapped = False

    # -- exact resume ----------------------------------------------------------------------
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
            "groups": [g.export_state(self._swapped) for g in self.groups],
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
        ctx = self.context
        # The shards are all-gathered on the lane (the rounds' group; drained, so it is free):
        # every rank loads at the same point.
        gather = lambda flat: self.lane.wait(self.lane.submit(  # noqa: E731
            "load: all-gather", lambda: collectives.gather_in_place(flat, ctx.rank, ctx.world, ctx.process_group,
                                                ctx.chunk_elems)))
        for g, saved in zip(self.groups, state["groups"]):
            g.import_state(saved, gather)
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
        if info is None:
            self._inflight = None
        else:  # a finished round whose result sits in B
            future: Future = Future()
            future.set_result(result)
            self._inflight = _InFlight(RoundHandle(f"{info['kind']} {info['step']} (restored)", future),
                                       RoundKind(info["kind"]), info["step"], result, info["committed"])

    def reset(self, committed_steps: int) -> None:
        """Forget everything in flight and start a bootstrap phase at the current weights, as after
        ``committed_steps`` optimizer steps (e.g. after loading a stock ZeRO-1 checkpoint)."""
        self.drain()
        self._inflight = None
        self.step_index = self.committed_steps = committed_steps
        self.phase = PhaseKind.BOOTSTRAP
        self.phase_tally = Tally()
        self.buffer_tally = Tally()
        self._decision = None
        self.accumulated_loss_scale = self._current_loss_scale()
        for g in self.groups:
            g.zero_grads()

    def close(self) -> None:
        """Drain and stop the lane (once: later calls do nothing)."""
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            self.lane.close()

    def abandon(self) -> None:
        """Forget the round in flight without waiting for it (see ``AccoDriver.abandon``); later
        drains and closes do nothing."""
        self._closed = True
        self._inflight = None

    # -- internals ------------------------------------------------------------------------
    def _current_loss_scale(self) -> float:
        scale = 1.0 if self.loss_scale is None else float(self.loss_scale())
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
        in (``drain``, 0 outside one) and its micro-batch count then."""
        report = self.report() if self.report is not None else RoundReport()
        return dataclasses.replace(report, drain=drain, drain_at=self.micro_batches if drain else 0)

    def _launch(self, kind: RoundKind, clear_grads: bool, exchanged: Optional[tuple] = None) -> None:
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
        if self.before_launch is not None:
            self.before_launch()
        # The round's step uses the settings of now: a scheduler stepped meanwhile on this thread
        # (the caller's, as Accelerate and HF Trainer do) must not change them (ACCO.md: both
        # rounds of step t use step t's learning rate).
        settings = ctx.shard_optimizer.settings()
        handle = self.lane.submit(f"{kind.value} {step}",
                                  lambda: run_round(ctx, kind, step, tally, report, scale, exchanged, settings),
                                  keep=settings)  # a tensor setting (cloned here) lives until the round is waited for
        self._inflight = _InFlight(handle, kind, step)
        if self.after_launch is not None:
            self.after_launch(kind)

    def _wait(self, inflight: _InFlight) -> RoundResult:
        if inflight.result is None:
            t0 = time.perf_counter()
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


def _flagged(result: RoundResult, drain: int) -> bool:
    """Whether some rank sent ``result``'s round as part of its drain number ``drain``."""
    return any(p.drain == drain for p in result.peer_report or ())
