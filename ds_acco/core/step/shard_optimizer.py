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

A round uses the settings captured at its launch (and the estimate its learning rate × the
estimate's ``lr_scale``), while the compute thread may read the param groups (a logger,
``engine.get_lr()``) or write them (a scheduler) as it runs. The functional steps only read those
settings. A real step reads the param groups, so it runs on a view of the optimizer whose groups
are the round's own copies (:class:`RoundView`): the groups the compute thread sees are never
written on the lane, and a tensor learning rate is scaled out of place. A step that does not read
its learning rate there (a wrapper stepping an inner optimizer), or an instance's own ``step``
override, cannot take the round's settings: refused at the first round, before any kept step (an
optimizer not known to read them is probed once on a discarded, snapshot-and-restored step).
"""
from __future__ import annotations

import copy
import inspect
import types
from typing import Callable, List, Optional, Sequence, TypeVar

import torch

from . import chunking, functional_commit, functional_step
from .chunking import local
from .functional_commit import step_overridden
from .functional_step import GROUP_PARAMS
_MISSING = object()
T = TypeVar("T")


class RoundGroup(dict):
    """A round's copy of a param group; notes whether the step may have read its learning rate: by
    key (``group["lr"]``, ``get``, ``pop``, ``setdefault``) or through the whole group (iteration,
    ``keys``, ``items``, ``values``, ``copy``, ``copy.copy``). ``__iter__`` being overridden sends
    CPython's dict merges (``dict(group)``, ``{**group}``, ``f(**group)``, ``update``) through
    ``keys()`` and ``__getitem__`` rather than its fast path (checked in tests/core/test_lr_rule.py)."""

    lr_read = False

    def _whole(self):
        self.lr_read = True
        return self

    def __getitem__(self, key):
        if key == "lr":
            self.lr_read = True
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        if key == "lr":
            self.lr_read = True
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        return self[key] if key in self else dict.setdefault(self, key, default)

    def __iter__(self):
        return dict.__iter__(self._whole())

    def keys(self):
        return dict.keys(self._whole())

    def items(self):
        return dict.items(self._whole())

    def values(self):
        return dict.values(self._whole())

    def copy(self):
        return dict(dict.items(self._whole()))


class RoundView:
    """``optimizer`` as one round's real step sees it: ``param_groups`` are the round's own copies
    (its captured settings, :func:`.functional_step.step_groups`); its class's methods and properties
    are bound to the view (a helper method reading ``self.param_groups`` reads the round's); every
    other attribute is the optimizer's own (its state, a C++ optimizer's handle). The step then
    never reads or writes the groups that the compute thread reads and writes meanwhile. How each
    name resolves is looked up once per view (a step reads ``self.state`` once per parameter)."""

    __slots__ = ("_optimizer", "param_groups", "_found")

    def __init__(self, optimizer: torch.optim.Optimizer, groups: List[dict]):
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "param_groups", groups)
        object.__setattr__(self, "_found", {})

    def __getattr__(self, name):
        optimizer = object.__getattribute__(self, "_optimizer")
        cache = object.__getattribute__(self, "_found")
        found = cache.get(name, _MISSING)
        if found is _MISSING:
            found = inspect.getattr_static(type(optimizer), name, None)
            found = cache[name] = found if isinstance(found, (property, types.FunctionType)) else None
        if found is not None and (isinstance(found, property) or name not in vars(optimizer)):
            return found.__get__(self, type(optimizer))  # as Python binds it: an instance attribute wins
        return getattr(optimizer, name)

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
        owned = {id(p) for g in optimizer.param_groups for p in g[GROUP_PARAMS]}
        if owned != {id(m) for m in self.masters}:
            raise ValueError("the optimizer must own exactly the shard parameters")
        if chunk_elems is not None and chunk_elems < 1:
            raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
        self.chunk_elems = chunk_elems
        # Whether a real step reads its learning rate from ``self.param_groups`` (the round's own, on a
        # RoundView): torch's and registered optimizers do; any other is found out by its first real step
        # on a round's own settings, one whose result is discarded (_reads_round_groups).
        self._reads_groups: Optional[bool] = None

    @property
    def functional(self) -> bool:
        """Whether :meth:`estimate_into` runs without a snapshot (checked per call: a param
        group's settings may change during training, e.g. a tensor learning rate)."""
        return functional_step.supports(self.optimizer) and all(local(m).is_contiguous() for m in self.masters)

    @property
    def functional_commit(self) -> bool:
        """Whether :meth:`commit` updates θ and S in place chunk by chunk (torch SGD/Adam/AdamW
        without step hooks; checked per call) rather than through ``optimizer.step()``."""
        return functional_commit.supports_commit(self.optimizer) and all(local(m).is_contiguous() for m in self.masters)

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
        real step on a :class:`RoundView`, and what that step wrote into a group (FusedAdam's
        ``step``) is copied into the optimizer's group after it.

        ``settings``: the param groups' settings the step uses (:meth:`settings`, captured when the
        round was launched; default: the current ones). ``lr_scale``: the step uses each group's
        learning rate × this (dynamic mode's ``lr_scaling``). Neither is written into the
        optimizer's param groups."""
        if len(grads) != len(self.masters):
            raise ValueError(f"expected {len(self.masters)} gradients, got {len(grads)}")
        if self.functional_commit:
            functional_commit.commit_in_place(self.optimizer, self.masters, grads, self.chunk_elems, lr_scale, settings)
        else:
            groups = functional_step.step_groups(self.optimizer, settings, lr_scale)
            own = _own_settings(groups, settings, lr_scale)
            if own and self._reads_groups is None and not self._known_reader():
                # decided on a discarded step (its shards, state and gradients restored), never on a kept one
                self.estimate([g.clone() for g in grads], lambda: None, _cloned(groups), own=True)
            for group, written in zip(self.optimizer.param_groups, self._step(grads, groups, own)):
                _write_back(group, written)
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
                    src, dst = local(m).detach(), local(out)
                    if dst.numel() != src.numel():
                        raise ValueError(f"output has {dst.numel()} elements, shard {src.numel()}")
                    dst.view(-1).copy_(src.reshape(-1))

        groups = functional_step.step_groups(self.optimizer, settings, lr_scale)
        self.estimate(grads, copy_out, groups, own=_own_settings(groups, settings, lr_scale))

    def estimate(self, grads: Sequence[torch.Tensor], read: Callable[[], T],
                 groups: Optional[List[dict]] = None, own: bool = False) -> T:
        """Returns ``read()`` called right after Opt(θ, S, g); θ and S are then restored exactly.

        The snapshot path, for any optimizer: while it runs, a clone of every master shard and
        of every optimizer-state tensor is held (see the module docstring). The step runs on a
        :class:`RoundView` of ``groups`` (default: copies of the current param groups, see
        :func:`.functional_step.step_groups`); what it writes there is dropped. ``own``: the
        groups hold the round's own settings (see :meth:`_step`)."""
        saved = self._snapshot()
        try:
            self._step(grads, functional_step.step_groups(self.optimizer) if groups is None else groups, own,
                       discarded=True)
            return read()
        finally:
            self._restore(saved)

    def _known_reader(self) -> bool:
        if self._reads_groups is None and _reads_own_groups(self.optimizer):
            self._reads_groups = True
        return bool(self._reads_groups)

    def _step(self, grads: Sequence[torch.Tensor], groups: List[dict], own: bool = False,
              discarded: bool = False) -> List[dict]:
        """One real step with ``grads`` on a :class:`RoundView` of ``groups`` (one copy per param
        group): returns, per group, what the step wrote into its copy (key -> (value, written in
        place)). ``own``: the groups hold the round's own settings (captured at its launch, or a
        scaled rate), which can differ from the live ones: refused, before any step, for an
        instance's own ``step`` override (it runs on the optimizer's own groups) and for a step found
        not to read its learning rate there; found out on a ``discarded`` step only."""
        if own and step_overridden(self.optimizer):
            raise ValueError(_refused(self.optimizer, "its step() is overridden on the instance (it runs on the "
                                      "optimizer's own param groups)"))
        if own and self._reads_groups is False:
            raise ValueError(_refused(self.optimizer, _NOT_READ))
        if own and not self._known_reader() and not discarded:
            raise RuntimeError("a kept step on a round's own settings before its optimizer was probed")
        rounds = [RoundGroup(g) for g in groups]
        before = [dict(g) for g in groups]
        values = [{k: v.clone() for k, v in g.items() if torch.is_tensor(v)} for g in before]
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            if not own and step_overridden(self.optimizer):
                self.optimizer.step()  # the groups are the optimizer's own settings
                return [{} for _ in rounds]
            type(self.optimizer).step(RoundView(self.optimizer, rounds))
        finally:
            for m in self.masters:
                m.grad = None
        if own and self._reads_groups is None:
            self._reads_groups = any(r.lr_read for r in rounds)
            if not self._reads_groups:
                raise ValueError(_refused(self.optimizer, _NOT_READ))
        return [{k: (v, b.get(k, _MISSING) is v) for k, v in dict.items(r)
                 if b.get(k, _MISSING) is not v or (k in was and not torch.equal(v, was[k]))}
                for r, b, was in zip(rounds, before, values)]

    # -- snapshot / restore of everything a step may change ------------------------------
    def _snapshot(self):
        state = {}
        for m in self.masters:
            entries = self.optimizer.state.get(m)
            state[m] = None if entries is None else {
                k: (v, v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                for k, v in entries.items()
            }
        masters = [m.detach().clone() for m in self.masters]
        return state, masters

    def _restore(self, saved) -> None:
        state, masters = saved
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


_NOT_READ = "its step() does not read the learning rate from self.param_groups (e.g. a wrapper stepping an inner optimizer)"


def _own_settings(groups: Sequence[dict], settings, lr_scale: float) -> bool:
    """Whether a round's groups can hold settings other than the live groups' (captured at its launch,
    or a scaled rate) that a step must take: whenever a group has a learning rate to take."""
    return (settings is not None or lr_scale != 1.0) and any(g.get("lr") is not None for g in groups)


def _reads_own_groups(optimizer) -> bool:
    """torch's optimizers and the classes an adapter registered (:func:`.functional_step.register_estimate`)
    read their settings from ``self.param_groups``."""
    step = inspect.unwrap(type(optimizer).step)  # (torch's profiler wrapper of the class's step)
    return getattr(step, "__module__", "").startswith("torch.optim.") or functional_step.registered(optimizer)


def _cloned(groups: Sequence[dict]) -> List[dict]:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()} for g in groups]


def _write_back(group: dict, written: dict) -> None:
    """Copy what a kept step wrote into a round's group into the live ``group``: a new object as is, a
    tensor the step updated in place into the live tensor (as the step would have: same object)."""
    for k, (value, in_place) in written.items():
        live = group.get(k)
        if in_place and torch.is_tensor(live) and live is not value and live.shape == value.shape:
            with torch.no_grad():
                live.copy_(value)
        elif not (in_place and live is value):
            group[k] = value


def _refused(optimizer, why: str) -> str:
    return (f"{type(optimizer).__name__}: a round's step must take the round's own settings (the estimate's learning "
            "rate × acco.estimate.lr_scale, acco.dynamic.lr_scaling's rate, the settings captured at the round's "
            f"launch), which can differ from its param groups' (an LR scheduler steps them meanwhile), and {why}; "
            "ACCO never writes them into the param groups the compute thread reads; fix: use an optimizer whose "
            "step() reads its settings from self.param_groups (move an instance's step override into a step hook: "
            "register_step_pre_hook)")


def global_norm_sq(grads: List[torch.Tensor], chunk_elems: Optional[int] = None) -> torch.Tensor:
    """Sum of squares of this rank's shard gradients, in fp64 (for a stable all-reduce).

    Window by window (:func:`.chunking.windows`; ``chunk_elems`` None: chosen for the device): the
    window's pieces of every gradient are copied into one reused fp64 buffer (one foreach kernel)
    and summed with one dot product. The only temporary is chunk-sized, never shard-sized
    (``g.double()`` would cost 8 bytes per element), and the kernel count follows the windows,
    not the number of gradient tensors.
    """
    flats = [local(g).detach().reshape(-1) for g in grads]  # views for the contiguous shards we get
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
