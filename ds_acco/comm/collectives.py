"""Collectives as plain functions of tensors and a process group.

The backend decides the reduce: NCCL gets a real reduce-scatter; gloo's reduce-scatter is an
all-reduce plus a copy that only lands inside ``wait()`` (PLATFORM_NOTES.md), so on gloo we
all-reduce the flat buffer in place and take our slice of it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def uses_reduce_scatter(group) -> bool:
    """True when the group's backend has a reduce-scatter that is cheaper than an all-reduce."""
    return dist.get_backend(group) not in ("gloo", )


def reduce_to_shard(flat: torch.Tensor, rank: int, world: int, group, reduce_scatter: bool) -> torch.Tensor:
    """Sum ``flat`` over the group; return this rank's slice of the sum (len(flat) // world).

    With ``reduce_scatter`` False, ``flat`` is overwritten by the full sum and the returned
    tensor is a view into it.
    """
    part = flat.numel() // world
    if reduce_scatter:
        out = torch.empty(part, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(out, flat, group=group)
        return out
    dist.all_reduce(flat, group=group)
    return flat.narrow(0, rank * part, part)


def gather_shards(shard: torch.Tensor, flat: torch.Tensor, group) -> None:
    """All-gather equal shards into ``flat`` (rank order)."""
    dist.all_gather_single(flat, shard, group=group)


def sum_scalars(values: torch.Tensor, group) -> torch.Tensor:
    """All-reduce a small tensor of scalars (counts, squared norms) in place and return it."""
    dist.all_reduce(values, group=group)
    return values
