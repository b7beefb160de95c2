"""The driver's host for DeepSpeed: what the engine and its ZeRO-1 optimizer give the core (core/lifecycle/host.py)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from deepspeed.utils import logger

from ..core.lifecycle.host import CommitEvent, forwarded, publish_commit
from ..core.round.buffers import BufferGroup


class DeepSpeedHost:
    """:class:`~ds_acco.core.lifecycle.host.Host` over an :class:`~ds_acco.deepspeed.engine.AccoEngine` and the
    :class:`~ds_acco.deepspeed.optimizer.AccoZeroOptimizer` it is building: the step counters are
    the engine's, the scheduler is the engine's (read when used: it is set after the optimizer),
    the loss scaler is the optimizer's (DeepSpeed's)."""

    framework = "DeepSpeed ZeRO-1"

    def __init__(self, engine, zero_optimizer, groups: Sequence[BufferGroup], gradient_accumulation_steps: int,
                 accelerator: Any, model_parallel_group: Any = None):
        self.engine, self.zero_optimizer = engine, zero_optimizer
        self.groups = groups
        self.optimizer = zero_optimizer.optimizer
        self.process_group = zero_optimizer.dp_process_group
        self.model_parallel_group = model_parallel_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_grad = zero_optimizer.clip_grad
        self.sum_ranks = not zero_optimizer.gradient_average  # gradient_allreduce_op "sum"
        self.device = groups[0].live.device
        self.accelerator = accelerator

    global_steps = forwarded("engine", "global_steps")
    skipped_steps = forwarded("engine", "skipped_steps")

    @property
    def global_samples(self) -> int:
        return self.engine.global_samples

    @property
    def monitor(self) -> Any:
        return getattr(self.engine, "monitor", None)

    def loss_scale(self) -> Optional[float]:
        return self.zero_optimizer.loss_scale

    def update_loss_scale(self, skipped: bool) -> Optional[float]:
        return self.zero_optimizer._acco_update_loss_scale(skipped)

    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def step_lr_scheduler(self) -> Optional[Callable[[], Any]]:
        return self.engine._acco_step_lr_scheduler()

    def on_commit(self, event: CommitEvent) -> None:
        """A commit's effects on the engine, in the Host protocol's order (what
        ``DeepSpeedEngine._take_model_step`` does besides the optimizer and the scheduler)."""
        engine = self.engine
        if event.skipped:
            engine.skipped_steps += 1
        self.zero_optimizer._global_grad_norm = event.grad_norm
        engine._acco_book_step(event)  # progress line, grad norm, global_samples, DeepSpeed's held figures
        engine.global_steps += 1
        publish_commit(event, self.monitor, engine.global_samples, self.log)

    def log(self, line: str) -> None:
        logger.info(line)

    def announce(self, line: str) -> None:
        logger.warning(line)  # DeepSpeed's logger shows WARNING and above by default
