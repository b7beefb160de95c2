"""The per-chunk kernels of the functional steps (:mod:`.functional_step`): torch's single-tensor
SGD and Adam / AdamW, op for op, on flat chunks through a reused workspace. One code path serves
the estimate (θ̃ into an output, state only read) and the commit (θ and the moments in place)."""
from __future__ import annotations

import struct
from typing import Dict, Optional, Tuple

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"the {what} must be contiguous (chunks are flat views)")
    return t.detach().view(-1)


def _copy_chunked(src: torch.Tensor, dst: torch.Tensor, chunk: int) -> None:
    for s in range(0, src.numel(), chunk):
        n = min(chunk, src.numel() - s)
        dst.narrow(0, s, n).copy_(src.narrow(0, s, n))


class _Workspace:
    """Chunk-sized scratch buffers, allocated on first use and reused for every chunk."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self._bufs: Dict[Tuple, torch.Tensor] = {}

    def get(self, slot: int, like: torch.Tensor, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = dtype or like.dtype
        key = (slot, dtype, like.device)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(min(self.chunk, like.numel()), dtype=dtype, device=like.device)
        elif buf.numel() < n:  # a larger parameter after a smaller one
            buf = self._bufs[key] = torch.empty(self.chunk, dtype=dtype, device=like.device)
        return buf.narrow(0, 0, n)


def _chunks(n: int, chunk: int):
    for s in range(0, n, chunk):
        yield s, min(chunk, n - s)


def _state_flat(state: dict, key: str) -> Optional[torch.Tensor]:
    t = state.get(key)
    return None if t is None else _flat(_local(t), f"state '{key}'")


def _target(out: torch.Tensor, like: torch.Tensor, ws: _Workspace, slot: int, n: int) -> torch.Tensor:
    """Where a chunk of the result is computed: the output itself when it has the working dtype."""
    return out if out.dtype == like.dtype else ws.get(slot, like, n)


# -- torch.optim.SGD: _single_tensor_sgd / _multi_tensor_sgd -----------------------------------
# The kernels serve both directions. Estimate (commit=False): the result goes to ``out``, the new
# moments to workspace buffers, the state is only read. Commit (commit=True, ``out`` is the
# parameter itself, the state tensors exist): the same ops write the new moments over the state
# chunk they read (``torch.op(x, ..., out=x)`` is the step's ``x.op_(...)``) and the result over
# the parameter chunk, after every read of it.
def _sgd(p, g, out, group, state, ws, commit=False, fresh=False):
    """``fresh`` (commit only): the momentum buffer was just created and is to be filled with the
    first gradient, as the step's ``grad.clone()``."""
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
    buf_all = _state_flat(state, "momentum_buffer") if momentum != 0 else None
    for s, n in _chunks(p.numel(), ws.chunk):
        pc, gc, oc = p.narrow(0, s, n), g.narrow(0, s, n), out.narrow(0, s, n)
        gb = ws.get(0, p, n)
        grad = gc
        if maximize:
            grad = torch.neg(gc, out=gb)
        if wd != 0:
            grad = torch.add(grad, pc, alpha=wd, out=gb)
        if momentum != 0:
            if buf_all is None:
                buf = grad  # first step: the buffer is a clone of the gradient
            elif fresh:
                buf = buf_all.narrow(0, s, n).copy_(grad)
            else:
                state_chunk = buf_all.narrow(0, s, n)
                buf = torch.mul(state_chunk, momentum, out=state_chunk if commit else ws.get(1, p, n))
                buf.add_(grad, alpha=1 - dampening)
            grad = torch.add(grad, buf, alpha=momentum, out=gb) if nesterov else buf
        tgt = _target(oc, p, ws, 2, n)
        torch.add(pc, grad, alpha=-lr, out=tgt)
        if tgt is not oc:
            oc.copy_(tgt)


# -- torch.optim.Adam / AdamW: _single_tensor_adam / _multi_tensor_adam (not capturable) ----
def _torch_step_value(state: dict) -> float:
    step_t = state.get("step")
    if step_t is None:
        return 1.0
    if torch.is_tensor(step_t):  # float32 on CPU; ``step_t += 1`` then ``.item()``: + 1 rounded to its dtype
        return _round_to(step_t.item() + 1, step_t.dtype)
    return float(step_t) + 1


def _round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (float32: the step count torch keeps), without a tensor."""
    if dtype == torch.float32:
        return struct.unpack("f", struct.pack("f", value))[0]
    return value


def _adam(p, g, out, group, state, ws, commit=False):
    """Commit: ``out`` is ``p``; exp_avg, exp_avg_sq (and max_exp_avg_sq) exist (zeros on the first
    step, as ``_init_group`` makes them) and are updated in place, the ``step`` tensor first."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    amsgrad, maximize = group["amsgrad"], group["maximize"]
    decoupled = group.get("decoupled_weight_decay", False)
    exp_avg, exp_avg_sq = _state_flat(state, "exp_avg"), _state_flat(state, "exp_avg_sq")
    max_exp_avg_sq = _state_flat(state, "max_exp_avg_sq") if amsgrad else None
    if (exp_avg is None) != (exp_avg_sq is None):
        raise ValueError("inconsistent Adam state: exp_avg and exp_avg_sq must both exist or neither")
    if commit:
        step_t = state["step"]
        step_t += 1  # the step's ``step_t += 1``, then ``_get_value(step_t)``
        step = step_t.item()
    else:
        step = _torch_step_value(state)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    for s, n in _chunks(p.numel(), ws.chunk):
        pc, gc, oc = p.narrow(0, s, n), g.narrow(0, s, n), out.narrow(0, s, n)
        gb = ws.get(0, p, n)
        if commit:  # the new moments over the state they are computed from
            mb, vb = exp_avg.narrow(0, s, n), exp_avg_sq.narrow(0, s, n)
        else:
            mb, vb = ws.get(1, p, n), ws.get(2, p, n)
        tgt = _target(oc, p, ws, 3, n)
        grad = gc
        if maximize:
            grad = torch.neg(gc, out=gb)
        if wd != 0 and not decoupled:
            grad = torch.add(grad, pc, alpha=wd, out=gb)
        if exp_avg is None:  # lazy state init: zeros, then the same in-place updates
            mb.zero_().lerp_(grad, 1 - beta1)
            vb.zero_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        else:
            torch.lerp(exp_avg.narrow(0, s, n), grad, 1 - beta1, out=mb)
            torch.mul(exp_avg_sq.narrow(0, s, n), beta2, out=vb).addcmul_(grad, grad, value=1 - beta2)
        v_hat = vb  # what the denominator is computed from
        if amsgrad:
            if max_exp_avg_sq is None:
                torch.maximum(torch.zeros((), dtype=vb.dtype, device=vb.device), vb, out=vb)
            else:
                max_chunk = max_exp_avg_sq.narrow(0, s, n)
                # estimate: the max over vb (a workspace copy); commit: over the state's max
                v_hat = torch.maximum(max_chunk, vb, out=max_chunk if commit else vb)
        # The gradient is no longer needed: from here on the output may be written (it may be
        # the gradient's own memory), and gb is free.
        base = torch.mul(pc, 1 - lr * wd, out=tgt) if wd != 0 and decoupled else pc
        denom = torch.sqrt(v_hat, out=gb)
        denom.div_(bias_correction2_sqrt).add_(eps)
        torch.addcdiv(base, mb, denom, value=-step_size, out=tgt)
        if tgt is not oc:
            oc.copy_(tgt)
