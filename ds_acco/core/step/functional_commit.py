"""The commit round's ``θ, S ← Opt(θ, S, g)`` in place, window by window: one real step's result.

``commit_in_place(optimizer, params, grads, chunk_elems)`` is the estimate's kernels
(:mod:`.functional_step`) run the other way round, for torch SGD/Adam/AdamW only
(:func:`supports_commit`): the parameters and the state are updated in place exactly as one real
``optimizer.step()`` would (bit-identical, lazy state initialisation included), with one
chunk-sized temporary instead of the shard-sized ones torch's step allocates (Adam's ``denom``,
the weight-decayed or negated gradient); fused Adam / AdamW runs its fused kernel in place over
whole tensors (it has no temporaries). DeepSpeed's Adams keep their real step: the C++ object's
running β^t cannot be advanced from Python.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch.optim import optimizer as _torch_optimizer

from . import chunking
from .chunking import local
from .functional_kernels import StepItem, adam, flat_view, fused_adam_step, run_windows, sgd
from .functional_step import GROUP_PARAMS, optimizer_kind, overlaps, read_scalars, step_groups, supports


def step_overridden(optimizer) -> bool:
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
    kind = optimizer_kind(optimizer)
    if kind not in ("sgd", "adam") or not supports(optimizer) or step_overridden(optimizer):
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
                    chunk_elems: Optional[int] = None, lr_scale: float = 1.0,
                    settings: Optional[Sequence[dict]] = None) -> None:
    """θ, S ← Opt(θ, S, g) in place: what one ``optimizer.step()`` with ``p.grad = grads[i]`` (and
    no gradient on any other parameter) does to the parameters and the optimizer state, bit for
    bit, including torch's lazy state initialisation on a parameter's first step (the same
    tensors: ``step`` a CPU scalar of torch's scalar dtype -- a float32 scalar on the parameter's
    device when fused --, moments ``zeros_like`` the parameter, SGD's momentum buffer a copy of the
    first gradient). The temporaries are one chunk of ``chunk_elems`` elements (default: chosen
    for the device), whatever the size of the shard; fused Adam / AdamW has none (its kernel runs
    in place over whole tensors, as its step does).

    Of what ``Optimizer.step``'s wrappers do, ``_opt_called`` is set when an LR scheduler has
    wrapped the step (so the scheduler does not warn about ``lr_scheduler.step()`` before
    ``optimizer.step()``); the profiler label is skipped; with step hooks registered
    :func:`supports_commit` is false and the caller must take the real step. Every tensor must be
    contiguous; a gradient must not overlap its parameter or the state (it is read while they are
    written).
    """
    kind = optimizer_kind(optimizer)
    if not supports_commit(optimizer):
        raise ValueError(f"no functional commit for {type(optimizer).__name__} with these settings; "
                         "check supports_commit() first")
    if len(params) != len(grads):
        raise ValueError("params and grads must have the same length")
    grad_of = {id(p): g for p, g in zip(params, grads)}
    owned = {id(p) for group in optimizer.param_groups for p in group[GROUP_PARAMS]}
    if not set(grad_of) <= owned:
        raise ValueError("every parameter must belong to the optimizer")
    with torch.no_grad():
        items, steps = [], []
        for index, group in enumerate(step_groups(optimizer, settings, lr_scale)):
            for p in group[GROUP_PARAMS]:  # step()'s order (state entries are created in it)
                g = grad_of.get(id(p))
                if g is None:
                    continue
                pl, gl = flat_view(local(p), "parameter"), flat_view(local(g), "gradient")
                if gl.numel() != pl.numel() or gl.dtype != pl.dtype:
                    raise ValueError("a gradient must match its parameter's numel and dtype")
                fresh = False
                if kind == "sgd":
                    state, fresh = _sgd_state(optimizer, p, g, group)
                else:
                    state = _adam_state(optimizer, p, group)
                    steps.append(state["step"])
                _check_no_overlap(gl, pl, state)
                items.append(StepItem(pl, gl, pl, group, index, state, fresh))
        if items and kind == "adam":
            torch._foreach_add_(steps, 1)  # the step's ``step_t += 1``
            _commit_adam(items, steps, chunk_elems)
        elif items:
            run_windows(items, _chunk_for(items, chunk_elems), lambda b: sgd(b, commit=True), commit=True)
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # what the scheduler's wrapper of step() sets


def _commit_adam(items: List[StepItem], steps: List[torch.Tensor], chunk_elems: Optional[int]) -> None:
    """Adam / AdamW with the steps incremented: the fused kernel per param group, device and dtype
    (as ``_fused_adam``), the foreach kernels window by window otherwise."""
    fused: dict = {}
    plain = []
    for it, step in zip(items, steps):
        if it.group.get("fused"):
            fused.setdefault((it.key[0], it.param.device, it.param.dtype), []).append((it, step))
        else:
            plain.append((it, step))
    for members in fused.values():
        group, amsgrad = members[0][0].group, members[0][0].group["amsgrad"]
        column = lambda key: [it.state[key] for it, _ in members]  # noqa: E731
        fused_adam_step(group, [it.param for it, _ in members], [it.grad for it, _ in members], column("exp_avg"),
                        column("exp_avg_sq"), column("max_exp_avg_sq") if amsgrad else [],
                        [step for _, step in members])
    if plain:
        for (it, _), value in zip(plain, read_scalars([step for _, step in plain])):
            it.step = value  # the step's ``_get_value(step_t)``
        run_windows([it for it, _ in plain], _chunk_for([it for it, _ in plain], chunk_elems),
                    lambda b: adam(b, commit=True), commit=True)


def _chunk_for(items: List[StepItem], chunk_elems: Optional[int]) -> int:
    return chunk_elems or chunking.chunk_elements(items[0].param.device, sum(it.numel for it in items))


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
    """Adam's ``_init_group`` for a parameter without state (not capturable): ``step`` a CPU scalar,
    or with ``fused`` a float32 scalar on the parameter's device (after torch's device check)."""
    state = optimizer.state[p]
    if len(state) == 0:
        if group.get("fused"):
            _torch_optimizer._device_dtype_check_for_fused(p)
            state["step"] = torch.zeros((), dtype=_torch_optimizer._get_scalar_dtype(is_fused=True), device=p.device)
        else:
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
    for t in [p] + [local(v) for v in state.values() if torch.is_tensor(v)]:
        if overlaps(g, t):
            raise ValueError("a gradient must not overlap its parameter or the optimizer state")
