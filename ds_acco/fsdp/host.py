"""The driver's host for FSDP2: what ``AccoFSDP`` gives the core (core/lifecycle/host.py)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..core.lifecycle.host import forwarded

logger = logging.getLogger(__name__)


class FSDPHost:
    """:class:`~ds_acco.core.lifecycle.host.Host` over an :class:`~ds_acco.fsdp.adapter.AccoFSDP`: its buffers
    (one group), the user's optimizer, the mesh's group, its step counters; DeepSpeed's loss scaler
    when the config has an ``"fp16"`` block. The LR scheduler given at construction is the one
    stepped (None: none is)."""

    framework = "FSDP2"
    model_parallel_group = None
    accelerator = None  # torch's streams and events
    monitor = None
    sum_ranks = False  # FSDP2's gradients are the mean over the ranks

    def __init__(self, adapter, process_group: Any, gradient_accumulation_steps: int, clip_grad: float):
        self.adapter = adapter
        self.groups = [adapter.buffers]
        self.optimizer = adapter.optimizer
        self.process_group = process_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_grad = clip_grad
        self.device = adapter.buffers.grads.device
        self._step = None if adapter.lr_scheduler is None else adapter.lr_scheduler.step

    global_steps = forwarded("adapter", "global_steps")
    skipped_steps = forwarded("adapter", "skipped_steps")

    @property
    def global_samples(self) -> int:
        return self.adapter.global_steps

    def loss_scale(self) -> Optional[float]:
        scaler = self.adapter.loss_scaler
        return None if scaler is None else scaler.cur_scale

    def update_loss_scale(self, skipped: bool) -> Optional[float]:
        scaler = self.adapter.loss_scaler
        if scaler is None:
            return None
        if scaler.dynamic:
            scaler.update_scale(skipped)  # DeepSpeed's rule, once per optimizer step
        return float(scaler.cur_scale)

    def lr_scheduler(self) -> Any:
        return None if self._step is None else self.adapter.lr_scheduler

    def step_lr_scheduler(self) -> Optional[Callable[[], Any]]:
        return self._step()

    def after_commit(self, result, record: dict) -> None:
        pass

    def log(self, line: str) -> None:
        logger.info(line)

    def announce(self, line: str) -> None:
        logger.info(line)
