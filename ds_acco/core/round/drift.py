"""The estimate drift a commit round measures: how far θ̃_{t+1} landed from θ_{t+1} (metrics only).

Sampled (``acco.metrics.estimate_drift_every``): only the commits of the steps it names pay for it.
A sampled commit keeps θ_t in another rank's segment of B (free until the all-gather) and, after
its step, makes one fused pass over the shard window by window (:func:`drift_sums`): no
shard-sized temporary, two fp32 chunk-sized buffers.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Sequence

import torch

from ...comm import collectives
from ..step import chunking

if TYPE_CHECKING:
    from .buffers import BufferGroup


def sampled(step: int, every: int) -> bool:
    """Whether the commit of optimizer step ``step`` measures the drift: every ``every``-th step from
    step 0 (0: never, 1: every commit)."""
    return every > 0 and step % every == 0


def drift_and_cosine(miss_sq: float, commit_sq: float, estimate_sq: float) -> tuple:
    """From ‖θ̃ − θ_{t+1}‖², ‖θ_{t+1} − θ_t‖², ‖θ̃ − θ_t‖²: the drift ‖θ̃ − θ_{t+1}‖ / ‖θ_{t+1} − θ_t‖
    and the cosine between the estimate's update θ̃ − θ_t and the commit's θ_{t+1} − θ_t (law of
    cosines: the three vectors form a triangle). NaN where an update is zero."""
    nan = float("nan")
    drift = math.sqrt(miss_sq) / math.sqrt(commit_sq) if commit_sq > 0 else nan
    denom = 2 * math.sqrt(commit_sq) * math.sqrt(estimate_sq)
    cos = (commit_sq + estimate_sq - miss_sq) / denom if denom > 0 else nan
    return drift, cos


def drift_sums(groups: Sequence[BufferGroup], before: List[torch.Tensor], chunk_elems: int,
               process_group) -> torch.Tensor:
    """(‖θ̃_{t+1} − θ_{t+1}‖², ‖θ_{t+1} − θ_t‖², ‖θ̃_{t+1} − θ_t‖²) over all ranks, on the device (the
    next round reads them; :func:`drift_and_cosine`), ``before`` holding θ_t's shards. θ̃_{t+1} is
    what the compute lane runs on during the commit phase: the live weights (their shard is read
    here, not copied).

    One fused pass, window by window (:func:`.chunking.windows`) through two reused fp32 chunk-sized
    buffers: s ← θ_{t+1} − θ_t and m ← θ̃ − θ_{t+1} (a copy and a subtraction each, one foreach
    kernel per window), then the three dot products s·s, m·m, s·m, summed into fp64 scalars; the
    estimate's ‖θ̃ − θ_t‖² = ‖s + m‖² = s·s + m·m + 2 s·m. Per element it reads θ_{t+1} twice, θ_t
    and θ̃ once and touches each buffer four times: about a third of the bytes of the fp64 passes
    it replaces."""
    after = [v.reshape(-1) for g in groups for v in g.shard_values()]
    estimate = [v for g in groups for v in g.live_shard_views()]
    device = before[0].device
    numels = [t.numel() for t in after]
    size = min(chunk_elems, sum(numels))
    s_buf = torch.empty(size, dtype=torch.float32, device=device)
    m_buf = torch.empty(size, dtype=torch.float32, device=device)
    dots = torch.zeros(3, dtype=torch.float64, device=device)  # m·m, s·s, s·m
    for window in chunking.windows(numels, chunk_elems):
        n = chunking.window_size(window)
        s_slots, m_slots = chunking.slots_in(s_buf, window), chunking.slots_in(m_buf, window)
        mine = chunking.pieces_of(after, window)
        torch._foreach_copy_(s_slots, mine)
        torch._foreach_sub_(s_slots, chunking.pieces_of(before, window))
        torch._foreach_copy_(m_slots, chunking.pieces_of(estimate, window))
        torch._foreach_sub_(m_slots, mine)
        s, m = s_buf.narrow(0, 0, n), m_buf.narrow(0, 0, n)
        dots[0] += torch.dot(m, m)
        dots[1] += torch.dot(s, s)
        dots[2] += torch.dot(s, m)
    sums = torch.stack([dots[0], dots[1], dots[0] + dots[1] + 2 * dots[2]])
    return collectives.sum_scalars(sums, process_group)
