"""The one-round mode's predictors: the point P_{t+1} the whole of step t+1 is computed at (mode
``one_round``; docs/estimate.md, "One round per step: the predictors").

The commit round of step t-1 takes stock's step θ_t = Opt(θ_{t-1}, S_{t-1}, ḡ(P_{t-1})) on this rank's
shard, then writes P_{t+1}'s shard, not θ_t's, into its segment of B's gather view: the all-gather
carries P (DPU's bytes, no second round). What it reads is what that round holds: θ_{t-1} (before its
step), θ_t (after), P_t and the shard's optimizer state S_t. P_0 = P_1 = θ_0.

* ``ext c``: P_{t+1} = θ_t + c·(θ_t − θ_{t-1}). θ_{t-1} is kept, in fp32, in bytes of B that the round
  no longer needs (other ranks' segments of its reduce view, clear of this rank's gradient and of its
  gather segment: :func:`scratch_offset`); nothing is allocated.
* ``nag c``: P_{t+1} = θ_t − c·η·(wd·θ_t + m̂_t / (√v̂_t + ε)) from torch Adam / AdamW's committed m, v
  (wd: AdamW's decoupled decay only; m̂, v̂ bias-corrected for the shard's step count t ≥ 1; no state
  yet: P = θ_t). η: the rate of the round computing it (step t-1's, captured at its launch): the
  lane cannot read step t's without racing the scheduler; the same under a constant rate.
* ``ef γ``: P_{t+1} = θ_t + (θ_t − θ_{t-1}) + γ·(θ_t − P_t). One persistent fp32 buffer Q per rank,
  laid out like the shard (4 bytes per shard element): it holds P_t between rounds; before the step
  Q ← −(θ_{t-1} + γ·P_t), after it Q ← Q + (1+γ)·θ_t, then Q ← Q + θ_t = P_{t+1}. Checkpoints carry it.

A skipped commit (non-finite gradient) keeps θ_t = θ_{t-1} and still predicts from it. Every pass is
foreach kernels over the shard's tensors, in place (ext, ef) or window by window through two fp32
chunk-sized buffers (ext's difference, nag's denominator and result): no shard-sized temporary.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import chunking
from .chunking import local
from .functional_step import read_scalars, step_groups

PREDICTORS = {"ef": 0.5, "ext": 1.0, "nag": 1.0}
"""The predictors and their default coefficients (γ of ef, c of ext and nag)."""
FP32 = 4


def scratch_offset(rank: int, world: int, segment: int, comm_bytes: int, live_bytes: int,
                   comm_fp32: bool) -> Optional[int]:
    """A byte offset in B (``world × segment`` elements of the wider of ``comm_bytes`` and
    ``live_bytes``) where ``segment`` fp32 values fit clear of rank ``rank``'s gather segment and,
    when gradients are reduced in fp32 in place (``comm_fp32``), of its reduce segment; None: no room."""
    size = world * segment * max(comm_bytes, live_bytes)
    busy = [(live_bytes * rank * segment, live_bytes * (rank + 1) * segment)]
    if comm_fp32:
        busy.append((comm_bytes * rank * segment, comm_bytes * (rank + 1) * segment))
    need = FP32 * segment
    for start in sorted([0] + [-(-end // FP32) * FP32 for _, end in busy]):
        if start + need <= size and all(start + need <= lo or start >= hi for lo, hi in busy):
            return start
    return None


class Predictor:
    """P_{t+1} for a schedule's buffer groups: ``name`` (one of :data:`PREDICTORS`), ``coef`` its c / γ,
    ``chunk`` the rounds' window."""

    def __init__(self, name: str, coef: float, groups: Sequence, chunk: int):
        if name not in PREDICTORS:
            raise ValueError(f"predictor {name!r}: must be one of {sorted(PREDICTORS)}")
        self.name, self.coef, self.chunk = name, float(coef), chunk
        self.groups = list(groups)
        self.buffer: Optional[torch.Tensor] = None
        self.scratch: List[torch.Tensor] = []  # ext, during a round: θ_{t-1} in B
        sizes = [v.numel() for g in self.groups for v in g.shard_values()]
        if name == "ef":
            self.buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=self.groups[0].comm.device)
            self.start()
        self.offsets: List[int] = []  # ext: where θ_{t-1} goes in each group's B (its storage moves: see _scratch)
        if name == "ext":
            for g in self.groups:
                offset = scratch_offset(g.rank, g.world, g.segment, g.comm_dtype.itemsize, g.live_dtype.itemsize,
                                        g.comm_dtype == torch.float32)
                if offset is None:
                    raise ValueError("predictor 'ext' has no room in B for θ_{t-1} (refused at check point 2)")
                self.offsets.append(offset)

    def _scratch(self) -> List[torch.Tensor]:
        """ext: views of B's bytes at :attr:`offsets`, laid out like the shard values (rebuilt at each
        round: a commit may hand B G's storage, so B is not the same tensor from round to round)."""
        out = []
        for g, offset in zip(self.groups, self.offsets):
            region = g.comm[offset:offset + FP32 * g.segment].view(torch.float32)
            out += list(region.split([v.numel() for v in g.shard_values()]))
        return out

    @property
    def extra_bytes(self) -> int:
        """Bytes this rank holds for the predictor between rounds (ef's Q; none for ext and nag)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def _views(self) -> List[torch.Tensor]:
        sizes = [v.numel() for g in self.groups for v in g.shard_values()]
        return list(self.buffer.split(sizes)) if sizes else []

    def _thetas(self) -> List[torch.Tensor]:
        return [v.reshape(-1) for g in self.groups for v in g.shard_values()]

    def start(self) -> None:
        """P ← θ (the shards now): a fresh start (P_1 = θ_0), after a reset."""
        if self.buffer is not None:
            torch._foreach_copy_(self._views(), self._thetas())

    # -- the commit round ------------------------------------------------------------------------
    def before_step(self) -> None:
        """The shards still hold θ_{t-1}: keep what the prediction needs of it."""
        thetas = self._thetas()
        if not thetas:
            return
        if self.name == "ext":
            self.scratch = self._scratch()
            torch._foreach_copy_(self.scratch, thetas)
        elif self.name == "ef":
            q = self._views()
            torch._foreach_mul_(q, -self.coef)
            torch._foreach_sub_(q, thetas)  # Q = −(θ_{t-1} + γ·P_t)

    def after_step(self, outs: Sequence[torch.Tensor], optimizer, settings: Optional[Sequence[dict]],
                   lr_factor: float = 1.0) -> None:
        """The shards hold θ_t: write P_{t+1} into ``outs`` (laid out like the shard values: this rank's
        gather segments, the round's outputs)."""
        thetas = self._thetas()
        outs = [o.reshape(-1) for o in outs]
        if not thetas:
            return
        if self.name == "ef":
            q = self._views()
            torch._foreach_add_(q, thetas, alpha=1.0 + self.coef)
            torch._foreach_add_(q, thetas)  # P_{t+1}
            torch._foreach_copy_(outs, q)
        elif self.name == "ext":
            self._windows(thetas, outs, self._ext)
            self.scratch = []
        else:
            self._nag(optimizer, settings, lr_factor, thetas, outs)

    def _windows(self, thetas, outs, body) -> None:
        work = None
        numels = [t.numel() for t in thetas]
        for window in chunking.windows(numels, self.chunk):
            if work is None:
                work = torch.empty(min(self.chunk, sum(numels)), dtype=torch.float32, device=thetas[0].device)
            body(window, chunking.slots_in(work, window), chunking.pieces_of(thetas, window),
                 chunking.pieces_of(outs, window))

    def _ext(self, window, w, th, out) -> None:
        torch._foreach_copy_(w, th)
        torch._foreach_sub_(w, chunking.pieces_of(self.scratch, window))
        torch._foreach_mul_(w, self.coef)
        torch._foreach_add_(w, th)  # θ_t + c·(θ_t − θ_{t-1})
        torch._foreach_copy_(out, w)

    def _nag(self, optimizer, settings, lr_factor, thetas, outs) -> None:
        params = [p for g in self.groups for p in g.shard_params]
        group_of = {id(p): grp for grp in step_groups(optimizer, settings, lr_factor) for p in grp["params"]}
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        coefs = []
        steps = [(optimizer.state.get(p) or {}).get("step", 0) for p in params]
        counts = iter(read_scalars([s for s in steps if torch.is_tensor(s)]))
        steps = [next(counts) if torch.is_tensor(s) else float(s) for s in steps]
        ms, vs = [], []
        for p, th, s in zip(params, thetas, steps):
            grp, state = group_of[id(p)], optimizer.state.get(p) or {}
            if s < 1:  # no committed state yet: P = θ_t
                coefs.append(None)
                ms.append(th)
                vs.append(th)
                continue
            b1, b2 = grp["betas"]
            v = state["max_exp_avg_sq"] if grp.get("amsgrad") else state["exp_avg_sq"]
            step = self.coef * float(grp["lr"])
            wd = grp["weight_decay"] if (decoupled or grp.get("decoupled_weight_decay")) else 0.0
            coefs.append((1.0 - step * wd, -step / (1 - b1 ** s), (1 - b2 ** s) ** 0.5, grp["eps"]))
            ms.append(local(state["exp_avg"]).reshape(-1))
            vs.append(local(v).reshape(-1))
        numels = [t.numel() for t in thetas]
        size = min(self.chunk, sum(numels))
        denom = torch.empty(size, dtype=torch.float32, device=thetas[0].device)
        point = torch.empty(size, dtype=torch.float32, device=thetas[0].device)
        for window in chunking.windows(numels, self.chunk):
            d, pt = chunking.slots_in(denom, window), chunking.slots_in(point, window)
            torch._foreach_copy_(pt, chunking.pieces_of(thetas, window))
            live = [i for i, piece in enumerate(window) if coefs[piece.index] is not None]
            if live:
                cs = [coefs[window[i].index] for i in live]
                dl, pl = [d[i] for i in live], [pt[i] for i in live]
                torch._foreach_copy_(dl, [chunking.pieces_of(vs, window)[i] for i in live])
                torch._foreach_sqrt_(dl)
                torch._foreach_div_(dl, [c[2] for c in cs])  # √v̂
                torch._foreach_add_(dl, [c[3] for c in cs])
                torch._foreach_mul_(pl, [c[0] for c in cs])  # θ_t (1 − cη·wd)
                ml = [chunking.pieces_of(ms, window)[i] for i in live]
                torch._foreach_addcdiv_(pl, ml, dl, [c[1] for c in cs])  # − cη·m̂ / (√v̂ + ε)
            torch._foreach_copy_(chunking.pieces_of(outs, window), pt)

    # -- in-flight state ---------------------------------------------------------------------------
    def state(self) -> Optional[torch.Tensor]:
        """ef's P (this rank's shard, a CPU copy) for a checkpoint; None for ext and nag."""
        return None if self.buffer is None else self.buffer.detach().to("cpu", copy=True)

    def load(self, saved: Optional[torch.Tensor]) -> None:
        """Restore :meth:`state`'s output."""
        if self.buffer is None:
            return
        if saved is None or saved.numel() != self.buffer.numel():
            raise ValueError(f"ACCO in-flight state has no predictor 'ef' buffer of {self.buffer.numel()} elements "
                             "for this rank's shard")
        with torch.no_grad():
            self.buffer.copy_(saved)
