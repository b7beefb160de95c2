"""Delay compensation of the first-half gradients in the commit (``acco.estimate.delay_compensation``).

The recurrence (DC-ASGD-a; docs/estimate.md): the commit of step t pools, in place of the first-half
mean gradient ḡ̃_t (computed at θ̃_t, one step behind),

    ḡ̃_t + λ ḡ̃_t ⊙ ḡ̃_t ⊙ (θ_t − θ̃_t) / (√v̂_t + ε),    v̂_t = exp_avg_sq / (1 − β2^t),

v̂_t from the committed Adam state (each parameter with its own group's β2 and ε; no term for a
parameter without state yet, i.e. before the first commit), and then clips the pooled mean as usual.
The commit round reduces the whole step's sum Σg̃ + Σg, so the term enters its pooled mean ḡ_t with
the first half's share of the step's weight, W̃_t / W_t (1/2 in fixed mode):

    ḡ_t ← ḡ_t + (W̃_t / W_t) · λ · ḡ̃_t ⊙ ḡ̃_t ⊙ (θ_t − θ̃_t) / (√v̂_t + ε).

One fp32 buffer D per rank, laid out like this rank's shard (4 bytes per shard element, the only
shard-sized tensor this adds), carries the term from round to round:

  * commit t−1, after its step (skipped or not): D ← θ̃_t − θ_t, the estimate's lead, where θ̃_t is
    this rank's shard of the live weights during commit phase t−1 (what the estimate round wrote) and
    θ_t the new committed shard as the forward gets it (rounded to the model dtype): the two points
    at which step t's halves are computed;
  * estimate t, right after its mean: D ← D ⊙ ḡ̃_t ⊙ ḡ̃_t (a skipped estimate, non-finite ḡ̃_t:
    D ← 0, no compensation for that step);
  * commit t, after its mean and before its norm: ḡ_t ← ḡ_t − c · D / (√v̂_t + ε), c = λ W̃_t / W_t.

A step of the synchronous warm-up (``acco.sync_warmup_steps``) computes all its micro-batches at θ_t:
no term, and D stays 0 (its value at the start and after a reset), so ACCO's first step after the
warm-up starts from θ̃ = θ. D is in-flight state: checkpoints carry it (:meth:`state`).

Cost per round, on the shard of N_r elements, in windows of ``chunk`` elements: the estimate round 2
in-place foreach kernels over D; the commit round 6 foreach kernels per window (compensation) and 2 per
window for D's refresh (4 when the model dtype is narrower than the masters'), with at most one fp32
chunk and one model-dtype chunk as temporaries. No collective, and no host read on the CPU (Adam's
step counts are host tensors; a fused Adam's are read once per round, as its estimate does).
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch

from . import chunking
from .chunking import local
from .functional_step import read_scalars, step_groups

logger = logging.getLogger("ds_acco")


class DelayCompensation:
    """D and the three updates above for a schedule's buffer groups; ``lam`` is λ > 0."""

    def __init__(self, groups: Sequence, lam: float):
        if not lam > 0:
            raise ValueError(f"delay compensation needs λ > 0, got {lam!r}")
        self.lam = float(lam)
        self.groups = list(groups)
        numels = [[v.numel() for v in g.shard_values()] for g in self.groups]
        device = self.groups[0].comm.device
        self.buffer = torch.zeros(sum(map(sum, numels)), dtype=torch.float32, device=device)
        self.views: List[List[torch.Tensor]] = []  # per group, laid out like its shard values (flat)
        start = 0
        for sizes in numels:
            self.views.append([self.buffer.narrow(0, s, n) for s, n in zip(_starts(start, sizes), sizes)])
            start += sum(sizes)

    # -- the estimate round -----------------------------------------------------------------------
    def weigh(self, grads: Sequence[Sequence[torch.Tensor]]) -> None:
        """D ← D ⊙ ḡ̃ ⊙ ḡ̃, with ``grads`` the estimate round's mean gradient (per group, laid out like
        the shard values, fp32)."""
        for d, g in zip(self.views, grads):
            if d:
                flat = [x.reshape(-1) for x in g]
                torch._foreach_mul_(d, flat)
                torch._foreach_mul_(d, flat)

    def clear(self) -> None:
        """D ← 0: no compensation for the step (a skipped estimate; a fresh start)."""
        self.buffer.zero_()

    # -- the commit round -------------------------------------------------------------------------
    def compensate(self, grads: Sequence[Sequence[torch.Tensor]], optimizer, settings: Optional[Sequence[dict]],
                   scale: torch.Tensor, chunk: int) -> None:
        """ḡ ← ḡ − scale · D / (√v̂ + ε) for every shard parameter with Adam state (v̂ = exp_avg_sq /
        (1 − β2^t), its group's β2 and ε from ``settings``, the round's captured settings).
        ``scale``: λ W̃ / W as a 0-dim tensor on the device (W, the commit's total weight, stays there)."""
        params = [p for g in self.groups for p in g.shard_params]
        flat_grads = [x.reshape(-1) for gs in grads for x in gs]
        ds = [d for views in self.views for d in views]
        group_of = {id(p): group for group in step_groups(optimizer, settings) for p in group["params"]}
        items, steps = [], []
        for p, g, d in zip(params, flat_grads, ds):
            state = optimizer.state.get(p) or {}
            v, step = state.get("exp_avg_sq"), state.get("step")
            if v is None or step is None or d.numel() == 0:
                continue  # no committed second moment yet: no term (before the first commit)
            items.append((local(v).reshape(-1), g, d, group_of[id(p)]))
            steps.append(step)
        counts = iter(read_scalars([s for s in steps if torch.is_tensor(s)]))
        steps = [next(counts) if torch.is_tensor(s) else float(s) for s in steps]
        kept = [(it, s) for it, s in zip(items, steps) if s >= 1]
        if not kept:
            return
        vs, gs, dl = ([it[k] for it, _ in kept] for k in range(3))
        eps = [it[3]["eps"] for it, _ in kept]
        bias2 = [(1 - it[3]["betas"][1] ** s) ** 0.5 for it, s in kept]
        scale = scale.to(torch.float32)
        work = None
        for window in chunking.windows([v.numel() for v in vs], chunk):
            if work is None:
                work = torch.empty(min(chunk, sum(v.numel() for v in vs)), dtype=torch.float32, device=vs[0].device)
            w = chunking.slots_in(work, window)
            torch._foreach_copy_(w, chunking.pieces_of(vs, window))
            torch._foreach_sqrt_(w)
            torch._foreach_div_(w, [bias2[p.index] for p in window])  # √v̂ = √v / √(1 − β2^t)
            torch._foreach_add_(w, [eps[p.index] for p in window])
            torch._foreach_div_(w, scale)
            torch._foreach_addcdiv_(chunking.pieces_of(gs, window), chunking.pieces_of(dl, window), w, value=-1.0)

    def refresh(self, chunk: int) -> None:
        """D ← θ̃ − θ after a commit: the live weights' shard (the estimate the commit phase runs at)
        minus the committed shard rounded to the model dtype (the weights the next phase runs at)."""
        for g, d in zip(self.groups, self.views):
            if not d:
                continue
            theta = [v.reshape(-1) for v in g.shard_values()]
            live = [v.reshape(-1) for v in g.live_shard_views()]
            rounded = theta[0].dtype != live[0].dtype  # θ as the forward gets it
            fp32 = live[0].dtype != torch.float32
            size = min(chunk, sum(x.numel() for x in d))
            as_live = torch.empty(size, dtype=live[0].dtype, device=d[0].device) if rounded else None
            as_fp32 = torch.empty(size, dtype=torch.float32, device=d[0].device) if fp32 else None
            for window in chunking.windows([x.numel() for x in d], chunk):
                dst = chunking.pieces_of(d, window)
                torch._foreach_copy_(dst, chunking.pieces_of(live, window))
                src = chunking.pieces_of(theta, window)
                if rounded:
                    torch._foreach_copy_(chunking.slots_in(as_live, window), src)
                    src = chunking.slots_in(as_live, window)
                if fp32:
                    torch._foreach_copy_(chunking.slots_in(as_fp32, window), src)
                    src = chunking.slots_in(as_fp32, window)
                torch._foreach_sub_(dst, src)

    # -- in-flight state --------------------------------------------------------------------------
    def state(self) -> torch.Tensor:
        """D (this rank's, a CPU copy) for a checkpoint."""
        return self.buffer.detach().to("cpu", copy=True)

    def load(self, saved: Optional[torch.Tensor]) -> None:
        """Restore :meth:`state`'s output; None (a checkpoint saved without delay compensation): D ← 0,
        so the step in flight is committed without its compensation (said once in the log)."""
        if saved is None:
            logger.warning("ACCO: the checkpoint was saved without acco.estimate.delay_compensation: the step in "
                           "flight is committed without its compensation")
            self.clear()
            return
        if saved.numel() != self.buffer.numel():
            raise ValueError(f"delay compensation state of {saved.numel()} elements, this rank's shard has "
                             f"{self.buffer.numel()}")
        with torch.no_grad():
            self.buffer.copy_(saved)


def _starts(first: int, sizes: Sequence[int]) -> List[int]:
    out, at = [], first
    for n in sizes:
        out.append(at)
        at += n
    return out
