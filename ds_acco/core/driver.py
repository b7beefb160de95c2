"""The one protocol every adapter speaks to the core.

An adapter (DeepSpeed's ZeRO-1 optimizer, FSDP2, ...) translates its framework's tensors into
buffer groups and its calls into this driver's; everything else is here, once:

* construction: the rounds' own process group, the lane (on the rank's device), the phase
  policy, the shard optimizer, metrics, and the start-up banner;
* the micro-batch protocol: weights checked, the loss scale synced before each backward, the
  phase end decided once per micro-batch (and forecast before that), the phase ended;
* commit bookkeeping, once per committed step: the loss scaler, the LR scheduler
  (:mod:`.lr_bookkeeping`), the metrics record, then one :class:`~.lifecycle.host.CommitEvent`
  to the adapter's host (its step counters, its monitor, the log line: the order is the Host
  protocol's);
* a SIGTERM that stops every rank at the same round (the request rides along with a round),
  chaining any handler installed before;
* the rank-consistency check of the settings (:func:`check_same_on_all_ranks`);
* teardown: close, or let go from a finaliser (the process's exit finishes the rest: :mod:`.at_exit`).
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
from typing import Callable, Optional

import torch.distributed as dist

from ..comm import collectives
from ..comm.groups import connected, new_group_everywhere, new_rounds_group
from ..comm.lane import CommLane
from ..comm.streams import stream_accelerator
from .checks.refusals import refuse
from .checks.warning_rows import one_queue_serialisation
from .lifecycle.at_exit import ABANDONED_LANES, KEPT_FOR_EXIT, close_at_exit, end_groups
from .lifecycle.host import CommitEvent, Host
from .lifecycle.lr_bookkeeping import LRBookkeeping
from .lifecycle.metrics import StepMetrics, format_line, scalar_items
from .round.report import RoundReport
from .round.rounds import RoundKind, RoundResult
from .schedule.machine import AccoSchedule
from .schedule.options import ScheduleOptions
from .schedule.phases import FixedPhases, SharedPhases
from .step.shard_optimizer import ShardOptimizer

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
        raise refuse("ranks_differ", what, lines=lines)


def check_weight(weighting: str, weight: Optional[float], call: str) -> float:
    """A micro-batch's weight under ``acco.weighting``; errors name the call and the fix."""
    if weighting == "micro_batch":
        if weight is not None:
            raise refuse("weight_unweighted", f"{call}(..., weight={weight!r}) with acco.weighting = 'micro_batch'")
        return 1.0
    if weight is None or not (float(weight) >= 0):
        raise refuse("weighting_needs_weight", f"acco.weighting = {weighting!r} needs {call}(loss, weight=n) with the "
                     f"micro-batch's {weighting} count n >= 0 (got weight={weight!r})", weighting=weighting, call=call)
    return float(weight)


class AccoDriver:
    """Runs the ACCO / DPU schedule for one adapter.

    Args:
        config: the validated ``"acco"`` block.
        host: what the adapter built and its side of a commit (:class:`~ds_acco.core.lifecycle.host.Host`).
            Under tensor parallelism every rank of the world must build one.
        shard_optimizer: the :class:`ShardOptimizer` over the host's shards, in the groups' order (None:
            built here). The adapter checked what it built before this driver (check point 2,
            :func:`~ds_acco.core.checks.built.check_built`): the driver trusts it.
    """

    def __init__(self, config, host: Host, shard_optimizer: Optional[ShardOptimizer] = None):
        self.config = config
        self.host = host
        self.log = host.log
        optimizer, groups, device = host.optimizer, host.groups, host.device
        self.lr = LRBookkeeping(host.step_lr_scheduler, host.lr_scheduler, lambda: optimizer)
        self.gradient_accumulation_steps = host.gradient_accumulation_steps
        # its window is set by the schedule (chunking.chunk_elements)
        self.shard_optimizer = shard_optimizer or ShardOptimizer(optimizer,
                                                                 [p for g in groups for p in g.shard_params])
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
        # Held by the rounds' context only (see process_group): at_exit.end_groups lets them go.
        timeout = timedelta(seconds=config.comm_timeout_s)
        rounds_group, norm_group = None, None
        if model_parallel_group is not None and dist.get_world_size(group=model_parallel_group) > 1:
            # every rank builds an engine, each over its own data-parallel group
            rounds_group = new_group_everywhere(ranks, timeout)
            norm_group = new_group_everywhere(dist.get_process_group_ranks(model_parallel_group), timeout)
        else:
            rounds_group = new_rounds_group(ranks, timeout)
        for group in (rounds_group, norm_group):
            connected(group)  # every rank connected before any may destroy it (an engine destroyed at once)
        self.lane = CommLane(synchronous=config.synchronous, timeout_s=config.comm_timeout_s,
                             accelerator=stream_accelerator(device, host.accelerator), device=device)
        self.metrics = StepMetrics(config.mode)
        self.stop_requested = False  # set by SIGTERM; sent to every rank with the next round
        self.options = ScheduleOptions.from_config(config, host.gradient_accumulation_steps, host.clip_grad,
                                                   sum_ranks=host.sum_ranks)
        self.schedule = AccoSchedule(
            groups, self.shard_optimizer, self.lane, process_group=rounds_group, rank=rank, world=len(ranks),
            options=self.options, reduce_scatter=collectives.uses_reduce_scatter(rounds_group), norm_group=norm_group,
            loss_scale=host.loss_scale, report=self._report, on_commit=self._on_commit,
            before_launch=self.lr.step_owed, after_launch=self._launched)
        if self.schedule.auto is not None and dist.get_rank() == 0:
            self.schedule.auto.announce = self.log  # mode 'auto': its decision, inputs and rule
        self.commits_launched = 0  # optimizer steps ended on this rank (a host counts its steps by it)
        self._boundary: Optional[bool] = None
        self._abandoned = False
        self._previous_sigterm = None
        self._stop_save: Optional[Callable[[str], None]] = None
        self._stop_dir: Optional[str] = None
        # A script that ends (returns, raises, Ctrl-C) without destroy(), as most DeepSpeed scripts
        # do: finish the round in flight before the interpreter tears down (see at_exit.close_at_exit).
        self._at_exit = functools.partial(close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        if dist.get_rank() == 0:
            host.announce(self.banner(host.framework))

    def banner(self, framework: str = "") -> str:
        """One line: ACCO is on, its mode, the estimate in use, phase length and buffer size."""
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
                f"synchronous={self.config.synchronous}; {self.config.estimate_in_banner()}")

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

    def _launched(self, kind: RoundKind) -> None:
        if kind is RoundKind.COMMIT:
            self.commits_launched += 1
        self.lr.launched(kind)

    @property
    def commit_in_flight(self) -> bool:
        """Whether a commit was launched and is not booked yet (its step's samples, skip and
        learning rate are known only then)."""
        inflight = self.schedule.inflight
        return inflight is not None and inflight.kind is RoundKind.COMMIT and not inflight.committed

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (a finished commit counts as committed); the LR scheduler
        step owed for a launched commit is taken first, so a checkpoint holds it."""
        self.lr.step_owed()
        return self.schedule.drain()

    def drain_for_load(self) -> Optional[RoundResult]:
        """Wait for the round in flight before a load replaces the weights, the optimizer's state
        and param groups and the LR scheduler. The scheduler step owed for a launched commit stays
        owed: the caller's next ``step()`` takes it on the loaded scheduler, after the loaded param
        groups, where stock takes it (Megatron's protocol: a load between the ``backward()`` that
        launched the commit and its ``step()``). Taken before the load it would be lost with the old
        scheduler; taken inside it, the loaded param groups would overwrite the rate it set."""
        return self.schedule.drain()

    def committed_weights(self):
        return self.schedule.committed_weights()

    # -- commit bookkeeping ------------------------------------------------------------------
    def get_lr(self) -> float:
        return self.shard_optimizer.optimizer.param_groups[0]["lr"]

    def _on_commit(self, result: RoundResult) -> None:
        # The order of a commit's effects is the Host protocol's (core/lifecycle/host.py).
        scale = self.host.update_loss_scale(result.skipped)  # once per optimizer step, as DeepSpeed does
        lr_done = self.lr.collected(result.skipped)
        lr = result.lr if result.lr is not None else self.get_lr()
        record = self.metrics.on_commit(result, self.schedule.recent_rounds, self.schedule.history, lr,
                                        loss_scale=scale)
        cfg, rank0 = self.config.metrics, dist.get_rank() == 0
        total = result.total
        self.host.on_commit(CommitEvent(
            step=record["step"], skipped=result.skipped, grad_norm=result.grad_norm, loss_scale=scale, lr=lr,
            lr_scheduler=lr_done, micro_batches=total.micro_batches, weight=total.weight,
            weighting=self.config.weighting,
            monitor_events=tuple(scalar_items(record)) if rank0 and cfg.monitor else (),
            log_line=format_line(record) if rank0 and cfg.log_every and record["step"] % cfg.log_every == 0
            else None))

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
            raise refuse("sigterm_main_thread", "acco.sigterm needs the engine to be built on the main thread")
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
        for then (:func:`.at_exit.join_abandoned_lanes`). Phases that end on each rank's own timing
        (dynamic, shared): a rank may hold a round no peer will launch, and only the drain protocol
        (collective) can settle it, which a finaliser must not run. So this driver is kept until
        the interpreter exits, when :func:`.at_exit.close_at_exit` drains it as every rank does (its
        memory is held until then). Either way no wait and no collective here."""
        if self._abandoned:
            return
        if self.schedule.agrees_drains and not self.schedule.closed:
            KEPT_FOR_EXIT.append(self)
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
        context = self.schedule.context
        left_to_the_process = False  # an NCCL group (docstring); a gloo one, or one already gone, is let go
        try:
            left_to_the_process = (context.process_group is not None and dist.is_initialized()
                                   and dist.get_backend(context.process_group) != "gloo")
        except (ValueError, RuntimeError):  # the group is gone already (the default group was replaced)
            pass
        finally:
            # on the lane's thread, after the rounds already queued (they use the groups)
            self.lane.stop_nowait(then=None if left_to_the_process else functools.partial(end_groups, context))
            ABANDONED_LANES.add(self.lane)

    def _release_process_group(self) -> None:
        """Give the rounds' process group back (local: no collective, so it is safe from a
        finaliser or the garbage collector at any point of another engine's life). Kept while
        the lane's thread is still inside a round (a dead peer): it would use a destroyed group."""
        if not self.lane.stuck:  # stuck: the round still inside a collective uses them
            end_groups(self.schedule.context)  # the lane is joined: no round reads them again

    @property
    def process_group(self):
        """The rounds' own process group (None once released)."""
        return self.schedule.context.process_group

