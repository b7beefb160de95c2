"""What ACCO warns about (and then runs differently), kept apart from what it refuses: one table of
:class:`~.refusals.Row` records (the setting, why, the fix) that are logged, never raised.

A warning changes how a run goes (``one_hardware_queue``: the rounds run synchronously) but lets it
go; a refusal (:mod:`.refusals`) stops it with an ``AccoRefusal``. Nothing here raises.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from .refusals import Row

_ROWS = (
    Row("one_hardware_queue", "overlapped rounds on one hardware queue (run synchronously instead: a warning)",
        "a round's collectives, launched from the communication thread, and any collective the compute side "
        "launches on another process group meanwhile (tensor parallelism, FSDP's all-gathers, a loss averaged "
        "for logging) would share it in an order that differs between ranks, which can deadlock across ranks. "
        "The rounds therefore run synchronously (acco.synchronous = true): correct, but nothing overlaps",
        "unset CUDA_DEVICE_MAX_CONNECTIONS for ACCO runs (Megatron-DeepSpeed needs it only for "
        "--sequence-parallel)"),
)
WARNINGS: Dict[str, Row] = {r.key: r for r in _ROWS}


def one_hardware_queue(device: torch.device) -> bool:
    """Whether ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's launch scripts export it) gives this
    accelerator one hardware queue, shared by every stream."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    return device.type != "cpu" and value.isdigit() and int(value) == 1


def one_queue_serialisation(device: torch.device, synchronous: bool) -> Optional[str]:
    """Why the rounds must run synchronously here, or None (docs/collective_order.md).

    With one hardware queue, a round's collectives (the lane's communicator, launched from the
    lane's thread) and a collective the compute side launches on another communicator while the
    round is in flight (a tensor-parallel all-reduce, FSDP's all-gather, a loss averaged for
    logging) sit in one FIFO in an order that differs from rank to rank; each waits at the head of
    the queue for a kernel queued behind the other on its peer: a deadlock across ranks. Run
    synchronously, every rank launches the rounds' collectives from the compute thread in program
    order. The caller makes the rounds synchronous and warns with this text (a warning row: never
    raised)."""
    if synchronous or not one_hardware_queue(device):
        return None
    return WARNINGS["one_hardware_queue"].message(
        "ACCO: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch scripts export it) gives the device one hardware "
        "queue")
