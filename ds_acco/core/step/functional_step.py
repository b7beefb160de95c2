"""The estimate round's ``Opt(θ, S, g)`` computed out of place, window by window.

``estimate_into(optimizer, params, grads, outs, chunk_elems)`` writes into ``outs[i]`` the value
that one ``optimizer.step()`` would give ``params[i]`` (with the current param-group settings
and the state's step count + 1), and leaves the parameters, the optimizer state and the param
groups untouched. Nothing is snapshot: every state tensor is only read, a window of at most
``chunk_elems`` elements at a time (:mod:`.chunking`; default: chosen for the device), and the
temporaries are a fixed workspace of a few chunk-sized buffers (see :data:`WORKSPACE_BUFFERS`),
whatever the size of the shard. Each operation of the step is one foreach (or fused) kernel per
window and param group, however many parameter tensors the window spans. On CPU a foreach op runs
the single-tensor op on each piece (checked bit-identical to both of torch's variants below); on
CUDA they are the kernels of torch's foreach step (its default there), so an optimizer built with
``foreach=False`` may differ from them by an ulp (not measured: no GPU was available).

Supported (:func:`supports`), with the exact op sequence of each optimizer's own step:

* ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize), single-tensor
  and foreach implementations (the same ops in the same order: the results are bit-identical);
* ``torch.optim.Adam`` / ``AdamW`` (amsgrad, maximize, weight decay coupled or decoupled,
  ``decoupled_weight_decay``), single-tensor and foreach, not capturable: bit-identical;
* ``torch.optim.Adam`` / ``AdamW`` with ``fused=True``: torch's fused kernel itself, run on
  workspace copies of θ and the moments: bit-identical;
* optimizer classes an adapter registers with :func:`register_estimate` (the DeepSpeed adapter
  registers DeepSpeed's ``DeepSpeedCPUAdam`` and ``FusedAdam``, ds_acco/deepspeed/functional.py;
  the core itself knows no DeepSpeed class).

Anything else (other optimizers or subclasses, torch's ``capturable``/``differentiable``
variants, fused SGD, tensor learning rates or betas, complex or sparse tensors, AMP grad scaling
on the optimizer) is refused: the caller falls back to a snapshot.

The computation runs in the parameter's dtype (fp32 for master shards, as the optimizers do);
each piece of the result is cast to the dtype of ``outs[i]`` as it is written.

The commit runs the same kernels the other way round, in place: :mod:`.functional_commit`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence

import torch
from torch.optim import optimizer as _torch_optimizer

from . import chunking
from .chunking import local
from .functional_kernels import (COMMITTED_SECOND_MOMENT, StepItem, Workspace, adam, copy_chunked, flat_view,
                                 fused_adam_estimate, run_windows, sgd)

WORKSPACE_BUFFERS = 4
"""At most this many chunk-sized buffers (in the parameter's dtype) are allocated per call: SGD
uses up to 3, Adam/AdamW and FusedAdam up to 4, one fewer when the output has the parameter's
dtype (the result is then computed in the output itself), fused Adam/AdamW 3 (4 with amsgrad).
DeepSpeedCPUAdam's emulation adds one float64 chunk buffer (its FMAs)."""

GROUP_PARAMS = "params"
"""The key of a param group that holds its parameters (torch's); every other key is a setting."""


class ExternalEstimate(Protocol):
    """A functional estimate for an optimizer class the core does not know, registered by the
    adapter that does (the DeepSpeed adapter registers DeepSpeed's Adams: ds_acco/deepspeed/functional.py)."""

    def supports(self, optimizer) -> bool:
        """Whether :meth:`estimate` reproduces this optimizer's step with its current settings."""

    def estimate(self, optimizer, items: Sequence[tuple], groups: Sequence[dict], ws: Workspace) -> None:
        """``ol ← Opt(θ, S, g)`` for each ``(param, flat param, flat grad, flat out, group)`` of ``items``
        (``groups``: the param groups as the step reads them, :func:`step_groups`), chunk by chunk
        through ``ws``; parameters and state are only read."""


_EXTERNAL: Dict[type, ExternalEstimate] = {}


def register_estimate(cls: type, estimate: ExternalEstimate) -> None:
    """Give instances of exactly ``cls`` (not subclasses: they may change ``step()``) a functional
    estimate. Idempotent."""
    _EXTERNAL[cls] = estimate


# -- which optimizers ------------------------------------------------------------------------
def optimizer_kind(optimizer) -> Optional[str]:
    """Which functional step fits ``optimizer``: "sgd", "adam" (torch Adam / AdamW), "external" (an
    adapter's, :func:`register_estimate`), or None."""
    cls = type(optimizer)  # exact types only: a subclass may change step()
    if cls is torch.optim.SGD:
        return "sgd"
    if cls is torch.optim.Adam or cls is torch.optim.AdamW:
        return "adam"
    if cls in _EXTERNAL:
        return "external"
    return None


def is_number(x) -> bool:
    """Whether a setting is a plain real number (an int or a float, not a bool, not a tensor)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scalable_lr(lr) -> bool:
    """Whether a round's step can take ``lr`` × a factor: a number or a floating-point tensor (the
    one test of the lane's :func:`step_groups` and of the refusal at initialize)."""
    return is_number(lr) or (torch.is_tensor(lr) and lr.is_floating_point())


def registered(optimizer) -> bool:
    """Whether an adapter registered ``optimizer``'s class (:func:`register_estimate`)."""
    return type(optimizer) in _EXTERNAL


def plain_tensors(optimizer, dtypes=None, device_type=None) -> bool:
    """Every parameter is a dense real floating tensor (of ``dtypes``, on ``device_type`` if given)."""
    for g in optimizer.param_groups:
        for p in g[GROUP_PARAMS]:
            t = local(p)
            if t.is_sparse or t.is_complex() or not t.is_floating_point():
                return False
            if dtypes is not None and t.dtype not in dtypes:
                return False
            if device_type is not None and t.device.type != device_type:
                return False
    return True


def _torch_group_ok(group, kind: str) -> bool:
    if group.get("differentiable") or group.get("capturable") or (group.get("fused") and kind != "adam"):
        return False
    if not is_number(group["lr"]) or not is_number(group.get("weight_decay", 0)):
        return False
    if kind == "sgd":
        return all(is_number(group[k]) for k in ("momentum", "dampening"))
    b1, b2 = group["betas"]
    return is_number(b1) and is_number(b2) and is_number(group["eps"])


def supports(optimizer) -> bool:
    """Whether :func:`estimate_into` reproduces ``optimizer.step()`` for this optimizer."""
    kind = optimizer_kind(optimizer)
    if kind is None:
        return False
    if kind in ("sgd", "adam"):
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            return False
        return plain_tensors(optimizer) and all(_torch_group_ok(g, kind) for g in optimizer.param_groups)
    return _EXTERNAL[type(optimizer)].supports(optimizer)


# -- the entry point -------------------------------------------------------------------------
def estimate_into(optimizer, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                  outs: Sequence[torch.Tensor], chunk_elems: Optional[int] = None, lr_scale: float = 1.0,
                  settings: Optional[Sequence[dict]] = None, committed_second_moment: bool = False) -> None:
    """``outs[i] ← Opt(θ, S, g)`` for ``params[i]``, as one ``optimizer.step()`` with ``p.grad =
    grads[i]`` would compute it; ``params``, the state and the param groups are only read
    (``settings``: the groups' settings to use, see :func:`capture_settings`, default their
    current ones; ``lr_scale``: the step uses each group's learning rate × this, without writing it;
    ``committed_second_moment``: Adam's v̂ is the committed one, not updated with ``grads``
    (:data:`.functional_kernels.COMMITTED_SECOND_MOMENT`; torch Adam / AdamW only, fused ones
    through the foreach kernels: :func:`supports_committed_second_moment`)).

    ``params`` are tensors the optimizer owns (the ones a real step would see a gradient on; a
    ``None`` gradient leaves the parameter as it is, as the step would). Parameters, gradients
    and state tensors are read through ``to_local()`` when they have one (FSDP2 DTensors);
    every tensor must be contiguous. ``outs[i]`` must be contiguous with the local numel of
    ``params[i]``, any floating dtype; it may be the very memory of ``grads[i]`` (the reduced
    gradient shard inside the communication buffer: each chunk of it is read before its result
    is written), but must not overlap anything else the step reads.
    """
    kind = optimizer_kind(optimizer)
    if kind is None or not supports(optimizer):
        raise ValueError(f"no functional step for {type(optimizer).__name__} with these settings; "
                         "check supports() first")
    if not (len(params) == len(grads) == len(outs)):
        raise ValueError("params, grads and outs must have the same length")
    if committed_second_moment and not supports_committed_second_moment(optimizer):
        raise ValueError(f"no committed-second-moment estimate for {type(optimizer).__name__}; "
                         "check supports_committed_second_moment() first")
    with torch.no_grad():
        _estimate_into(optimizer, kind, params, grads, outs, chunk_elems, lr_scale, settings,
                       committed_second_moment)


def supports_committed_second_moment(optimizer) -> bool:
    """Whether the estimate can reuse the committed second moment: torch Adam / AdamW with a
    functional step (:func:`supports`)."""
    return optimizer_kind(optimizer) == "adam" and supports(optimizer)


def capture_settings(optimizer) -> List[dict]:
    """Every param group's settings now (all but ``params``; tensors cloned), captured on the
    compute lane when a round is launched: the round's step uses them, so a scheduler the caller
    steps while the round runs (Accelerate and HF Trainer step theirs after each optimizer step,
    on the compute thread) cannot change which learning rate that round's step takes."""
    return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != GROUP_PARAMS}
            for g in optimizer.param_groups]


def step_groups(optimizer, settings: Optional[Sequence[dict]] = None, lr_scale: float = 1.0) -> List[dict]:
    """The param groups as a step reads them: copies of the optimizer's (never its own dicts: the
    compute thread may read and write them meanwhile) with ``settings`` laid over them (see
    :func:`capture_settings`) and the learning rate × ``lr_scale`` (a tensor rate too, out of place).
    One copy per group."""
    groups = optimizer.param_groups
    if settings is not None and len(settings) != len(groups):
        raise ValueError(f"settings for {len(settings)} param groups, the optimizer has {len(groups)}")
    out = []
    for i, g in enumerate(groups):
        view = {**g, **(settings[i] if settings is not None else {})}
        if lr_scale != 1.0:
            lr = view.get("lr")
            if not scalable_lr(lr):
                raise ValueError(f"{type(optimizer).__name__}'s param group {i} has lr = {lr!r}, which a round's step "
                                 f"cannot take × {lr_scale} (acco.estimate.lr_scale in the estimate, "
                                 "acco.dynamic.lr_scaling); fix: give the group a learning rate, or set that key to 1 "
                                 "(\"estimate\": \"paper\"; lr_scaling 'none')")
            view["lr"] = lr * lr_scale  # a new value: a tensor rate the caller holds is never written
        out.append(view)
    return out


def _estimate_into(optimizer, kind, params, grads, outs, chunk_elems, lr_scale=1.0, settings=None,
                   committed_second_moment=False) -> None:
    groups = step_groups(optimizer, settings, lr_scale)
    if committed_second_moment:  # the fused kernel updates v: these groups take the foreach kernels
        for view in groups:
            view[COMMITTED_SECOND_MOMENT] = True
            view["fused"] = False
    group_of = {id(p): (i, g) for i, g in enumerate(groups) for p in g[GROUP_PARAMS]}
    items = []
    for p, g, o in zip(params, grads, outs):
        found = group_of.get(id(p))
        if found is None:
            raise ValueError("every parameter must belong to the optimizer")
        pl, ol = flat_view(local(p), "parameter"), flat_view(local(o), "output")
        if ol.numel() != pl.numel():
            raise ValueError(f"output has {ol.numel()} elements, parameter {pl.numel()}")
        if g is not None:
            g = flat_view(local(g), "gradient")
            if g.numel() != pl.numel() or g.dtype != pl.dtype:
                raise ValueError("a gradient must match its parameter's numel and dtype")
            # The output may be its gradient's memory, or start at or before it in a narrower
            # dtype (θ̃ written over the reduced gradients in B, whose gather view is the model
            # dtype): the output's window k then only covers gradient elements of windows <= k,
            # each read before the window's outputs are written (a narrower output is computed in
            # the workspace and copied last).
            same = ol.data_ptr() == g.data_ptr() and ol.dtype == g.dtype
            trailing = ol.data_ptr() <= g.data_ptr() and ol.element_size() < g.element_size()
            if overlaps(ol, g) and not (same or trailing):
                raise ValueError("an output may be its gradient's memory, or start at or before it in a narrower "
                                 "dtype; no other overlap")
        if overlaps(ol, pl):
            raise ValueError("an output must not overlap its parameter")
        items.append((p, pl, g, ol, found))
    if not items:
        return
    chunk = chunk_elems or chunking.chunk_elements(items[0][1].device, sum(it[1].numel() for it in items))
    if kind in ("sgd", "adam"):
        if any(g.get("fused") for _, g in group_of.values()):
            chunk = max(chunk, chunking.ALIGN)  # the fused kernel's pieces must split at ALIGN
        _torch_estimate(optimizer, kind, items, chunk)
        return
    flat_items = [(p, pl, g, ol, group) for p, pl, g, ol, (_, group) in items]
    for p, pl, g, ol, _ in flat_items:
        if g is None:  # no gradient: the step leaves the parameter as it is
            copy_chunked(pl, ol, chunk)
    _EXTERNAL[type(optimizer)].estimate(optimizer, [it for it in flat_items if it[2] is not None], groups,
                                        Workspace(chunk))


def _torch_estimate(optimizer, kind, items, chunk: int) -> None:
    """torch SGD / Adam / AdamW (fused or not): foreach kernels window by window."""
    step_items = []
    for p, pl, g, ol, (index, group) in items:
        state = optimizer.state.get(p) or {}
        if kind == "adam" and (state.get("exp_avg") is None) != (state.get("exp_avg_sq") is None):
            raise ValueError("inconsistent Adam state: exp_avg and exp_avg_sq must both exist or neither")
        step_items.append(StepItem(pl, g, ol, group, index, state))
    if kind == "sgd":
        run_windows(step_items, chunk, sgd, commit=False)
        return
    with_grad = [(p, it) for (p, *_), it in zip(items, step_items) if it.grad is not None]
    plain = [(p, it) for p, it in with_grad if not it.group.get("fused")]
    fused = [(p, it) for p, it in with_grad if it.group.get("fused")]
    # the step counts after this step's increment (torch: ``step_t += 1``): floats for the foreach
    # kernels, device tensors for the fused one
    for it, value in zip((it for _, it in plain), _next_step_values(optimizer, [p for p, _ in plain])):
        it.step = value
    step_tensors = _next_step_tensors(optimizer, fused)
    run_windows(step_items, chunk, lambda b: fused_adam_estimate(b, step_tensors) if b.group.get("fused")
                else adam(b), commit=False)


def _next_step_values(optimizer, params) -> List[float]:
    """Each parameter's Adam step count + 1 (1 for a parameter without state)."""
    steps = [(optimizer.state.get(p) or {}).get("step") for p in params]
    after = iter(read_scalars([s for s in steps if torch.is_tensor(s)], add=1))
    return [next(after) if torch.is_tensor(s) else 1.0 if s is None else float(s) + 1 for s in steps]


def read_scalars(tensors: List[torch.Tensor], add: int = 0) -> List[float]:
    """The values of scalar tensors (+ ``add`` in their own dtype, as the step's ``step_t += 1``),
    read with one stack and one host read per device rather than one ``.item()`` per parameter."""
    out: List[float] = [0.0] * len(tensors)
    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        stacked = torch.stack([tensors[i] for i in idx])
        for i, v in zip(idx, (stacked + add if add else stacked).tolist()):
            out[i] = v
    return out


def _next_step_tensors(optimizer, items) -> dict:
    """Per item id, its fused Adam step count + 1 as the fused kernel reads it (a float32 tensor on
    the parameter's device); the state's own tensors are not written."""
    dtype = _torch_optimizer._get_scalar_dtype(is_fused=True)
    out, existing, ones = {}, [], {}
    for p, it in items:
        step = (optimizer.state.get(p) or {}).get("step")
        device = it.param.device
        if torch.is_tensor(step):
            existing.append((it, step))
        elif step is not None:  # a count saved as a number
            out[id(it)] = torch.tensor(float(step) + 1, dtype=dtype, device=device)
        else:  # no state yet: its zero, incremented (one tensor per device: the kernel only reads it)
            if device not in ones:
                ones[device] = torch.ones((), dtype=dtype, device=device)
            out[id(it)] = ones[device]
    if existing:
        for (it, _), nxt in zip(existing, torch._foreach_add([s for _, s in existing], 1)):
            out[id(it)] = nxt
    return out


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two flat tensors overlaps."""
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False  # (meta tensors have no memory: tests count a round's kernels on them)
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()

