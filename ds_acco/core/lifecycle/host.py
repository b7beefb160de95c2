"""The host: what an adapter (the DeepSpeed engine, the FSDP module) gives the driver, as one typed object.

The driver (:class:`~ds_acco.core.driver.AccoDriver`) takes one host instead of a constructor
argument per setting and a callable per hook: an adapter implements this protocol with a small class
that reads its framework's objects (``ds_acco/deepspeed/host.py``, ``ds_acco/fsdp/host.py``); a test
can pass a plain object that has these members.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..round.buffers import BufferGroup
from ..round.rounds import RoundResult


class Host(Protocol):
    """What a host provides: what it built (read once, when the driver is built), its step counters
    (which the driver advances once per commit) and the framework's side of a commit."""

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

    # -- its step counters, advanced by the driver once per commit ----------------------------------------
    global_steps: int
    skipped_steps: int

    @property
    def global_samples(self) -> int:
        """The x axis of the metrics the monitor writes."""

    @property
    def monitor(self) -> Any:
        """DeepSpeed's monitor (``write_events``, ``enabled``) or None."""

    # -- the framework's side of a commit -------------------------------------------------------------
    def loss_scale(self) -> Optional[float]:
        """The fp16 loss scale backward passes use now (None: no loss scaling)."""

    def update_loss_scale(self, skipped: bool) -> Optional[float]:
        """Called once per committed step (dynamic loss scaling updates its scaler there); returns
        the loss scale to report, or None without fp16."""

    def lr_scheduler(self) -> Any:
        """The scheduler :meth:`step_lr_scheduler` steps (for the undo of a skipped commit's step),
        or None: then the driver never steps one."""

    def step_lr_scheduler(self) -> Optional[Callable[[], Any]]:
        """Step the LR scheduler once for an applied commit, where stock steps it. A commit found
        skipped later has that step undone (:class:`~ds_acco.core.lifecycle.lr_bookkeeping.LRBookkeeping`); returns the step's
        inverse (a callable) for schedulers whose ``load_state_dict()`` does not restore, or None."""

    def after_commit(self, result: RoundResult, record: dict) -> None:
        """The host's own per-commit bookkeeping (the metrics ``record`` of the step)."""

    def log(self, line: str) -> None:
        """Where the driver's log lines go (the metrics line, the stop on SIGTERM)."""

    def announce(self, line: str) -> None:
        """Where rank 0's start-up banner goes: visible by default (DeepSpeed 0.19 hides INFO)."""


def forwarded(owner: str, name: str) -> property:
    """A read-write property that is ``self.<owner>.<name>``: a host's step counters are its
    adapter's own (``engine.global_steps``), advanced by the driver through the host."""
    return property(lambda self: getattr(getattr(self, owner), name),
                    lambda self, value: setattr(getattr(self, owner), name, value),
                    doc=f"``{owner}.{name}``")
