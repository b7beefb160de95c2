"""Collectives as plain functions of tensors and a process group.

The backend decides the reduce: NCCL gets a real reduce-scatter; gloo's reduce-scatter is an
all-reduce plus a copy that only lands inside ``wait()`` (PLATFORM_NOTES.md), so on gloo we
all-reduce the flat buffer in place and take our slice of it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor collectives (the old names are deprecated there); older releases,
# e.g. the 2.11 on our GPU machine, have only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def uses_reduce_scatter(group) -> bool:
    """True when the group's backend has a reduce-scatter that is cheaper than an all-reduce."""
    return dist.get_backend(group) not in ("gloo", )


def reduce_in_place(flat: torch.Tensor, rank: int, world: int, group, reduce_scatter: bool) -> torch.Tensor:
    """Sum ``flat`` over the group so that this rank's segment (``len(flat) // world`` elements,
    returned as a view) holds the sum. With ``reduce_scatter`` an in-place reduce-scatter (the
    other segments are left undefined); otherwise an in-place all-reduce (all of ``flat`` holds
    the sum). No temporary either way."""
    part = flat.numel() // world
    mine = flat.narrow(0, rank * part, part)
    if reduce_scatter:
        _reduce_scatter(mine, flat, group=group)
    else:
        dist.all_reduce(flat, group=group)
    return mine


def gather_in_place(flat: torch.Tensor, rank: int, world: int, group, chunk_elems: int = 1 << 21) -> None:
    """All-gather every rank's segment of ``flat`` (rank order), this rank's being read in place.

    NCCL gathers into ``flat`` directly. gloo's all-gather gathers into a new tensor as large as
    its output and then copies it out: a full-size temporary (measured: +1 model size of peak
    RSS per call). On gloo the segments therefore travel in pieces through one buffer of at
    most ``chunk_elems`` elements: several calls instead of one, the same bytes."""
    part = flat.numel() // world
    if not uses_reduce_scatter(group):  # gloo
        per_call = max(1, chunk_elems // world)
        if per_call < part:
            rows = flat.view(world, part)
            out = torch.empty(world * per_call, dtype=flat.dtype, device=flat.device)
            for start in range(0, part, per_call):
                n = min(per_call, part - start)
                piece = out.narrow(0, 0, world * n)
                _all_gather(piece, rows[rank].narrow(0, start, n), group=group)
                rows[:, start:start + n].copy_(piece.view(world, n))
            return
    _all_gather(flat, flat.narrow(0, rank * part, part), group=group)


def gather_shards(shard: torch.Tensor, flat: torch.Tensor, group) -> None:
    """All-gather equal shards into ``flat`` (rank order)."""
    _all_gather(flat, shard, group=group)


def sum_scalars(values: torch.Tensor, group) -> torch.Tensor:
    """All-reduce a small tensor of scalars (counts, squared norms) in place and return it."""
    dist.all_reduce(values, group=group)
    return values
