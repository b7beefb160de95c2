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
* of the param groups' settings, exactly those the step changed (before and after).

:meth:`SchedulerUndo.revert` loads the state back and puts back each changed setting that still
holds what the step wrote. A setting the step did not change is not touched, and one that
someone else wrote since (the caller's own code, another scheduler) keeps that writer's value.

A scheduler without ``state_dict()`` / ``load_state_dict()``, or whose state cannot be copied,
has no undo: :func:`undoable` says so first (or :meth:`SchedulerUndo.around` raises
:class:`NotUndoable` before taking the step), and the caller keeps its step until the commit is
known applied.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List, Optional

import torch

from .functional_step import capture_settings

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class SettingChange:
    """One param-group setting a step changed: ``group``'s ``key`` from ``before`` to ``after``
    (``_MISSING``: the key was absent). Tensor values are clones."""
    group: int
    key: str
    before: Any
    after: Any


class NotUndoable(Exception):
    """The scheduler's state cannot be copied: its step would have no undo (it is not taken)."""


def undoable(scheduler) -> Optional[str]:
    """None when ``scheduler`` speaks the ``state_dict()`` / ``load_state_dict()`` protocol, else
    what it lacks (for the warning)."""
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(scheduler, m, None))]
    return f"no {' / '.join(m + '()' for m in missing)}" if missing else None


def copied_state(scheduler, optimizer) -> dict:
    """A copy of ``scheduler.state_dict()`` that shares nothing mutable with the scheduler and never
    copies the optimizer (a reference to it stays a reference)."""
    memo = {id(o): o for o in (optimizer, getattr(scheduler, "optimizer", None)) if o is not None}
    return copy.deepcopy(scheduler.state_dict(), memo)


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

    @classmethod
    def around(cls, scheduler, optimizer, step: Callable[[], None]) -> "SchedulerUndo":
        """Take ``step()`` (one step of ``scheduler``, which writes ``optimizer``'s param groups) and
        return its undo. The scheduler must be :func:`undoable`; a state that cannot be copied
        raises :class:`NotUndoable` before the step is taken."""
        try:
            state = copied_state(scheduler, optimizer)
        except Exception as exc:  # noqa: BLE001 -- whatever deepcopy or a user's state_dict() raises
            raise NotUndoable(f"its state_dict() cannot be copied: {type(exc).__name__}: {exc}") from exc
        before = capture_settings(optimizer)
        step()
        return cls(scheduler, state, setting_changes(before, capture_settings(optimizer)))

    def revert(self, optimizer) -> None:
        """The scheduler's state as before the step, and each setting the step changed as before it
        where the group still holds what the step wrote."""
        self.scheduler.load_state_dict(self.state)  # the scheduler takes the copy over: used once
        groups = optimizer.param_groups
        for c in self.changes:
            group = groups[c.group]
            current = group.get(c.key, _MISSING)
            if not _equal(current, c.after):
                continue  # written since by someone else, or not changed at all (a tensor): theirs stays
            if c.before is _MISSING:
                del group[c.key]
            elif torch.is_tensor(current) and torch.is_tensor(c.before) and current.shape == c.before.shape:
                with torch.no_grad():
                    current.copy_(c.before)  # in place, as torch's schedulers write a tensor learning rate
            else:
                group[c.key] = c.before


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


__all__ = ["NotUndoable", "SchedulerUndo", "SettingChange", "copied_state", "setting_changes", "undoable"]
