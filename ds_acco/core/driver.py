"""The one protocol every adapter speaks to the core.

An adapter (DeepSpeed's ZeRO-1 optimizer, FSDP2, ...) translates its framework's tensors into
buffer groups and its calls into this driver's; everything else is here, once:

* construction: the rounds' own process group, the lane (on the rank's device), the phase
  policy, the shard optimizer, metrics, and the start-up banner;
* the micro-batch protocol: weights checked, the loss scale synced before each backward, the
  phase end decided once per micro-batch (and forecast before that), the phase ended;
* commit bookkeeping, once per committed step: the loss scaler, the metrics record, the LR
  scheduler, skipped / global steps, the log line and the monitor;
* a SIGTERM that stops every rank at the same round (the request rides along with a round),
  chaining any handler installed before;
* the rank-consistency check of the settings (:func:`check_same_on_all_ranks`).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import signal
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..comm import collectives
from ..comm.groups import destroyable, new_group_everywhere, new_rounds_group
from ..comm.lane import CommLane
from ..comm.streams import stream_accelerator
from .host import Host
from .metrics import StepMetrics, format_line, scalar_items
from .phases import FixedPhases, SharedPhases
from .refusals import check_estimate_variant, one_queue_serialisation
from .report import RoundReport
from .rounds import RoundKind, RoundResult
from .schedule import AccoSchedule, ScheduleOptions
from .scheduler_undo import NotUndoable, SchedulerUndo, undoable
from .shard_optimizer import ShardOptimizer

logger = logging.getLogger("ds_acco")


def check_same_on_all_ranks(settings: dict, what: str, group=None) -> None:
    """Refuse a run whose ranks disagree on ``settings`` (e.g. ACCO enabled on one rank only):
    they would issue different collectives and hang. One small collective on ``group``, the
    data-parallel group (None: the default group), whose ranks are the ones that build the engine;
    the caller has set the rank's device first (NCCL stages objects on the current device)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = json.dumps(settings, sort_keys=True, default=str)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if len(set(every)) > 1:
        lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(f"{what} differs between ranks: {lines}; fix: give every rank the same config")


def check_weight(weighting: str, weight: Optional[float], call: str) -> float:
    """A micro-batch's weight under ``acco.weighting``; errors name the call and the fix."""
    if weighting == "micro_batch":
        if weight is not None:
            raise ValueError(f"{call}(..., weight={weight!r}) with acco.weighting = 'micro_batch': every "
                             "micro-batch weighs 1; fix: set acco.weighting to 'sample' or 'token', or drop weight")
        return 1.0
    if weight is None or not (float(weight) >= 0):
        raise ValueError(f"acco.weighting = {weighting!r} needs {call}(loss, weight=n) with the micro-batch's "
                         f"{weighting} count n >= 0 (got weight={weight!r}); the loss must be the sum over "
                         f"{weighting}s, not their mean")
    return float(weight)


class AccoDriver:
    """Runs the ACCO / DPU schedule for one adapter.

    Args:
        config: the validated ``"acco"`` block.
        host: what the adapter built and its side of a commit (:class:`~ds_acco.core.host.Host`).
            Under tensor parallelism every rank of the world must build one.
    """

    def __init__(self, config, host: Host):
        self.config = config
        self.host = host
        self.log = host.log
        optimizer, groups, device = host.optimizer, host.groups, host.device
        self.lr = _LRBookkeeping(host.step_lr_scheduler, host.lr_scheduler, lambda: optimizer)
        self.gradient_accumulation_steps = host.gradient_accumulation_steps
        # its window is set by the schedule (chunking.chunk_elements)
        self.shard_optimizer = ShardOptimizer(optimizer, [p for g in groups for p in g.shard_params])
        check_estimate_variant(config.estimate, self.shard_optimizer)
        process_group, model_parallel_group = host.process_group, host.model_parallel_group
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        rank = dist.get_rank(group=process_group)
        serialised = one_queue_serialisation(device, config.synchronous)
        if serialised is not None:
            config = self.config = config.model_copy(update={"synchronous": True})
            if rank == 0:  # rank 0 of the data-parallel group: a mesh may exclude rank 0
                logger.warning(serialised)
        # The rounds' own groups: they run on the lane's thread, and gloo matches collectives by
        # issue order per group (and the compute thread's tensor-parallel collectives use mpu's).
        timeout = timedelta(seconds=config.comm_timeout_s)
        self.norm_group = None
        if model_parallel_group is not None and dist.get_world_size(group=model_parallel_group) > 1:
            # every rank builds an engine, each over its own data-parallel group
            self.process_group = new_group_everywhere(ranks, timeout)
            self.norm_group = new_group_everywhere(dist.get_process_group_ranks(model_parallel_group), timeout)
        else:
            self.process_group = new_rounds_group(ranks, timeout)
        self.lane = CommLane(synchronous=config.synchronous, timeout_s=config.comm_timeout_s,
                             accelerator=stream_accelerator(device, host.accelerator), device=device)
        self.metrics = StepMetrics(config.mode)
        self.stop_requested = False  # set by SIGTERM; sent to every rank with the next round
        self.options = ScheduleOptions.from_config(config, host.gradient_accumulation_steps, host.clip_grad)
        self.schedule = AccoSchedule(
            groups, self.shard_optimizer, self.lane, process_group=self.process_group, rank=rank, world=len(ranks),
            options=self.options, reduce_scatter=collectives.uses_reduce_scatter(self.process_group),
            norm_group=self.norm_group,
            loss_scale=host.loss_scale, report=self._report, on_commit=self._on_commit,
            before_launch=self.lr.step_owed, after_launch=self.lr.launched)
        self._boundary: Optional[bool] = None
        self._abandoned = False
        self._previous_sigterm = None
        self._stop_save: Optional[Callable[[str], None]] = None
        self._stop_dir: Optional[str] = None
        # A script that ends (returns, raises, Ctrl-C) without destroy(), as most DeepSpeed scripts
        # do: finish the round in flight before the interpreter tears down (see _close_at_exit).
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        if dist.get_rank() == 0:
            host.announce(self.banner(host.framework))

    def banner(self, framework: str = "") -> str:
        """One line: ACCO is on, its mode, phase length and buffer size."""
        g = self.schedule.groups
        comm_mb = sum(x.comm.numel() for x in g) / 2 ** 20
        phases = self.options.phases
        if isinstance(phases, SharedPhases):
            length = (f"{phases.micro_batches * self.schedule.world} micro-batches per phase over all ranks, shared "
                      "by measured speed")
        elif isinstance(phases, FixedPhases):
            length = f"{phases.micro_batches} micro-batches per phase"
        else:
            length = f"dynamic phases of {phases.min_micro_batches}..{phases.max_micro_batches} micro-batches"
        dtypes = g[0]
        return (f"ACCO is on{' (' + framework + ')' if framework else ''}: mode={self.config.mode}, {length} "
                f"(gradient_accumulation_steps={self.gradient_accumulation_steps}), communication buffer "
                f"{comm_mb:.1f} MiB, gradients in {dtypes.comm_dtype} (estimate rounds "
                f"{dtypes.estimate_dtype or dtypes.comm_dtype}), parameters in {dtypes.live_dtype}, "
                f"{'reduce-scatter' if self.schedule.context.reduce_scatter else 'all-reduce + slice'}, "
                f"synchronous={self.config.synchronous}")

    # -- the micro-batch protocol -------------------------------------------------------------
    def check_weight(self, weight: Optional[float], call: str) -> float:
        return check_weight(self.config.weighting, weight, call)

    def before_backward(self) -> None:
        self.schedule.before_backward()

    def is_boundary(self) -> bool:
        """Whether the current micro-batch ends a phase: decided inside :meth:`micro_batch`; asked
        before it, the forecast were it decided now."""
        return self._boundary if self._boundary is not None else self.schedule.forecast_phase_end()

    @contextlib.contextmanager
    def micro_batch(self, weight: float = 1.0, step_lr_scheduler: bool = True):
        """Around the framework's per-micro-batch step: decides whether the phase ends (yielded;
        :meth:`is_boundary` answers it meanwhile) and counts the micro-batch. The adapter calls
        :meth:`end_phase` inside when it ends. Afterwards the LR scheduler step owed for a commit
        launched inside is taken (unless ``step_lr_scheduler`` is False: the adapter calls
        :meth:`step_lr_scheduler_owed` itself where its caller expects it) and a stop request is
        honoured."""
        self._boundary = self.schedule.decide_phase_end()
        self.schedule.record_micro_batch(weight)
        try:
            yield self._boundary
        finally:
            self._boundary = None
        if step_lr_scheduler:
            self.lr.step_owed()
        if self.stop_requested_by_any_rank():
            self._stop()

    def step_lr_scheduler_owed(self) -> None:
        """Step the LR scheduler for a commit launched since the last call, if any: where stock
        steps it (after its optimizer step), so a caller reading the learning rate after
        ``step()`` (Megatron logs ``param_groups[0]['lr']``) reads stock's value."""
        self.lr.step_owed()

    def caller_scheduler_step(self, scheduler, step: Callable[[], None]) -> None:
        """``step()`` steps ``scheduler``, a scheduler the caller steps itself once per optimizer
        step right after the ``step()`` that launched a commit (Accelerate's, the HF Trainer's):
        taken now, undone if that commit turns out skipped, as stock never takes it then."""
        self.lr.caller_step(scheduler, step)

    def end_phase(self) -> None:
        self.schedule.end_phase()

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (a finished commit counts as committed); the LR scheduler
        step owed for a launched commit is taken first, so a checkpoint holds it."""
        self.lr.step_owed()
        return self.schedule.drain()

    def committed_weights(self):
        return self.schedule.committed_weights()

    # -- commit bookkeeping ------------------------------------------------------------------
    def get_lr(self) -> float:
        return self.shard_optimizer.optimizer.param_groups[0]["lr"]

    def _on_commit(self, result: RoundResult) -> None:
        scale = self.host.update_loss_scale(result.skipped)  # once per optimizer step, as DeepSpeed does
        self.lr.collected(result.skipped)
        record = self.metrics.on_commit(result, self.schedule.recent_rounds, self.schedule.history,
                                        result.lr if result.lr is not None else self.get_lr(), loss_scale=scale)
        if result.skipped:
            self.host.skipped_steps += 1
        self.host.after_commit(result, record)
        self.host.global_steps += 1
        cfg = self.config.metrics
        if dist.get_rank() != 0:
            return
        monitor = self.host.monitor
        if cfg.monitor and monitor is not None and monitor.enabled:
            monitor.write_events([(f"ACCO/{k}", v, self.host.global_samples) for k, v in scalar_items(record)])
        if cfg.log_every and record["step"] % cfg.log_every == 0:
            self.log(format_line(record))

    # -- stopping on SIGTERM: every rank at the same round ---------------------------------------
    def _report(self) -> RoundReport:
        # Travels with each round to every rank: this rank's metrics and its stop request.
        return dataclasses.replace(self.metrics.report(), stop=self.stop_requested)

    def stop_requested_by_any_rank(self) -> bool:
        """Whether a round collected so far carried a stop request from some rank."""
        return any(r.stop_anywhere or any(p.stop for p in (r.peer_report or ())) for r in self.schedule.recent_rounds)

    def install_sigterm(self, save: Optional[Callable[[str], None]] = None,
                        checkpoint_dir: Optional[str] = None) -> None:
        """Honour ``acco.sigterm``: on SIGTERM only flag the request (it rides along with this
        rank's next round, so every rank learns it when collecting that same round), then call
        the handler installed before, if it was a Python function. With 'checkpoint', ``save``
        is called with ``checkpoint_dir`` (default ``acco.sigterm_checkpoint_dir``; an adapter
        whose data-parallel groups share one config gives each a directory of its own)."""
        if self.config.sigterm == "off":
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("acco.sigterm needs the engine to be built on the main thread (signal handlers); "
                             "fix: set \"sigterm\": \"off\"")
        self._stop_save = save
        self._stop_dir = checkpoint_dir or self.config.sigterm_checkpoint_dir
        previous = signal.getsignal(signal.SIGTERM)
        # A weak reference: an engine that is never destroyed must not be kept alive by the
        # process-wide handler chain (its lane and process group are released when it is collected).
        me = weakref.ref(self)

        def handler(signum, frame):
            driver = me()
            if driver is not None:
                driver.stop_requested = True
            if callable(previous):
                previous(signum, frame)
        signal.signal(signal.SIGTERM, handler)
        self._previous_sigterm = (previous, handler)

    def _uninstall_sigterm(self) -> None:
        if self._previous_sigterm is None:
            return
        previous, ours = self._previous_sigterm
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is ours:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def _stop(self) -> None:
        cfg = self.config
        self.drain()
        saved = cfg.sigterm == "checkpoint" and self._stop_save is not None
        if saved:
            self._stop_save(self._stop_dir)
        if self.schedule.rank == 0:  # of the data-parallel group: every group that stops says so
            self.log(f"ACCO: stopping on SIGTERM after {self.host.global_steps} committed steps"
                     + (f", checkpoint in {self._stop_dir}" if saved else ""))
        raise SystemExit(143)

    def close(self) -> None:
        """Drain, stop the lane and give SIGTERM back to the handler before ours."""
        atexit.unregister(self._at_exit)
        if self._abandoned:
            return
        try:
            self.schedule.close()
        finally:
            self._uninstall_sigterm()
            self._release_process_group()

    @property
    def abandoned(self) -> bool:
        """Whether :meth:`abandon` let this driver go (a finaliser ran)."""
        return self._abandoned

    def finalised(self) -> None:
        """The host (engine, FSDP adapter) was garbage-collected without ``destroy()`` / ``close()``.

        Fixed phases: :meth:`abandon` -- every rank queued the same rounds, so the lane finishes
        them on its own and releases its group; a lane still running at interpreter exit is waited
        for then (:func:`_join_abandoned_lanes`). Phases that end on each rank's own timing
        (dynamic, shared): a rank may hold a round no peer will launch, and only the drain protocol
        (collective) can settle it, which a finaliser must not run. So this driver is kept until
        the interpreter exits, when :func:`_close_at_exit` drains it as every rank does (its
        memory is held until then). Either way no wait and no collective here."""
        if self._abandoned:
            return
        if self.schedule.agrees_drains and not self.schedule.closed:
            _KEPT_FOR_EXIT.append(self)
            return
        self.abandon()

    def abandon(self) -> None:
        """Let go without waiting, for a finaliser or the garbage collector: they may run on any
        thread at any point of another engine's life, this lane's own thread included (in the
        middle of a round). So no drain, no collective, no wait. Rounds already queued still run
        to the end on the lane's thread (every rank queued them); then that thread releases the
        process group (a local operation for gloo) and ends. The rounds' results are dropped.

        A group of another backend (NCCL) is left to the process: tearing a communicator down
        can block on its peers in some NCCL versions. A dynamic-mode round that only this rank
        launched stays in its collective until the group's timeout (``acco.comm_timeout_s``).
        ``destroy()`` (a drain every rank agrees on) is the orderly end for both."""
        if self._abandoned:
            return
        self._abandoned = True
        atexit.unregister(self._at_exit)
        self.schedule.abandon()
        self._uninstall_sigterm()
        pg, self.process_group = self.process_group, None
        ng, self.norm_group = self.norm_group, None
        local = False
        try:
            local = pg is not None and dist.is_initialized() and dist.get_backend(pg) == "gloo"
        except (ValueError, RuntimeError):  # the group is gone already (the default group was replaced)
            pass
        finally:
            self.lane.stop_nowait(then=(lambda: _destroy_group(pg, ng)) if local else None)
            _ABANDONED_LANES.add(self.lane)

    def _release_process_group(self) -> None:
        """Give the rounds' process group back (local: no collective, so it is safe from a
        finaliser or the garbage collector at any point of another engine's life). Kept while
        the lane's thread is still inside a round (a dead peer): it would use a destroyed group."""
        pg, self.process_group = self.process_group, None
        ng, self.norm_group = self.norm_group, None
        if pg is None or not dist.is_initialized() or self.lane.stuck:
            return
        _destroy_group(pg, ng)


class _LRBookkeeping:
    """When the LR scheduler steps, relative to the commits (ACCO.md: both rounds of step t use
    step t's learning rate; the scheduler advances once per applied commit).

    Every round captures the optimizer's settings when it is launched (``ShardOptimizer.settings``),
    so the scheduler may step as soon as the commit of step t is launched -- where stock steps it,
    after its optimizer step -- and the estimate of step t+1, launched later, reads step t+1's
    rate. Stepping at the collection instead (a phase later) would leave the learning rate that a
    caller reads after ``step()`` one step behind stock's. Whether the commit is applied is known
    only at its collection, and stock never steps the scheduler for a skipped optimizer step
    (non-finite gradient, fp16 overflow): a skipped commit has its scheduler step cancelled if
    still owed, else undone through the scheduler's protocol (:class:`.scheduler_undo.SchedulerUndo`).
    A step that the caller takes itself for the commit in flight (:meth:`caller_step`: Accelerate's
    scheduler, the HF Trainer's) is undone the same way.

    A scheduler that cannot be undone -- no ``state_dict()`` / ``load_state_dict()``, a state that
    cannot be copied, or a load that does not restore a live scheduler and no inverse step -- is
    stepped only once its commit is known applied, at the commit's collection, before the next round
    is launched: every round still uses stock's settings, but the learning rate read right after
    ``step()`` lags one phase (one warning says so)."""

    def __init__(self, step: Optional[Callable[[], Any]], scheduler: Callable[[], Any],
                 optimizer: Callable[[], torch.optim.Optimizer]):
        self._step, self._scheduler, self._optimizer = step, scheduler, optimizer
        self._owed = False  # a launched commit's scheduler step not yet taken
        self._commit_in_flight = False  # a commit launched and not yet collected
        self._undos: List[SchedulerUndo] = []  # the scheduler steps taken for the commit in flight, in order
        # The commit launched last was collected skipped before the caller stepped its scheduler for it
        # (the synchronous warm-up collects it inside the step() that launched it): that step is not taken.
        self._collected_skipped = False
        self._deferred = False  # our scheduler has no undo: stepped at the collection of an applied commit
        self._no_undo: dict = {}  # id(scheduler) -> why it cannot be undone, once found out
        self._warned: set = set()

    def launched(self, kind: RoundKind) -> None:
        if kind is not RoundKind.COMMIT:
            return
        # The optimizer step of this step is taken (by the round, which may never call
        # optimizer.step(): the functional commit). torch's schedulers warn "lr_scheduler.step()
        # before optimizer.step()" at their first step unless the wrapper they put on
        # optimizer.step recorded a call, so record it here as that wrapper does; a scheduler
        # stepped before the first commit is launched still warns, as in stock.
        self._optimizer()._opt_called = True
        self._commit_in_flight, self._undos, self._collected_skipped = True, [], False
        scheduler = self._scheduler() if self._step is not None else None
        if scheduler is None:
            return
        self._owed, self._deferred = True, False
        why = undoable(scheduler) or self._no_undo.get(id(scheduler))
        if why is not None:
            self._defer(scheduler, why)

    def step_owed(self) -> None:
        """Take the scheduler step owed for the commit launched last (unless it waits for the
        commit's collection, see the class docstring)."""
        if not self._owed or self._deferred:
            return
        self._owed = False
        scheduler = self._scheduler()
        try:
            self._undos.append(SchedulerUndo.around(scheduler, self._optimizer(), self._step))
        except NotUndoable as exc:  # raised before the step: take it at the collection instead
            self._owed = True
            self._no_undo[id(scheduler)] = str(exc)
            self._defer(scheduler, str(exc))

    def caller_step(self, scheduler, step: Callable[[], None]) -> None:
        """``step()`` steps ``scheduler``, which the caller steps itself once per optimizer step
        right after the ``step()`` that launched a commit (stock skips it for a skipped step): taken
        now, and undone if the commit in flight turns out skipped. With no commit in flight it is
        only taken; with the commit already collected skipped, not taken (stock skips it)."""
        if self._collected_skipped:
            return
        why = undoable(scheduler) or self._no_undo.get(id(scheduler))
        if not self._commit_in_flight or why is not None:
            if why is not None:
                self._warn_caller_scheduler(scheduler, why)
            step()
            return
        try:
            self._undos.append(SchedulerUndo.around(scheduler, self._optimizer(), step))
        except NotUndoable as exc:
            self._no_undo[id(scheduler)] = str(exc)
            self._warn_caller_scheduler(scheduler, str(exc))
            step()

    def collected(self, skipped: bool) -> None:
        """The commit launched last was collected: ``skipped`` or applied."""
        undos, self._undos, self._commit_in_flight = self._undos, [], False
        self._collected_skipped = skipped
        if skipped:
            self._owed = False  # a step still owed is never taken
            optimizer = self._optimizer()
            for undo in reversed(undos):
                try:
                    undo.revert(optimizer)
                except NotUndoable as exc:  # nothing was changed: this step stays
                    self._no_undo[id(undo.scheduler)] = str(exc)
                    if undo.scheduler is self._scheduler():
                        self._warn_once(undo.scheduler, f"ACCO: a skipped commit's step of the LR scheduler "
                                                        f"{type(undo.scheduler).__name__} cannot be undone ({exc}): "
                                                        "the schedule runs one step ahead of stock's from here; ACCO "
                                                        "steps it only once a commit is known applied from now on; "
                                                        "fix: a load_state_dict() that restores a live scheduler")
                    else:
                        self._warn_caller_scheduler(undo.scheduler, str(exc))
        elif self._owed and self._deferred:
            self._owed = False
            self._step()

    def _defer(self, scheduler, why: str) -> None:
        self._deferred = True
        self._warn_once(scheduler, f"ACCO: the LR scheduler {type(scheduler).__name__} cannot be undone ({why}), so "
                                   "ACCO steps it only once a commit is known applied, at the commit's collection "
                                   "(a phase after stock steps it): every round uses stock's learning rate, but the "
                                   "rate read right after step() lags one step behind stock's; fix: give the "
                                   "scheduler state_dict() and a load_state_dict() that restores it")

    def _warn_caller_scheduler(self, scheduler, why: str) -> None:
        self._warn_once(scheduler, f"ACCO: the LR scheduler {type(scheduler).__name__} that the caller steps cannot "
                                   f"be undone ({why}): after each skipped commit (non-finite gradient, fp16 "
                                   "overflow) its schedule runs one step ahead of stock's; fix: give it state_dict() "
                                   "and a load_state_dict() that restores it")

    def _warn_once(self, scheduler, message: str) -> None:
        if id(scheduler) in self._warned:
            return
        self._warned.add(id(scheduler))
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(message)


def _close_at_exit(ref: "weakref.ref[AccoDriver]") -> None:
    """At interpreter exit, an engine nobody destroyed: its last round is finished on every rank.

    Without this, a round still in flight on the lane's (daemon) thread is inside a gloo/NCCL
    collective while the interpreter finalises, and the C++ runtime aborts the process
    (``terminate called without an active exception``, SIGABRT): a script that ended normally
    reported failure, and a real error's exit status was lost. Every rank runs this at its exit,
    as the same script ends the same way on every rank: fixed mode waits for the round in flight
    (every rank launched it: same micro-batch counts), dynamic mode runs its drain protocol
    (``schedule.py``: the j-th drain of every rank finishes the same rounds). Nothing is saved or
    written: the finished commit only updates this process's memory. Bounded by
    ``comm_timeout_s``; a peer already gone fails the collective at once (its sockets close),
    and then the round is dropped here with one line on stderr. Registered per driver with a weak
    reference, unregistered by ``close()`` / ``abandon()``; runs before torch's own teardown
    (atexit handlers run in reverse order of registration)."""
    import sys
    driver = ref()
    if driver is None or driver.abandoned:
        return
    try:
        driver.close()
    except BaseException as exc:  # noqa: BLE001 -- at exit: never replace the program's own outcome
        print(f"ds_acco: at exit, the communication round in flight could not be finished ({type(exc).__name__}: "
              f"{exc}); it is dropped", file=sys.stderr, flush=True)
        driver.abandon()
    finally:
        if getattr(sys, "last_type", None) is KeyboardInterrupt:
            _rearm_sigint_exit()


# Drivers whose host was collected while their phases may disagree across ranks: drained at exit
# (AccoDriver.finalised). Lanes let go by abandon() that may still run a round: waited for at exit.
_KEPT_FOR_EXIT: list = []
_ABANDONED_LANES: "weakref.WeakSet[CommLane]" = weakref.WeakSet()


def _join_abandoned_lanes() -> None:
    """At interpreter exit, after every driver's own hook: wait for the lanes :meth:`AccoDriver.abandon`
    let go to finish the rounds they still run (each bounded by its ``comm_timeout_s``).

    A lane thread still inside a gloo/NCCL collective while the interpreter finalises aborts the
    process (``terminate called without an active exception``): an engine collected by the
    garbage collector just before a script ended -- a function returned, an allocation triggered
    a collection -- did that now and then (2 of 88 runs). Its peers launched the same rounds, so
    the wait ends when the slowest of them gets there, or at once when a peer's exit fails the
    collective."""
    import sys
    for lane in list(_ABANDONED_LANES):
        if lane.timed_out is not None:
            continue  # broken: its round already ran out of comm_timeout_s and was reported then
        if not lane.join_stopping(lane.timeout_s):
            print(f"ds_acco: at exit, a round of an engine collected without destroy() did not finish within "
                  f"acco.comm_timeout_s = {lane.timeout_s:g} s; exiting without it", file=sys.stderr, flush=True)


atexit.register(_join_abandoned_lanes)  # at import: it runs after every driver's own hook


def _rearm_sigint_exit() -> None:
    """Keep Ctrl-C's exit status (killed by SIGINT, as stock) after the drain above.

    CPython ends a program whose KeyboardInterrupt went unhandled by killing itself with SIGINT,
    but only while a flag it set at that moment is still set, and every ``exec`` / ``eval`` of a
    *string* clears it (``run_eval_code_obj``) -- e.g. a dataclass or namedtuple that torch builds
    lazily while the drain runs the FSDP2 round: the process then exited 1 instead of -2. The
    flag is set again the only way Python code can: by evaluating a string that raises
    KeyboardInterrupt."""
    try:
        exec("raise KeyboardInterrupt")  # noqa: S102 -- a constant string, for the flag it sets
    except KeyboardInterrupt:
        pass


def _destroy_group(*pgs) -> None:
    """Local, no collective. Safe beside the main thread building the next engine's group:
    torch's registry of groups is plain dicts, changed key by key under the GIL. Not beside a
    concurrent ``destroy_process_group()`` of the whole world: destroy() engines before that."""
    for pg in pgs:
        if pg is None or not dist.is_initialized() or not destroyable(pg):
            continue
        try:
            dist.destroy_process_group(pg)
        except Exception:  # already gone (the default group was destroyed first): nothing to free
            pass
