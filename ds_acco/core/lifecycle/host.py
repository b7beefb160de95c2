"""The host: what an adapter (the DeepSpeed engine, the FSDP module) gives the driver, as one typed object,
and the one event (:class:`CommitEvent`) through which the driver tells it about each commit.

The driver (:class:`~ds_acco.core.driver.AccoDriver`) takes one host instead of a constructor
argument per setting and a callable per hook: an adapter implements this protocol with a small class
that reads its framework's objects (``ds_acco/deepspeed/host.py``, ``ds_acco/fsdp/host.py``); a test
can pass a plain object that has these members.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

import torch

from ..round.buffers import BufferGroup


@dataclasses.dataclass(frozen=True)
class CommitEvent:
    """One committed optimizer step, as the driver hands it to :meth:`Host.on_commit` (once per
    commit, after the loss scaler's update and the LR bookkeeping; see :class:`Host` for the order)."""

    step: int
    """Committed steps with this one (1 for the first commit): the metrics record's ``step``."""
    skipped: bool
    """The step was not applied (a non-finite gradient, an fp16 overflow)."""
    grad_norm: float
    """The norm of the global mean gradient, before clipping."""
    loss_scale: Optional[float]
    """The loss scale after this step's update (:meth:`Host.update_loss_scale`; None: no loss scaling)."""
    lr: Optional[float]
    """The learning rate this step used (as the metrics record reports it)."""
    lr_scheduler: str
    """What the LR bookkeeping did at this collection
    (:meth:`~ds_acco.core.lifecycle.lr_bookkeeping.LRBookkeeping.collected`): ``"kept"`` (applied:
    its scheduler step, if any, stays), ``"stepped"`` (applied: a scheduler that cannot be undone was
    stepped now) or ``"undone"`` (skipped: the steps taken for it were taken back)."""
    micro_batches: int
    """All ranks' micro-batches in the step."""
    weight: float
    """All ranks' weight in the step (samples / tokens under ``acco.weighting`` 'sample' / 'token')."""
    weighting: str
    """``acco.weighting``."""
    monitor_events: Tuple[Tuple[str, float], ...] = ()
    """ACCO's metrics to write to the host's monitor (rank 0 with ``acco.metrics.monitor``), x = the
    global sample count with this step."""
    log_line: Optional[str] = None
    """ACCO's metrics line to log (rank 0, every ``acco.metrics.log_every`` steps), or None."""

    def samples(self, micro_batch_size: int) -> int:
        """The samples of this step, all ranks', as DeepSpeed's engine counts them under ACCO: the
        weight under ``weighting: "sample"``, else micro-batches x ``micro_batch_size``."""
        if self.weighting == "sample":
            return int(self.weight)
        return self.micro_batches * micro_batch_size


def publish_commit(event: CommitEvent, monitor: Any, global_samples: int, log: Callable[[str], None]) -> None:
    """The last effects of a commit on a host: ACCO's metrics to ``monitor`` (if enabled) at x =
    ``global_samples``, then the metrics line to ``log``."""
    if event.monitor_events and monitor is not None and monitor.enabled:
        monitor.write_events([(f"ACCO/{k}", v, global_samples) for k, v in event.monitor_events])
    if event.log_line is not None:
        log(event.log_line)


class Host(Protocol):
    """What a host provides: what it built (read once, when the driver is built), its step counters
    (read-only to the driver) and the framework's side of a commit.

    The driver books each committed step in this order, once per commit:

    1. :meth:`update_loss_scale` (the fp16 loss scaler's rule, told whether the step was skipped);
    2. the LR bookkeeping on :meth:`lr_scheduler` (:class:`~ds_acco.core.lifecycle.lr_bookkeeping.LRBookkeeping`:
       a skipped step's scheduler steps undone, a deferred one taken) and the metrics record;
    3. :meth:`on_commit`, once, with the :class:`CommitEvent`; its effects, in this order, in the
       adapter's ``on_commit`` alone:

       a. ``skipped_steps`` += 1 if the step was skipped;
       b. the framework's own per-step bookkeeping (DeepSpeed: the gradient norm, the progress line
          with the step count before this step, ``global_samples`` += the step's samples, and the
          per-step figures DeepSpeed wrote for this step, held until now; FSDP2: ``global_samples``);
       c. ``global_steps`` += 1;
       d. ACCO's metrics to the monitor at x = ``global_samples`` (:attr:`CommitEvent.monitor_events`),
          then the metrics line to :meth:`log` (:func:`publish_commit`).
    """

    # -- what it built --------------------------------------------------------------------------------
    framework: str
    """Named in the start-up banner and in errors (e.g. ``"DeepSpeed ZeRO-1"``)."""
    groups: Sequence[BufferGroup]
    """Its buffer groups: the flat buffers the rounds reduce and the shards they step."""
    optimizer: torch.optim.Optimizer
    """The torch optimizer whose parameters are exactly the groups' shard parameters."""
    process_group: Any
    """The data-parallel group (None: the default group)."""
    model_parallel_group: Any
    """Tensor parallelism: the group of this rank's tensor-parallel peers (None or size 1: none). The
    gradient norm, and so the skip and the clip, is then summed over it too; buffer groups count
    replicated parameters on one of its ranks only (``BufferGroup.norm_ranges``)."""
    gradient_accumulation_steps: int
    clip_grad: float
    """The gradient clipping norm (0: off)."""
    sum_ranks: bool
    """The ranks' gradients are summed, not averaged (DeepSpeed's ``gradient_allreduce_op: "sum"``)."""
    device: torch.device
    """Where G and B live (the lane runs its rounds with this device current)."""
    accelerator: Any
    """The streams and events the lane uses on ``device`` (:mod:`ds_acco.comm.streams`); None:
    torch's."""

    # -- its step counters, advanced by its own on_commit -------------------------------------------------
    @property
    def global_steps(self) -> int:
        """Committed optimizer steps (skipped ones included)."""

    @property
    def skipped_steps(self) -> int:
        """Committed optimizer steps that were skipped."""

    @property
    def global_samples(self) -> int:
        """All ranks' samples in the committed steps: the x axis of the metrics the monitor writes."""

    # -- the framework's side of a commit -------------------------------------------------------------
    def loss_scale(self) -> Optional[float]:
        """The fp16 loss scale backward passes use now (None: no loss scaling)."""

    def update_loss_scale(self, skipped: bool) -> Optional[float]:
        """Step 1 of a commit (see the class docstring): dynamic loss scaling updates its scaler;
        returns the loss scale to report, or None without fp16."""

    def lr_scheduler(self) -> Any:
        """The scheduler :meth:`step_lr_scheduler` steps (for the undo of a skipped commit's step),
        or None: then the driver never steps one."""

    def step_lr_scheduler(self) -> Optional[Callable[[], Any]]:
        """Step the LR scheduler once for an applied commit, where stock steps it. A commit found
        skipped later has that step undone (:class:`~ds_acco.core.lifecycle.lr_bookkeeping.LRBookkeeping`); returns the step's
        inverse (a callable) for schedulers whose ``load_state_dict()`` does not restore, or None."""

    def on_commit(self, event: CommitEvent) -> None:
        """Step 3 of a commit: the host's effects, in the order the class docstring gives."""

    def log(self, line: str) -> None:
        """Where the driver's log lines go (the metrics line, the stop on SIGTERM)."""

    def announce(self, line: str) -> None:
        """Where rank 0's start-up banner goes: visible by default (DeepSpeed 0.19 hides INFO)."""


def forwarded(owner: str, name: str) -> property:
    """A read-only property that is ``self.<owner>.<name>``: a host's step counters are its
    adapter's own (``engine.global_steps``), advanced by the host's ``on_commit``."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=f"``{owner}.{name}``")
