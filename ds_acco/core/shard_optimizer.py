"""One step of any torch optimizer on this rank's fp32 master shards, kept or discarded.

``Opt(θ, S, g)`` of ACCO.md. The commit keeps the result. The estimate leaves the shards, the
per-parameter state and the param-group settings bit for bit as they were, in one of two ways:

* :meth:`ShardOptimizer.estimate_into`, for the optimizers :mod:`.functional_step` supports
  (torch SGD/Adam/AdamW, fused or not, DeepSpeedCPUAdam, DeepSpeed FusedAdam): θ̃ is computed
  out of place, window by window, straight into the caller's buffers; the state is only read,
  and the extra memory is a few chunk-sized temporaries (``chunk_elems``), whatever the shard size;
* otherwise (any other optimizer, or ``estimate``): snapshot → real step → read → restore,
  which is optimizer-agnostic but costs, for the length of the round, one clone of the master
  shard plus one of every state tensor (12 bytes per element for fp32 Adam with amsgrad,
  8 for Adam, 4 for SGD with momentum).

The commit of torch SGD/Adam/AdamW (fused or not) is functional too (in place, bit-identical to
``optimizer.step()``: :func:`.functional_commit.commit_in_place`); other optimizers take their step.

A round uses the settings captured at its launch, while a scheduler on the compute thread may
write the param groups as it runs. The functional steps only read those settings. A real step reads
the param groups: for the classes an adapter registers with :func:`register_step_on_round_groups`
(DeepSpeed's Adams) it runs on a view of the optimizer whose groups are the round's own copies
(:class:`RoundView`), so the groups the scheduler writes are never read nor written on the lane;
any other optimizer gets the settings written into its groups for the step's duration
(:func:`applied_settings`).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, List, Optional, Sequence, TypeVar

import torch

from . import chunking, functional_commit, functional_step

_GROUP_PARAMS = "params"
_MISSING = object()
T = TypeVar("T")
_ROUND_GROUP_STEPS: set = set()


def register_step_on_round_groups(cls: type) -> None:
    """Instances of exactly ``cls`` take their real step on a :class:`RoundView`: ``cls.step()``
    must read its settings from ``self.param_groups`` alone (and may add keys to a group, e.g.
    FusedAdam's ``step``: a commit copies what its step wrote into a group back). Idempotent."""
    _ROUND_GROUP_STEPS.add(cls)


class RoundView:
    """``optimizer`` as one round's real step sees it: ``param_groups`` are the round's own copies
    (its captured settings, :func:`.functional_step.step_groups`), every other attribute is the
    optimizer's own (its state, a C++ optimizer's handle). The step then never reads or writes the
    groups that a scheduler on the compute thread writes meanwhile."""

    __slots__ = ("_optimizer", "param_groups")

    def __init__(self, optimizer: torch.optim.Optimizer, groups: List[dict]):
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "param_groups", groups)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_optimizer"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_optimizer"), name, value)

    @property
    def __class__(self):  # the optimizer's own, for torch's step hooks and profiler label
        return type(object.__getattribute__(self, "_optimizer"))


class ShardOptimizer:
    """Drives ``optimizer`` whose parameters are exactly ``params`` (this rank's shards: DeepSpeed's
    fp32 master partitions, or FSDP's sharded parameters). ``chunk_elems``: the functional steps'
    window (None: chosen for the masters' device and size, :func:`.chunking.chunk_elements`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 chunk_elems: Optional[int] = None):
        self.optimizer = optimizer
        self.masters = list(params)
        owned = {id(p) for g in optimizer.param_groups for p in g[_GROUP_PARAMS]}
        if owned != {id(m) for m in self.masters}:
            raise ValueError("the optimizer must own exactly the shard parameters")
        if chunk_elems is not None and chunk_elems < 1:
            raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
        self.chunk_elems = chunk_elems

    @property
    def functional(self) -> bool:
        """Whether :meth:`estimate_into` runs without a snapshot (checked per call: a param
        group's settings may change during training, e.g. a tensor learning rate)."""
        return functional_step.supports(self.optimizer) and all(_local(m).is_contiguous() for m in self.masters)

    @property
    def functional_commit(self) -> bool:
        """Whether :meth:`commit` updates θ and S in place chunk by chunk (torch SGD/Adam/AdamW
        without step hooks; checked per call) rather than through ``optimizer.step()``."""
        return functional_commit.supports_commit(self.optimizer) and all(_local(m).is_contiguous() for m in self.masters)

    @property
    def steps_on_round_groups(self) -> bool:
        """Whether the real step runs on a :class:`RoundView` (see :func:`register_step_on_round_groups`)."""
        return type(self.optimizer) in _ROUND_GROUP_STEPS

    @property
    def committed_second_moment(self) -> bool:
        """Whether the estimate can reuse the committed second moment (torch Adam / AdamW, functional)."""
        return self.functional and functional_step.supports_committed_second_moment(self.optimizer)

    def settings(self) -> List[dict]:
        """The param groups' settings now, for a round launched now (:func:`.functional_step.capture_settings`)."""
        return functional_step.capture_settings(self.optimizer)

    def commit(self, grads: Sequence[torch.Tensor], read: Optional[Callable[[], T]] = None,
               lr_scale: float = 1.0, settings: Optional[Sequence[dict]] = None) -> Optional[T]:
        """θ, S ← Opt(θ, S, g), kept; returns ``read()`` (called after the step) if given.

        For torch SGD/Adam/AdamW (fused or not) the step is :func:`.functional_commit.commit_in_place`:
        bit-identical to ``optimizer.step()``, but with chunk-sized temporaries only (torch's
        non-fused Adam step allocates shard-sized ones, and the commit runs while the compute
        lane's activations are alive); any other optimizer (DeepSpeed's Adams included) takes its
        real step.

        ``settings``: the param groups' settings the step uses (:meth:`settings`, captured when the
        round was launched; default: the current ones). ``lr_scale``: the step uses each group's
        learning rate × this (dynamic mode's ``lr_scaling``). The functional step reads both
        without writing the param groups, and so does a step on the round's groups (DeepSpeed's
        Adams: :attr:`steps_on_round_groups`); any other real step needs them written there for its
        duration (:func:`applied_settings`)."""
        if len(grads) != len(self.masters):
            raise ValueError(f"expected {len(self.masters)} gradients, got {len(grads)}")
        if self.functional_commit:
            functional_commit.commit_in_place(self.optimizer, self.masters, grads, self.chunk_elems, lr_scale, settings)
        elif self.steps_on_round_groups:
            written = self._step(grads, functional_step.step_groups(self.optimizer, settings, lr_scale))
            for group, keys in zip(self.optimizer.param_groups, written):
                group.update(keys)  # what the step itself keeps in a group (FusedAdam's 'step')
        else:
            with applied_settings(self.optimizer, settings, lr_scale):
                self._step(grads)
        return None if read is None else read()

    def estimate_into(self, grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                      lr_scale: float = 1.0, settings: Optional[Sequence[dict]] = None,
                      committed_second_moment: bool = False) -> None:
        """``outs[i] ← θ̃[i]`` of Opt(θ, S, g) (cast to each out's dtype); θ and S are left exactly
        as they were. ``outs[i]`` is contiguous with the (local) numel of master ``i``.

        Functional path when the optimizer is supported (no snapshot; O(chunk_elems) extra
        memory); otherwise snapshot → step → copy → restore (one shard copy of θ and S).
        ``settings`` and ``lr_scale``: as in :meth:`commit`. ``committed_second_moment``: Adam's v̂
        is the committed one (functional torch Adam / AdamW only: :attr:`committed_second_moment`).
        """
        if len(grads) != len(self.masters) or len(outs) != len(self.masters):
            raise ValueError(f"expected {len(self.masters)} gradients and outputs, "
                             f"got {len(grads)} and {len(outs)}")
        if self.functional:
            functional_step.estimate_into(self.optimizer, self.masters, grads, outs, self.chunk_elems, lr_scale,
                                          settings, committed_second_moment)
            return
        if committed_second_moment:
            raise ValueError(f"{type(self.optimizer).__name__} has no committed-second-moment estimate")

        def copy_out() -> None:
            with torch.no_grad():
                for m, out in zip(self.masters, outs):
                    src, dst = _local(m).detach(), _local(out)
                    if dst.numel() != src.numel():
                        raise ValueError(f"output has {dst.numel()} elements, shard {src.numel()}")
                    dst.view(-1).copy_(src.reshape(-1))

        if self.steps_on_round_groups:
            self.estimate(grads, copy_out, functional_step.step_groups(self.optimizer, settings, lr_scale))
            return
        with applied_settings(self.optimizer, settings, lr_scale):
            self.estimate(grads, copy_out)

    def estimate(self, grads: Sequence[torch.Tensor], read: Callable[[], T],
                 groups: Optional[List[dict]] = None) -> T:
        """Returns ``read()`` called right after Opt(θ, S, g); θ and S are then restored exactly.

        The snapshot path, for any optimizer: while it runs, a clone of every master shard and
        of every optimizer-state tensor is held (see the module docstring). ``groups``: the step
        runs on these copies of the param groups (a :class:`RoundView`; what it writes there is
        dropped), and the optimizer's own groups are neither read nor restored."""
        saved = self._snapshot(groups is None)
        try:
            self._step(grads, groups)
            return read()
        finally:
            self._restore(saved)

    def _step(self, grads: Sequence[torch.Tensor], groups: Optional[List[dict]] = None) -> List[dict]:
        """One real step with ``grads``; with ``groups``, on a :class:`RoundView` of them: returns,
        per group, the keys the step wrote into its copy (empty without ``groups``)."""
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            if groups is None:
                self.optimizer.step()
                return []
            before = [dict(g) for g in groups]
            type(self.optimizer).step(RoundView(self.optimizer, groups))
            return [{k: v for k, v in g.items() if b.get(k, _MISSING) is not v} for g, b in zip(groups, before)]
        finally:
            for m in self.masters:
                m.grad = None

    # -- snapshot / restore of everything a step may change ------------------------------
    def _snapshot(self, with_groups: bool = True):
        state = {}
        for m in self.masters:
            entries = self.optimizer.state.get(m)
            state[m] = None if entries is None else {
                k: (v, v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                for k, v in entries.items()
            }
        # (value, copy): a value the step did not replace is left as it is on restore, so a
        # setting written meanwhile from another thread is not reverted.
        groups = [{k: (v, v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                   for k, v in g.items() if k != _GROUP_PARAMS} for g in self.optimizer.param_groups
                  ] if with_groups else None
        masters = [m.detach().clone() for m in self.masters]
        return state, groups, masters

    def _restore(self, saved) -> None:
        state, groups, masters = saved
        with torch.no_grad():
            for m, value in zip(self.masters, masters):
                m.copy_(value)
        for m, entries in state.items():
            if entries is None:
                self.optimizer.state.pop(m, None)
                continue
            restored = {}
            for k, (orig, value) in entries.items():
                if torch.is_tensor(orig):
                    # Keep the original tensor objects: other code (DeepSpeed's hp-param links)
                    # may hold references to them.
                    with torch.no_grad():
                        orig.copy_(value)
                    restored[k] = orig
                else:
                    restored[k] = value
            self.optimizer.state[m] = restored
        for g, values in zip(self.optimizer.param_groups, groups or ()):
            for k in [k for k in g if k != _GROUP_PARAMS and k not in values]:
                del g[k]
            for k, (orig, value) in values.items():
                if torch.is_tensor(orig):
                    with torch.no_grad():
                        orig.copy_(value)
                    g[k] = orig
                elif g.get(k, _MISSING) is not orig:
                    g[k] = value


@contextlib.contextmanager
def applied_settings(optimizer: torch.optim.Optimizer, settings: Optional[Sequence[dict]] = None,
                     lr_scale: float = 1.0):
    """For a real ``optimizer.step()``, which reads its param groups: each group holds ``settings``
    (captured when the round was launched) with the learning rate × ``lr_scale`` for the duration,
    then what it held before. A value that someone else (a scheduler on the compute thread)
    replaced meanwhile is kept: only values still ours are restored. A scheduler that computes
    from the current value (torch's chainable schedulers) would compute from ours, so step such
    schedulers between rounds (DeepSpeed's ``lr_scheduler``, which ACCO steps itself) or use an
    optimizer with a functional step, which never writes the groups. A tensor learning rate
    cannot be scaled (it may be updated in place): refused."""
    groups = optimizer.param_groups
    if settings is not None and len(settings) != len(groups):
        raise ValueError(f"settings for {len(settings)} param groups, the optimizer has {len(groups)}")
    wanted = []
    for i, g in enumerate(groups):
        mine = {k: v for k, v in (settings[i] if settings is not None else {}).items() if not _same(g.get(k, _MISSING), v)}
        if lr_scale != 1.0:
            lr = mine.get("lr", g["lr"])
            if torch.is_tensor(lr):
                raise ValueError("acco.dynamic.lr_scaling with a tensor learning rate and an optimizer without a "
                                 f"functional step ({type(optimizer).__name__}): the scaled rate cannot be undone "
                                 "safely; fix: use a float lr, or set acco.dynamic.lr_scaling to 'none'")
            mine["lr"] = lr * lr_scale
        wanted.append(mine)
    if not any(wanted):
        yield
        return
    saved = [{k: g.get(k, _MISSING) for k in mine} for g, mine in zip(groups, wanted)]
    try:
        for g, mine in zip(groups, wanted):
            g.update(mine)
        yield
    finally:
        for g, mine, before in zip(groups, wanted, saved):
            for k, ours in mine.items():
                if _same(g.get(k, _MISSING), ours):
                    if before[k] is _MISSING:
                        g.pop(k, None)
                    else:
                        g[k] = before[k]


def scaled_lr(optimizer: torch.optim.Optimizer, factor: float):
    """Every param group's learning rate × ``factor`` for the duration (:func:`applied_settings`)."""
    return applied_settings(optimizer, None, factor)


def _same(a, b) -> bool:
    """Whether a group still holds the value we wrote: the same object, or an equal plain value."""
    if a is b:
        return True
    if torch.is_tensor(a) or torch.is_tensor(b):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 -- an exotic value: not ours
        return False


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def global_norm_sq(grads: List[torch.Tensor], chunk_elems: Optional[int] = None) -> torch.Tensor:
    """Sum of squares of this rank's shard gradients, in fp64 (for a stable all-reduce).

    Window by window (:func:`.chunking.windows`; ``chunk_elems`` None: chosen for the device): the
    window's pieces of every gradient are copied into one reused fp64 buffer (one foreach kernel)
    and summed with one dot product. The only temporary is chunk-sized, never shard-sized
    (``g.double()`` would cost 8 bytes per element), and the kernel count follows the windows,
    not the number of gradient tensors.
    """
    flats = [_local(g).detach().reshape(-1) for g in grads]  # views for the contiguous shards we get
    device = flats[0].device
    total_elems = sum(f.numel() for f in flats)
    chunk = chunk_elems if chunk_elems is not None else chunking.chunk_elements(device, total_elems)
    if chunk < 1:
        raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
    total = torch.zeros((), dtype=torch.float64, device=device)
    buf = None
    for window in chunking.windows([f.numel() for f in flats], chunk):
        if buf is None:
            buf = torch.empty(min(chunk, total_elems), dtype=torch.float64, device=device)
        torch._foreach_copy_(chunking.slots_in(buf, window), chunking.pieces_of(flats, window))
        part = buf.narrow(0, 0, chunking.window_size(window))
        total += torch.dot(part, part)
    return total
