"""Undoing one LR-scheduler step, through the scheduler's own protocol.

ACCO steps the scheduler right after a commit is launched (where stock steps it) and learns only
at the commit's collection, a phase later, whether the commit was applied. A skipped commit
(non-finite gradient, fp16 overflow) must leave the schedule where stock leaves it: stock never
takes that scheduler step (DeepSpeed's ``_take_model_step`` steps the scheduler only after an
applied optimizer step; Accelerate's scheduler and the HF Trainer check ``step_was_skipped``).

:meth:`SchedulerUndo.around` takes the step and keeps what undoing it needs:

* the scheduler's ``state_dict()`` from before the step, copied. Never the scheduler's attributes:
  composite schedulers (``SequentialLR``, ``ChainedScheduler``) keep child schedulers that hold
  the optimizer, and a copy of those would copy the whole optimizer with its state at every
  commit -- and loading it back would point the children at that copy, freezing the real
  learning rate. ``state_dict()`` leaves the optimizer out by contract; the copy is also told never
  to copy the optimizer, should a scheduler's state reach it anyway;
* of the param groups' settings, exactly those the step changed (before and after);
* the step's inverse, when whoever stepped it knows one (Megatron's ``step(increment=n)`` is
  undone by ``step(increment=-n)``).

:meth:`SchedulerUndo.revert` loads the state back and puts back each changed setting that still
holds what the step wrote. A setting the step did not change is not touched, and one that
someone else wrote since (the caller's own code, another scheduler) keeps that writer's value.
``load_state_dict()`` restores a live scheduler for torch's, transformers' and DeepSpeed's
schedulers; Megatron's ``OptimizerParamScheduler.load_state_dict`` instead re-applies the loaded
step count *on top of* the current one (it expects a fresh scheduler), which would corrupt the
schedule. So the first time a class is undone, its load is tried on a copy of the scheduler
(:func:`load_restores`); a class whose load does not restore is undone by the step's inverse, or
not at all (:class:`NotUndoable`).

A scheduler without ``state_dict()`` / ``load_state_dict()``, or whose state cannot be copied,
has no undo: :func:`undoable` says so first (or :meth:`SchedulerUndo.around` raises
:class:`NotUndoable` before taking the step), and the caller keeps its step until the commit is
known applied.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional

import torch

from ..step.functional_step import capture_settings

_MISSING = object()
_LOAD_RESTORES: Dict[type, bool] = {}  # per scheduler class: whether load_state_dict() restores a live one


class NotUndoable(Exception):
    """The scheduler step cannot be undone: its state cannot be copied (raised before the step is
    taken), or its ``load_state_dict()`` does not restore a live scheduler and no inverse is known."""


@dataclasses.dataclass(frozen=True)
class SettingChange:
    """One param-group setting a step changed: ``group``'s ``key`` from ``before`` to ``after``
    (``_MISSING``: the key was absent). Tensor values are clones."""
    group: int
    key: str
    before: Any
    after: Any


def undoable(scheduler) -> Optional[str]:
    """None when ``scheduler`` speaks the ``state_dict()`` / ``load_state_dict()`` protocol, else
    what it lacks (for the warning)."""
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(scheduler, m, None))]
    return f"no {' / '.join(m + '()' for m in missing)}" if missing else None


def _memo(scheduler, optimizer) -> dict:
    """deepcopy's memo that keeps the optimizer (the scheduler's and ours) from ever being copied."""
    return {id(o): o for o in (optimizer, getattr(scheduler, "optimizer", None)) if o is not None}


def copied_state(scheduler, optimizer) -> dict:
    """A copy of ``scheduler.state_dict()`` that shares nothing mutable with the scheduler and never
    copies the optimizer (a reference to it stays a reference)."""
    return copy.deepcopy(scheduler.state_dict(), _memo(scheduler, optimizer))


def load_restores(scheduler, optimizer, state: dict) -> bool:
    """Whether ``scheduler.load_state_dict(state)`` puts a live scheduler back into ``state``.

    Tried once per class, on a copy of ``scheduler`` (its optimizer shared, not copied) whose
    writes to the optimizer's param groups are put back: after the load the copy's
    ``state_dict()`` must equal ``state``. Call it with ``state`` different from the scheduler's
    current one (a step apart), or an additive load looks like a restore."""
    cls = type(scheduler)
    verdict = _LOAD_RESTORES.get(cls)
    if verdict is None:
        groups = capture_settings(optimizer)
        try:
            trial = copy.deepcopy(scheduler, _memo(scheduler, optimizer))
            trial.load_state_dict(copy.deepcopy(state, _memo(scheduler, optimizer)))
            verdict = _same_state(trial.state_dict(), state)
        except Exception:  # noqa: BLE001 -- a scheduler that cannot be tried is not known to restore
            verdict = False
        finally:
            _put_back(optimizer, groups)
        _LOAD_RESTORES[cls] = verdict
    return verdict


def setting_changes(before: List[dict], after: List[dict]) -> List[SettingChange]:
    """The settings that differ between two :func:`~.functional_step.capture_settings` of the same
    optimizer. A tensor setting counts as changed without being compared (comparing would read a
    device tensor on the host at every commit); :meth:`SchedulerUndo.revert` compares it, on a skip only."""
    out = []
    for i, (b, a) in enumerate(zip(before, after)):
        for key in list(b) + [k for k in a if k not in b]:
            old, new = b.get(key, _MISSING), a.get(key, _MISSING)
            if torch.is_tensor(old) or torch.is_tensor(new) or not _equal(old, new):
                out.append(SettingChange(i, key, old, new))
    return out


@dataclasses.dataclass
class SchedulerUndo:
    """What undoing one step of ``scheduler`` needs (see the module docstring)."""
    scheduler: Any
    state: dict
    changes: List[SettingChange]
    inverse: Optional[Callable[[], Any]] = None

    @classmethod
    def around(cls, scheduler, optimizer, step: Callable[[], Any]) -> "SchedulerUndo":
        """Take ``step()`` (one step of ``scheduler``, which writes ``optimizer``'s param groups;
        it may return the step's inverse, a callable) and return its undo. The scheduler must be
        :func:`undoable`; a state that cannot be copied raises :class:`NotUndoable` before the step
        is taken."""
        try:
            state = copied_state(scheduler, optimizer)
        except Exception as exc:  # noqa: BLE001 -- whatever deepcopy or a user's state_dict() raises
            raise NotUndoable(f"its state_dict() cannot be copied: {type(exc).__name__}: {exc}") from exc
        before = capture_settings(optimizer)
        inverse = step()
        return cls(scheduler, state, setting_changes(before, capture_settings(optimizer)),
                   inverse if callable(inverse) else None)

    def revert(self, optimizer) -> None:
        """The scheduler's state as before the step, and each setting the step changed as before it
        where the group still holds what the step wrote. Raises :class:`NotUndoable` (having
        changed nothing) when the scheduler's load does not restore and no inverse is known."""
        if load_restores(self.scheduler, optimizer, self.state):
            self.scheduler.load_state_dict(self.state)  # the scheduler takes the copy over: used once
        elif self.inverse is not None:
            self.inverse()
        else:
            raise NotUndoable(f"its load_state_dict() does not restore a live {type(self.scheduler).__name__} "
                              "(tried on a copy) and no inverse of its step is known")
        groups = optimizer.param_groups
        for c in self.changes:
            group = groups[c.group]
            current = group.get(c.key, _MISSING)
            if not _equal(current, c.after):
                continue  # written since by someone else, or not changed at all (a tensor): theirs stays
            _set(group, c.key, current, c.before)


def _set(group: dict, key: str, current, value) -> None:
    if value is _MISSING:
        group.pop(key, None)
    elif torch.is_tensor(current) and torch.is_tensor(value) and current.shape == value.shape:
        with torch.no_grad():
            current.copy_(value)  # in place, as torch's schedulers write a tensor learning rate
    else:
        group[key] = value


def _put_back(optimizer, captured: List[dict]) -> None:
    """Every param group's settings exactly as ``captured`` (:func:`capture_settings`)."""
    for group, settings in zip(optimizer.param_groups, captured):
        for key in [k for k in group if k != "params" and k not in settings]:
            del group[key]
        for key, value in settings.items():
            if not _equal(group.get(key, _MISSING), value):
                _set(group, key, group.get(key, _MISSING), value)


def _equal(a, b) -> bool:
    """Whether two setting values are the same value (tensors: same dtype, shape and elements)."""
    if a is b:
        return True
    if a is _MISSING or b is _MISSING:
        return False
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 -- a value without a plain equality: not provably the same
        return False


def _same_state(a, b) -> bool:
    """Whether two scheduler states hold the same values (nested dicts and lists; tensors by value;
    NaN equals NaN; callables by identity)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return _equal(a, b)


__all__ = ["NotUndoable", "SchedulerUndo", "SettingChange", "copied_state", "load_restores", "setting_changes",
           "undoable"]
