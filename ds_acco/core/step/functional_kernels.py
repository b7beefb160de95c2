"""The kernels of the functional steps (:mod:`.functional_step`): torch's SGD and Adam / AdamW, op
for op, as foreach kernels over windows of the shard (:mod:`.chunking`), through a reused
workspace; torch's fused Adam / AdamW as its own fused kernel on workspace copies. One code path
serves the estimate (θ̃ into an output, state only read) and the commit (θ and the moments in
place).

A window holds pieces of many tensors; the pieces that share a param group and a state layout
form a :class:`_Batch`, and every operation of the step is one ``torch._foreach_*`` call over the
batch's pieces. A round therefore launches a number of kernels that follows the windows (size /
chunk) and the param groups, not the number of parameter tensors. On CPU the foreach ops run the
single-tensor op on each piece; on accelerators they are the kernels torch's foreach step uses.
Either way the result is bit-identical to torch's step (its single-tensor and foreach variants
compute the same ops in the same order).

The per-tensor helpers at the end (:func:`chunk_ranges`, :func:`copy_chunked`, :meth:`Workspace.get`)
serve DeepSpeed's Adams (:mod:`ds_acco.deepspeed.functional`), which stay per chunk: their emulation
needs float64 FMAs and a per-tensor SIMD tail, and DeepSpeed's masters are one flat tensor per
param group, so their kernel count does not grow with the number of parameters anyway.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .chunking import Piece, local, pieces_of, window_size, windows


def flat_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a flat tensor outside autograd (a flat one that needs no grad as it is: views are
    no kernels, but hundreds of them per round cost the lane's thread time)."""
    if not t.is_contiguous():
        raise ValueError(f"the {what} must be contiguous (chunks are flat views)")
    if t.dim() == 1 and not t.requires_grad:
        return t
    return t.detach().view(-1)


class Workspace:
    """Chunk-sized scratch buffers, allocated on first use and reused for every window (or chunk).
    ``total``: the elements the call walks through (buffers are never larger)."""

    def __init__(self, chunk: int, total: Optional[int] = None):
        self.chunk = chunk
        self.size = chunk if total is None else max(1, min(chunk, total))
        self._bufs: Dict[Tuple, torch.Tensor] = {}

    def _buffer(self, slot: int, dtype: torch.dtype, device: torch.device, need: int, first: int) -> torch.Tensor:
        key = (slot, dtype, device)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(first, dtype=dtype, device=device)
        elif buf.numel() < need:  # a larger parameter after a smaller one (per-tensor use)
            buf = self._bufs[key] = torch.empty(self.chunk, dtype=dtype, device=device)
        return buf

    def slots(self, slot: int, dtype: torch.dtype, device: torch.device, window: Sequence[Piece]) -> List[torch.Tensor]:
        """Each piece's place in buffer ``slot``, as views."""
        buf = self._buffer(slot, dtype, device, window_size(window), self.size)
        return [buf.narrow(0, p.at, p.n) for p in window]

    def get(self, slot: int, like: torch.Tensor, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``n`` elements of buffer ``slot`` (per-tensor chunks)."""
        buf = self._buffer(slot, dtype or like.dtype, like.device, n, min(self.chunk, like.numel()))
        return buf.narrow(0, 0, n)


class StepItem:
    """One parameter of a functional step: flat local views of θ, its gradient (None: none this
    step), where θ̃ goes (the estimate; θ itself for the commit), its state, and its step count
    as the step will use it (Adam)."""

    __slots__ = ("param", "grad", "out", "group", "state", "step", "fresh", "key")

    def __init__(self, param: torch.Tensor, grad: Optional[torch.Tensor], out: torch.Tensor, group: dict,
                 group_index: int, state: dict, fresh: bool = False):
        self.param, self.grad, self.out, self.group, self.fresh = param, grad, out, group, fresh
        self.state = {k: flat_view(local(v), f"state '{k}'") for k, v in state.items()
                      if torch.is_tensor(v) and k != "step"}
        self.step: Optional[float] = None
        # pieces that share a key run as one batch: same settings, state layout and dtypes
        self.key = (group_index, grad is None, param.dtype, out.dtype, fresh, tuple(sorted(self.state)))

    @property
    def numel(self) -> int:
        return self.param.numel()


class _Batch:
    """The pieces of one window that share a key (param group, state layout, dtypes): lists of
    views, one per piece, for the foreach ops."""

    def __init__(self, items: Sequence[StepItem], window: Sequence[Piece], ws: Workspace):
        self.window = [Piece(i, p.start, p.n, p.at) for i, p in enumerate(window)]
        self.items = [items[p.index] for p in window]
        first = self.items[0]
        self.group, self.dtype, self.device = first.group, first.param.dtype, first.param.device
        self.ws = ws
        self.param = self.pieces([it.param for it in self.items])
        self.out = self.pieces([it.out for it in self.items])
        self.grad = None if first.grad is None else self.pieces([it.grad for it in self.items])
        self._scratch: Dict[int, List[torch.Tensor]] = {}

    def pieces(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return pieces_of(tensors, self.window)

    def state(self, key: str) -> Optional[List[torch.Tensor]]:
        """The pieces of state tensor ``key``; None when the parameters have none yet."""
        if key not in self.items[0].state:
            return None
        return self.pieces([it.state[key] for it in self.items])

    def scratch(self, slot: int) -> List[torch.Tensor]:
        """The pieces' places in workspace buffer ``slot`` (the parameter's dtype)."""
        if slot not in self._scratch:
            self._scratch[slot] = self.ws.slots(slot, self.dtype, self.device, self.window)
        return self._scratch[slot]

    def steps(self) -> List[float]:
        return [it.step for it in self.items]


def run_windows(items: Sequence[StepItem], chunk: int, kernel, commit: bool) -> None:
    """``kernel(batch)`` on every batch of every window, in order. Estimate: ``kernel`` returns the
    pieces holding θ̃ (a parameter without a gradient keeps θ); once every batch of the window has
    read its gradients, θ̃ not already in the outputs is copied there (an output may lie over
    gradients of the same window: θ̃ written over the reduced gradients in B)."""
    ws = Workspace(chunk, sum(it.numel for it in items))
    for window in windows([it.numel for it in items], chunk):
        batches: Dict[tuple, List[Piece]] = {}
        for p in window:
            batches.setdefault(items[p.index].key, []).append(p)
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        for pieces in batches.values():
            b = _Batch(items, pieces, ws)
            if b.grad is None:
                if not commit:  # no gradient: θ̃ = θ
                    dst += b.out
                    src += b.param
                continue
            result = kernel(b)
            if not commit and result is not b.out:
                dst += b.out
                src += result
        if dst:
            torch._foreach_copy_(dst, src)


# -- torch.optim.SGD: _single_tensor_sgd / _multi_tensor_sgd -----------------------------------
# Estimate (commit=False): the result goes to the output or the workspace, the new momentum to
# the workspace, the state is only read. Commit: the same ops write the new momentum over the
# state and the result over the parameter, after every read of it.
def sgd(b: _Batch, commit: bool = False) -> List[torch.Tensor]:
    """``item.fresh`` (commit only): the momentum buffer was just created and is to be filled with
    the first gradient, as the step's ``grad.clone()``."""
    group = b.group
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
    grad = b.grad
    if maximize:
        grad = _into_scratch(b, grad)
        torch._foreach_neg_(grad)
    if wd != 0:
        grad = _into_scratch(b, grad)
        torch._foreach_add_(grad, b.param, alpha=wd)
    if momentum != 0:
        bufs = b.state("momentum_buffer")
        if bufs is None:
            buf = grad  # first step: the buffer is a clone of the gradient
        elif b.items[0].fresh:
            torch._foreach_copy_(bufs, grad)
            buf = bufs
        else:
            buf = bufs if commit else b.scratch(1)
            if not commit:
                torch._foreach_copy_(buf, bufs)
            torch._foreach_mul_(buf, momentum)
            torch._foreach_add_(buf, grad, alpha=1 - dampening)
        if nesterov:
            grad = _into_scratch(b, grad)
            torch._foreach_add_(grad, buf, alpha=momentum)
        else:
            grad = buf
    if commit:
        torch._foreach_add_(b.param, grad, alpha=-lr)
        return b.param
    # the output may be the gradient's memory: computed elsewhere while the raw gradient is read
    tgt = b.out if b.out[0].dtype == b.dtype and grad is not b.grad else b.scratch(2)
    torch._foreach_copy_(tgt, b.param)
    torch._foreach_add_(tgt, grad, alpha=-lr)
    return tgt


def _into_scratch(b: _Batch, grad: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradient in workspace slot 0, where it may be modified (copied there if not yet)."""
    gb = b.scratch(0)
    if grad is not gb:
        torch._foreach_copy_(gb, grad)
    return gb


# -- torch.optim.Adam / AdamW: _single_tensor_adam / _multi_tensor_adam (not capturable) ----
COMMITTED_SECOND_MOMENT = "_acco_committed_second_moment"
"""A key of the step's group view (never of the optimizer's own groups): the estimate reuses the
committed second moment v_t, bias-corrected for the t committed steps, instead of updating it with
the estimate's gradient (``acco.estimate.second_moment = 'committed'``). Without state yet (t = 0)
it is the ordinary estimate."""


def adam(b: _Batch, commit: bool = False) -> List[torch.Tensor]:
    """Commit: exp_avg, exp_avg_sq (and max_exp_avg_sq) exist (zeros on the first step, as
    ``_init_group`` makes them) and are updated in place; ``item.step`` is the step count after
    this step's increment. Estimate with :data:`COMMITTED_SECOND_MOMENT` in the group: v̂ is
    v_t / (1 − β2^t), read, never updated (the first moment is updated as usual)."""
    group = b.group
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    amsgrad, maximize = group["amsgrad"], group["maximize"]
    decoupled = group.get("decoupled_weight_decay", False)
    exp_avg, exp_avg_sq = b.state("exp_avg"), b.state("exp_avg_sq")
    max_exp_avg_sq = b.state("max_exp_avg_sq") if amsgrad else None
    committed_v = not commit and bool(group.get(COMMITTED_SECOND_MOMENT)) and exp_avg_sq is not None
    steps = b.steps()
    neg_step_size = [-(lr / (1 - beta1 ** s)) for s in steps]
    bias_correction2_sqrt = [(1 - beta2 ** (s - 1 if committed_v else s)) ** 0.5 for s in steps]
    grad = b.grad
    if maximize:
        grad = _into_scratch(b, grad)
        torch._foreach_neg_(grad)
    if wd != 0 and not decoupled:
        grad = _into_scratch(b, grad)
        torch._foreach_add_(grad, b.param, alpha=wd)
    if commit:  # the new moments over the state they are computed from
        m, v = exp_avg, exp_avg_sq
    elif committed_v:  # v_t as it is: only read
        m, v = b.scratch(1), exp_avg_sq
        torch._foreach_copy_(m, exp_avg)
    else:
        m, v = b.scratch(1), b.scratch(2)
        if exp_avg is None:  # lazy state init: zeros, then the same in-place updates
            torch._foreach_zero_(m)
            torch._foreach_zero_(v)
        else:
            torch._foreach_copy_(m, exp_avg)
            torch._foreach_copy_(v, exp_avg_sq)
    torch._foreach_lerp_(m, grad, 1 - beta1)
    if not committed_v:
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grad, grad, value=1 - beta2)
    # The gradient is no longer needed: from here on the output may be written (it may be the
    # gradient's own memory), and slot 0 is free for the denominator.
    denom = b.scratch(0)
    if not amsgrad:
        torch._foreach_copy_(denom, v)
    elif commit:
        torch._foreach_maximum_(max_exp_avg_sq, v)
        torch._foreach_copy_(denom, max_exp_avg_sq)
    else:  # max(max_exp_avg_sq, v) without writing the state (a new state's max is zeros)
        if max_exp_avg_sq is None:
            torch._foreach_zero_(denom)
        else:
            torch._foreach_copy_(denom, max_exp_avg_sq)
        torch._foreach_maximum_(denom, v)
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    if commit:
        tgt = b.param
    else:
        tgt = b.out if b.out[0].dtype == b.dtype else b.scratch(3)
        torch._foreach_copy_(tgt, b.param)
    if wd != 0 and decoupled:
        torch._foreach_mul_(tgt, 1 - lr * wd)
    torch._foreach_addcdiv_(tgt, m, denom, neg_step_size)
    return tgt


# -- torch.optim.Adam / AdamW with fused=True: torch._fused_adam_ / _fused_adamw_ --------------
def fused_adam_estimate(b: _Batch, step_tensors: Dict[int, torch.Tensor]) -> List[torch.Tensor]:
    """θ̃ of the fused step: its own kernel run on workspace copies of θ and the moments, with
    the step counts after this step's increment (``step_tensors``: per item id, on the device).
    The kernel is elementwise and windows split tensors only at :data:`.chunking.ALIGN`, so every
    element is computed as in the whole-tensor step (CPU: the same vector / scalar-tail split)."""
    group = b.group
    amsgrad = group["amsgrad"]
    theta, m, v = b.scratch(0), b.scratch(1), b.scratch(2)
    torch._foreach_copy_(theta, b.param)
    moments = [(m, b.state("exp_avg")), (v, b.state("exp_avg_sq"))]
    if amsgrad:
        moments.append((b.scratch(3), b.state("max_exp_avg_sq")))
    for dst, src in moments:
        if src is None:  # lazy state init: zeros
            torch._foreach_zero_(dst)
        else:
            torch._foreach_copy_(dst, src)
    fused_adam_step(group, theta, b.grad, m, v, moments[2][0] if amsgrad else [],
                    [step_tensors[id(it)] for it in b.items])
    return theta


def fused_adam_step(group: dict, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
    """torch's ``_fused_adam`` for one param group, steps already incremented (one kernel)."""
    beta1, beta2 = group["betas"]
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"], lr=group["lr"],
           beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
           maximize=group["maximize"], grad_scale=None, found_inf=None)


# -- per-tensor chunks, for DeepSpeed's Adams (ds_acco/deepspeed/functional.py) ---------------
def chunk_ranges(n: int, chunk: int):
    """``(start, length)`` of each chunk of ``n`` elements, in order (the last one may be shorter)."""
    for s in range(0, n, chunk):
        yield s, min(chunk, n - s)


def copy_chunked(src: torch.Tensor, dst: torch.Tensor, chunk: int) -> None:
    """``dst ← src`` (flat), one chunk at a time."""
    for s, n in chunk_ranges(src.numel(), chunk):
        dst.narrow(0, s, n).copy_(src.narrow(0, s, n))

