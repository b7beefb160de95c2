"""When the LR scheduler steps relative to the commits, and how a skipped commit's step is taken back."""
from __future__ import annotations

import logging
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from ..round.kinds import RoundKind
from .scheduler_undo import NotUndoable, SchedulerUndo, undoable

logger = logging.getLogger("ds_acco")


class LRBookkeeping:
    """When the LR scheduler steps, relative to the commits (ACCO.md: both rounds of step t use
    step t's learning rate; the scheduler advances once per applied commit).

    Every round captures the optimizer's settings when it is launched (``ShardOptimizer.settings``),
    so the scheduler may step as soon as the commit of step t is launched -- where stock steps it,
    after its optimizer step -- and the estimate of step t+1, launched later, reads step t+1's
    rate. Stepping at the collection instead (a phase later) would leave the learning rate that a
    caller reads after ``step()`` one step behind stock's. Whether the commit is applied is known
    only at its collection, and stock never steps the scheduler for a skipped optimizer step
    (non-finite gradient, fp16 overflow): a skipped commit has its scheduler step cancelled if
    still owed, else undone through the scheduler's protocol (:class:`.scheduler_undo.SchedulerUndo`).
    A step that the caller takes itself for the commit in flight (:meth:`caller_step`: Accelerate's
    scheduler, the HF Trainer's) is undone the same way.

    A scheduler that cannot be undone -- no ``state_dict()`` / ``load_state_dict()``, a state that
    cannot be copied, or a load that does not restore a live scheduler and no inverse step -- is
    stepped only once its commit is known applied, at the commit's collection, before the next round
    is launched: every round still uses stock's settings, but the learning rate read right after
    ``step()`` lags one phase (one warning says so)."""

    def __init__(self, step: Callable[[], Any], scheduler: Callable[[], Any],
                 optimizer: Callable[[], torch.optim.Optimizer]):
        """``step`` steps the scheduler that ``scheduler()`` returns, or None when there is none
        (then ``step`` is never called): the host's ``step_lr_scheduler`` and ``lr_scheduler``."""
        self._step, self._scheduler, self._optimizer = step, scheduler, optimizer
        self._owed = False  # a launched commit's scheduler step not yet taken
        self._commit_in_flight = False  # a commit launched and not yet collected
        self._undos: List[SchedulerUndo] = []  # the scheduler steps taken for the commit in flight, in order
        # The commit launched last was collected skipped before the caller stepped its scheduler for it
        # (the synchronous warm-up collects it inside the step() that launched it): that step is not taken.
        self._collected_skipped = False
        self._deferred = False  # our scheduler has no undo: stepped at the collection of an applied commit
        self._no_undo: dict = {}  # id(scheduler) -> why it cannot be undone, once found out
        self._warned: set = set()

    def launched(self, kind: RoundKind) -> None:
        if kind is not RoundKind.COMMIT:
            return
        # The optimizer step of this step is taken (by the round, which may never call
        # optimizer.step(): the functional commit). torch's schedulers warn "lr_scheduler.step()
        # before optimizer.step()" at their first step unless the wrapper they put on
        # optimizer.step recorded a call, so record it here as that wrapper does; a scheduler
        # stepped before the first commit is launched still warns, as in stock.
        self._optimizer()._opt_called = True
        self._commit_in_flight, self._undos, self._collected_skipped = True, [], False
        scheduler = self._scheduler()
        if scheduler is None:
            return
        self._owed, self._deferred = True, False
        why = undoable(scheduler) or self._no_undo.get(id(scheduler))
        if why is not None:
            self._defer(scheduler, why)

    def step_owed(self) -> None:
        """Take the scheduler step owed for the commit launched last (unless it waits for the
        commit's collection, see the class docstring)."""
        if not self._owed or self._deferred:
            return
        self._owed = False
        scheduler = self._scheduler()
        try:
            self._undos.append(SchedulerUndo.around(scheduler, self._optimizer(), self._step))
        except NotUndoable as exc:  # raised before the step: take it at the collection instead
            self._owed = True
            self._no_undo[id(scheduler)] = str(exc)
            self._defer(scheduler, str(exc))

    def caller_step(self, scheduler, step: Callable[[], None]) -> None:
        """``step()`` steps ``scheduler``, which the caller steps itself once per optimizer step
        right after the ``step()`` that launched a commit (stock skips it for a skipped step): taken
        now, and undone if the commit in flight turns out skipped. With no commit in flight it is
        only taken; with the commit already collected skipped, not taken (stock skips it)."""
        if self._collected_skipped:
            return
        why = undoable(scheduler) or self._no_undo.get(id(scheduler))
        if not self._commit_in_flight or why is not None:
            if why is not None:
                self._warn_caller_scheduler(scheduler, why)
            step()
            return
        try:
            self._undos.append(SchedulerUndo.around(scheduler, self._optimizer(), step))
        except NotUndoable as exc:
            self._no_undo[id(scheduler)] = str(exc)
            self._warn_caller_scheduler(scheduler, str(exc))
            step()

    def collected(self, skipped: bool) -> str:
        """The commit launched last was collected: ``skipped`` or applied. Returns what was done
        (:attr:`~ds_acco.core.lifecycle.host.CommitEvent.lr_scheduler`): ``"undone"`` (skipped: the
        scheduler steps taken for it are taken back, one still owed is never taken), ``"stepped"``
        (applied: the deferred step of a scheduler that cannot be undone, taken now) or ``"kept"``."""
        undos, self._undos, self._commit_in_flight = self._undos, [], False
        self._collected_skipped = skipped
        if skipped:
            self._owed = False  # a step still owed is never taken
            optimizer = self._optimizer()
            for undo in reversed(undos):
                try:
                    undo.revert(optimizer)
                except NotUndoable as exc:  # nothing was changed: this step stays
                    self._no_undo[id(undo.scheduler)] = str(exc)
                    if undo.scheduler is self._scheduler():
                        self._warn_once(undo.scheduler, f"ACCO: a skipped commit's step of the LR scheduler "
                                                        f"{type(undo.scheduler).__name__} cannot be undone ({exc}): "
                                                        "the schedule runs one step ahead of stock's from here; ACCO "
                                                        "steps it only once a commit is known applied from now on; "
                                                        "fix: a load_state_dict() that restores a live scheduler")
                    else:
                        self._warn_caller_scheduler(undo.scheduler, str(exc))
            return "undone"
        if self._owed and self._deferred:
            self._owed = False
            self._step()
            return "stepped"
        return "kept"

    def _defer(self, scheduler, why: str) -> None:
        self._deferred = True
        self._warn_once(scheduler, f"ACCO: the LR scheduler {type(scheduler).__name__} cannot be undone ({why}), so "
                                   "ACCO steps it only once a commit is known applied, at the commit's collection "
                                   "(a phase after stock steps it): every round uses stock's learning rate, but the "
                                   "rate read right after step() lags one step behind stock's; fix: give the "
                                   "scheduler state_dict() and a load_state_dict() that restores it")

    def _warn_caller_scheduler(self, scheduler, why: str) -> None:
        self._warn_once(scheduler, f"ACCO: the LR scheduler {type(scheduler).__name__} that the caller steps cannot "
                                   f"be undone ({why}): after each skipped commit (non-finite gradient, fp16 "
                                   "overflow) its schedule runs one step ahead of stock's; fix: give it state_dict() "
                                   "and a load_state_dict() that restores it")

    def _warn_once(self, scheduler, message: str) -> None:
        if id(scheduler) in self._warned:
            return
        self._warned.add(id(scheduler))
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(message)
