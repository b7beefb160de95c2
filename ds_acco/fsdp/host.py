"""The driver's host for FSDP2: what ``AccoFSDP`` gives the core (core/lifecycle/host.py) and its side of a commit."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..core.checks.refusals import refuse
from ..core.lifecycle.host import CommitEvent, forwarded, publish_commit

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

    def __init__(self, adapter, process_group: Any, gradient_accumulation_steps: int, clip_grad: float,
                 micro_batch_size: int = 1):
        self.adapter = adapter
        self.micro_batch_size = micro_batch_size
        self.groups = [adapter.buffers]
        self.optimizer = adapter.optimizer
        self.process_group = process_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_grad = clip_grad
        self.device = adapter.buffers.grads.device
        self._step = None if adapter.lr_scheduler is None else adapter.lr_scheduler.step

    global_steps = forwarded("adapter", "global_steps")
    skipped_steps = forwarded("adapter", "skipped_steps")

    global_samples = forwarded("adapter", "global_samples")

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

    def on_commit(self, event: CommitEvent) -> None:
        """A commit's effects on the adapter, in the Host protocol's order."""
        adapter = self.adapter
        if event.skipped:
            adapter.skipped_steps += 1
        adapter.global_samples += event.samples(self.micro_batch_size)
        adapter.global_steps += 1
        publish_commit(event, self.monitor, adapter.global_samples, self.log)

    def log(self, line: str) -> None:
        logger.info(line)

    def announce(self, line: str) -> None:
        logger.info(line)


def micro_batch_size(config: dict, gradient_accumulation_steps: int, world: int) -> int:
    """The samples of one micro-batch, as DeepSpeed reads them from its config:
    ``train_micro_batch_size_per_gpu``, else ``train_batch_size`` / (``gradient_accumulation_steps`` x
    the data-parallel size); with neither, 1 (a micro-batch counts as one sample). Values DeepSpeed
    would not run (not a whole number >= 1 per micro-batch, or both keys given and disagreeing) are
    refused (row ``fsdp_batch_size``)."""
    micro, train = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
    per_rank = gradient_accumulation_steps * world
    if micro is None and train is not None:
        if not _whole(train) or train % per_rank:
            raise refuse("fsdp_batch_size", f"train_batch_size = {train!r} is not a multiple of "
                                            f"gradient_accumulation_steps x data-parallel size = {per_rank}")
        micro = train // per_rank
    if micro is None:
        return 1
    if not _whole(micro) or micro < 1:
        raise refuse("fsdp_batch_size", f"train_micro_batch_size_per_gpu = {micro!r} is not an integer >= 1")
    if train is not None and train != micro * per_rank:  # DeepSpeed's own batch assertion
        raise refuse("fsdp_batch_size", f"train_batch_size = {train!r} != train_micro_batch_size_per_gpu x "
                                        f"gradient_accumulation_steps x data-parallel size = {micro} x "
                                        f"{gradient_accumulation_steps} x {world} = {micro * per_rank}")
    return micro


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
