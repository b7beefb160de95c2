"""The estimate drift a commit round measures: how far θ̃_{t+1} landed from θ_{t+1} (metrics only)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Sequence

import torch

from ..comm import collectives
from . import chunking

if TYPE_CHECKING:
    from .buffers import BufferGroup


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
    next round reads them; :func:`drift_and_cosine`), ``before`` holding θ_t's shards. θ̃_{t+1} is what the compute lane runs on
    during the commit phase: the live weights (their shard is read here, not copied). Summed in fp64
    window by window (:func:`.chunking.windows`) through two reused chunk-sized buffers."""
    after = [v.reshape(-1) for g in groups for v in g.shard_values()]
    estimate = [v for g in groups for v in g.live_shard_views()]
    device = before[0].device
    numels = [t.numel() for t in after]
    size = min(chunk_elems, sum(numels))
    a = torch.empty(size, dtype=torch.float64, device=device)
    b = torch.empty(size, dtype=torch.float64, device=device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for window in chunking.windows(numels, chunk_elems):
        n = chunking.window_size(window)
        x, y = a.narrow(0, 0, n), b.narrow(0, 0, n)
        torch._foreach_copy_(chunking.slots_in(a, window), chunking.pieces_of(after, window))
        for k, other in enumerate((estimate, before)):
            torch._foreach_copy_(chunking.slots_in(b, window), chunking.pieces_of(other, window))
            y.sub_(x)
            sums[k] += torch.dot(y, y)
        # θ̃ − θ_t: a ← θ̃ (this window of the live shard), then minus θ_t
        torch._foreach_copy_(chunking.slots_in(a, window), chunking.pieces_of(estimate, window))
        torch._foreach_copy_(chunking.slots_in(b, window), chunking.pieces_of(before, window))
        x.sub_(y)
        sums[2] += torch.dot(x, x)
    return collectives.sum_scalars(sums, process_group)
