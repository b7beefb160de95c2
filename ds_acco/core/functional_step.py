"""The estimate round's ``Opt(θ, S, g)`` computed out of place, chunk by chunk.

``estimate_into(optimizer, params, grads, outs, chunk_elems)`` writes into ``outs[i]`` the value
that one ``optimizer.step()`` would give ``params[i]`` (with the current param-group settings
and the state's step count + 1), and leaves the parameters, the optimizer state and the param
groups untouched. Nothing is snapshot: every state tensor is only read, a chunk of
``chunk_elems`` elements at a time, and the temporaries are a fixed workspace of a few
chunk-sized buffers (see :data:`WORKSPACE_BUFFERS`), whatever the size of the shard.

Supported (:func:`supports`), with the exact op sequence of each optimizer's own step:

* ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize), single-tensor
  and foreach implementations (the same ops in the same order: the results are bit-identical);
* ``torch.optim.Adam`` / ``AdamW`` (amsgrad, maximize, weight decay coupled or decoupled,
  ``decoupled_weight_decay``), single-tensor and foreach, not capturable: bit-identical;
* DeepSpeed's ``DeepSpeedCPUAdam`` (fp32 parameters and states): its AVX kernel's float ops,
  each fused multiply-add emulated in float64 then rounded to float32 (bit-identical except,
  with a probability of about 2^-28 per element and FMA, a double rounding off by one ulp);
* DeepSpeed's ``FusedAdam`` (CUDA, fp32 parameters): its kernel's formulas in float32 as
  written, every product and sum rounded, and its step counter (kept in the state of each
  group's last parameter); nvcc may contract some of them into FMAs, so on CUDA results may
  differ by an ulp or so (not measured: no GPU was available when this was written).

Anything else (other optimizers or subclasses, torch's ``fused``/``capturable``/
``differentiable`` variants, tensor learning rates or betas, complex or sparse tensors, AMP
grad scaling on the optimizer) is refused: the caller falls back to a snapshot.

The computation runs in the parameter's dtype (fp32 for master shards, as the optimizers do);
each chunk of the result is cast to the dtype of ``outs[i]`` as it is written.

``commit_in_place(optimizer, params, grads, chunk_elems)`` is the same kernels run the other way
round, for torch SGD/Adam/AdamW only (:func:`supports_commit`): the parameters and the state are
updated in place exactly as one real ``optimizer.step()`` would (bit-identical, lazy state
initialisation included), with one chunk-sized temporary instead of the shard-sized ones torch's
step allocates (Adam's ``denom``, the weight-decayed or negated gradient). DeepSpeed's Adams keep
their real step: the C++ object's running β^t cannot be advanced from Python.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence

import torch
from torch.optim import optimizer as _torch_optimizer

from .functional_kernels import _Workspace, _adam, _copy_chunked, _flat, _local, _sgd

DEFAULT_CHUNK_ELEMS = 1 << 20
"""1 Mi elements: 4 MiB per fp32 buffer; a 7B model on 8 ranks has 875 M elements per shard (0.12 %)."""

WORKSPACE_BUFFERS = 4
"""At most this many chunk-sized buffers (in the parameter's dtype) are allocated per call: SGD
uses up to 3, Adam/AdamW and FusedAdam up to 4, one fewer when the output has the parameter's
dtype (the result is then computed in the output itself). DeepSpeedCPUAdam's emulation adds one
float64 chunk buffer (its FMAs)."""

_GROUP_PARAMS = "params"
_FUSED_ADAM_DEVICES = ("cuda",)  # FusedAdam's op is CUDA-only (a test runs its emulation on CPU)


# -- which optimizers ------------------------------------------------------------------------
def _deepspeed_class(module: str, name: str):
    """The DeepSpeed class if its module is already imported (an instance implies it is)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _kind(optimizer) -> Optional[str]:
    cls = type(optimizer)  # exact types only: a subclass may change step()
    if cls is torch.optim.SGD:
        return "sgd"
    if cls is torch.optim.Adam or cls is torch.optim.AdamW:
        return "adam"
    if cls is _deepspeed_class("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam"):
        return "cpu_adam"
    if cls is _deepspeed_class("deepspeed.ops.adam.fused_adam", "FusedAdam"):
        return "fused_adam"
    return None


def _is_float(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plain_tensors(optimizer, dtypes=None, device_type=None) -> bool:
    for g in optimizer.param_groups:
        for p in g[_GROUP_PARAMS]:
            t = _local(p)
            if t.is_sparse or t.is_complex() or not t.is_floating_point():
                return False
            if dtypes is not None and t.dtype not in dtypes:
                return False
            if device_type is not None and t.device.type != device_type:
                return False
    return True


def _torch_group_ok(group, kind: str) -> bool:
    if group.get("differentiable") or group.get("fused") or group.get("capturable"):
        return False
    if not _is_float(group["lr"]) or not _is_float(group.get("weight_decay", 0)):
        return False
    if kind == "sgd":
        return all(_is_float(group[k]) for k in ("momentum", "dampening"))
    b1, b2 = group["betas"]
    return _is_float(b1) and _is_float(b2) and _is_float(group["eps"])


def supports(optimizer) -> bool:
    """Whether :func:`estimate_into` reproduces ``optimizer.step()`` for this optimizer."""
    kind = _kind(optimizer)
    if kind is None:
        return False
    if kind in ("sgd", "adam"):
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            return False
        return _plain_tensors(optimizer) and all(_torch_group_ok(g, kind) for g in optimizer.param_groups)
    groups_ok = all(not g.get("amsgrad", False) and all(_is_float(g[k]) for k in ("lr", "eps", "weight_decay"))
                    and all(_is_float(b) for b in g["betas"]) for g in optimizer.param_groups)
    if kind == "cpu_adam":
        return (groups_ok and getattr(optimizer, "fp32_optimizer_states", True)
                and _plain_tensors(optimizer, (torch.float32,), "cpu") and _deepspeed_kernels()._cpu_adam_simd_width() > 0)
    return groups_ok and all(_plain_tensors(optimizer, (torch.float32,), d) for d in _FUSED_ADAM_DEVICES)


# -- the entry point -------------------------------------------------------------------------
def estimate_into(optimizer, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                  outs: Sequence[torch.Tensor], chunk_elems: int = DEFAULT_CHUNK_ELEMS, lr_scale: float = 1.0,
                  settings: Optional[Sequence[dict]] = None) -> None:
    """``outs[i] ← Opt(θ, S, g)`` for ``params[i]``, as one ``optimizer.step()`` with ``p.grad =
    grads[i]`` would compute it; ``params``, the state and the param groups are only read
    (``settings``: the groups' settings to use, see :func:`capture_settings`, default their
    current ones; ``lr_scale``: the step uses each group's learning rate × this, without writing it).

    ``params`` are tensors the optimizer owns (the ones a real step would see a gradient on; a
    ``None`` gradient leaves the parameter as it is, as the step would). Parameters, gradients
    and state tensors are read through ``to_local()`` when they have one (FSDP2 DTensors);
    every tensor must be contiguous. ``outs[i]`` must be contiguous with the local numel of
    ``params[i]``, any floating dtype; it may be the very memory of ``grads[i]`` (the reduced
    gradient shard inside the communication buffer: each chunk of it is read before its result
    is written), but must not overlap anything else the step reads.
    """
    kind = _kind(optimizer)
    if kind is None or not supports(optimizer):
        raise ValueError(f"no functional step for {type(optimizer).__name__} with these settings; "
                         "check supports() first")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
    if not (len(params) == len(grads) == len(outs)):
        raise ValueError("params, grads and outs must have the same length")
    with torch.no_grad():
        _estimate_into(optimizer, kind, params, grads, outs, chunk_elems, lr_scale, settings)


def capture_settings(optimizer) -> List[dict]:
    """Every param group's settings now (all but ``params``; tensors cloned), captured on the
    compute lane when a round is launched: the round's step uses them, so a scheduler the caller
    steps while the round runs (Accelerate and HF Trainer step theirs after each optimizer step,
    on the compute thread) cannot change which learning rate that round's step takes."""
    return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != _GROUP_PARAMS}
            for g in optimizer.param_groups]


def step_groups(optimizer, settings: Optional[Sequence[dict]] = None, lr_scale: float = 1.0) -> List[dict]:
    """The param groups as a step reads them: copies of the optimizer's (never its own dicts: a
    scheduler may write them from another thread meanwhile) with ``settings`` laid over them (see
    :func:`capture_settings`) and the learning rate × ``lr_scale``. One copy per group."""
    groups = optimizer.param_groups
    if settings is not None and len(settings) != len(groups):
        raise ValueError(f"settings for {len(settings)} param groups, the optimizer has {len(groups)}")
    out = []
    for i, g in enumerate(groups):
        view = {**g, **(settings[i] if settings is not None else {})}
        if lr_scale != 1.0:
            view["lr"] = view["lr"] * lr_scale
        out.append(view)
    return out


def _estimate_into(optimizer, kind, params, grads, outs, chunk_elems, lr_scale=1.0, settings=None) -> None:
    groups = step_groups(optimizer, settings, lr_scale)
    group_of = {id(p): g for g in groups for p in g[_GROUP_PARAMS]}
    items = []
    for p, g, o in zip(params, grads, outs):
        group = group_of.get(id(p))
        if group is None:
            raise ValueError("every parameter must belong to the optimizer")
        pl, ol = _flat(_local(p), "parameter"), _flat(_local(o), "output")
        if ol.numel() != pl.numel():
            raise ValueError(f"output has {ol.numel()} elements, parameter {pl.numel()}")
        if g is not None:
            g = _flat(_local(g), "gradient")
            if g.numel() != pl.numel() or g.dtype != pl.dtype:
                raise ValueError("a gradient must match its parameter's numel and dtype")
            # The output may be its gradient's memory, or start at or before it in a narrower
            # dtype (θ̃ written over the reduced gradients in B, whose gather view is the model
            # dtype): chunk k of the output then only covers gradient elements of chunks <= k,
            # read before it is written (a narrower output is computed in the workspace and
            # copied last).
            same = ol.data_ptr() == g.data_ptr() and ol.dtype == g.dtype
            trailing = ol.data_ptr() <= g.data_ptr() and ol.element_size() < g.element_size()
            if _overlaps(ol, g) and not (same or trailing):
                raise ValueError("an output may be its gradient's memory, or start at or before it in a narrower "
                                 "dtype; no other overlap")
        if _overlaps(ol, pl):
            raise ValueError("an output must not overlap its parameter")
        items.append((p, pl, g, ol, group))
    ws = _Workspace(chunk_elems)
    ds = _deepspeed_kernels()
    steps = ds._shared_steps(optimizer, kind, items, groups)
    for idx, (p, pl, g, ol, group) in enumerate(items):
        if g is None:
            _copy_chunked(pl, ol, chunk_elems)
            continue
        state = optimizer.state.get(p) or {}
        if kind == "sgd":
            _sgd(pl, g, ol, group, state, ws)
        elif kind == "adam":
            _adam(pl, g, ol, group, state, ws)
        elif kind == "cpu_adam":
            ds._cpu_adam(pl, g, ol, group, state, steps[idx], optimizer.adam_w_mode, ws)
        else:
            ds._fused_adam(pl, g, ol, group, state, steps[idx], optimizer.adam_w_mode, ws)


def _step_overridden(optimizer) -> bool:
    """Whether the instance's ``step`` is anything but its class's (an LR scheduler's wrapper of
    the class's step, which only sets ``_opt_called``, is not an override)."""
    step = optimizer.__dict__.get("step")
    if step is None:
        return False
    return not (getattr(step, "_wrapped_by_lr_sched", False)
                and getattr(step, "__wrapped__", None) is type(optimizer).step)


def supports_commit(optimizer) -> bool:
    """Whether :func:`commit_in_place` may replace ``optimizer.step()``: torch SGD/Adam/AdamW under
    the conditions of :func:`supports`, no step pre/post hooks (global or the optimizer's: they
    expect the real step), ``step`` not overridden on the instance, and every Adam ``step`` state
    a tensor (as ``load_state_dict`` and ``_init_group`` make it)."""
    kind = _kind(optimizer)
    if kind not in ("sgd", "adam") or not supports(optimizer) or _step_overridden(optimizer):
        return False
    if (_torch_optimizer._global_optimizer_pre_hooks or _torch_optimizer._global_optimizer_post_hooks
            or getattr(optimizer, "_optimizer_step_pre_hooks", None)
            or getattr(optimizer, "_optimizer_step_post_hooks", None)):
        return False
    if kind == "adam":
        for state in optimizer.state.values():
            step = state.get("step")
            if step is not None and not (torch.is_tensor(step) and step.numel() == 1 and not step.requires_grad):
                return False
    return True


def commit_in_place(optimizer, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                    chunk_elems: int = DEFAULT_CHUNK_ELEMS, lr_scale: float = 1.0,
                    settings: Optional[Sequence[dict]] = None) -> None:
    """θ, S ← Opt(θ, S, g) in place: what one ``optimizer.step()`` with ``p.grad = grads[i]`` (and
    no gradient on any other parameter) does to the parameters and the optimizer state, bit for
    bit, including torch's lazy state initialisation on a parameter's first step (the same
    tensors: ``step`` a CPU scalar of torch's scalar dtype, moments ``zeros_like`` the parameter,
    SGD's momentum buffer a copy of the first gradient). The temporaries are one chunk of
    ``chunk_elems`` elements (SGD: up to two), whatever the size of the shard.

    Of what ``Optimizer.step``'s wrappers do, ``_opt_called`` is set when an LR scheduler has
    wrapped the step (so the scheduler does not warn about ``lr_scheduler.step()`` before
    ``optimizer.step()``); the profiler label is skipped; with step hooks registered
    :func:`supports_commit` is false and the caller must take the real step. Every tensor must be
    contiguous; a gradient must not overlap its parameter or the state (it is read while they are
    written).
    """
    kind = _kind(optimizer)
    if not supports_commit(optimizer):
        raise ValueError(f"no functional commit for {type(optimizer).__name__} with these settings; "
                         "check supports_commit() first")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
    if len(params) != len(grads):
        raise ValueError("params and grads must have the same length")
    grad_of = {id(p): g for p, g in zip(params, grads)}
    owned = {id(p) for group in optimizer.param_groups for p in group[_GROUP_PARAMS]}
    if not set(grad_of) <= owned:
        raise ValueError("every parameter must belong to the optimizer")
    ws = _Workspace(chunk_elems)
    with torch.no_grad():
        for group in step_groups(optimizer, settings, lr_scale):  # step()'s order (state entries are created in it)
            for p in group[_GROUP_PARAMS]:
                g = grad_of.get(id(p))
                if g is None:
                    continue
                pl, gl = _flat(_local(p), "parameter"), _flat(_local(g), "gradient")
                if gl.numel() != pl.numel() or gl.dtype != pl.dtype:
                    raise ValueError("a gradient must match its parameter's numel and dtype")
                if kind == "sgd":
                    state, fresh = _sgd_state(optimizer, p, g, group)
                    _check_no_overlap(gl, pl, state)
                    _sgd(pl, gl, pl, group, state, ws, commit=True, fresh=fresh)
                else:
                    state = _adam_state(optimizer, p, group)
                    _check_no_overlap(gl, pl, state)
                    _adam(pl, gl, pl, group, state, ws, commit=True)
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # what the scheduler's wrapper of step() sets


def _sgd_state(optimizer, p, g, group):
    """SGD's state as its step leaves it: ``momentum_buffer`` (a clone of the first gradient: a new
    tensor like it, filled by the kernel) when momentum is on; no entry at all otherwise."""
    if group["momentum"] == 0:
        return {}, False
    state = optimizer.state[p]  # the step's defaultdict access creates the entry
    if state.get("momentum_buffer") is not None:
        return state, False
    state["momentum_buffer"] = torch.empty_like(g, memory_format=torch.preserve_format)
    return state, True


def _adam_state(optimizer, p, group):
    """Adam's ``_init_group`` for a parameter without state (not fused, not capturable)."""
    state = optimizer.state[p]
    if len(state) == 0:
        state["step"] = torch.tensor(0.0, dtype=_torch_optimizer._get_scalar_dtype(), device="cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    missing = [k for k in keys if k not in state]
    if missing:  # the real step would raise a KeyError
        raise KeyError(f"Adam state without {missing}")
    return state


def _check_no_overlap(g: torch.Tensor, p: torch.Tensor, state: dict) -> None:
    for t in [p] + [_local(v) for v in state.values() if torch.is_tensor(v)]:
        if _overlaps(g, t):
            raise ValueError("a gradient must not overlap its parameter or the optimizer state")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _deepspeed_kernels():
    """DeepSpeed's Adam kernels in Python (a module of their own; imported on first use)."""
    from . import functional_deepspeed
    return functional_deepspeed
