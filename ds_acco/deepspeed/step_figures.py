"""DeepSpeed's own timers and per-step figures on an ACCO engine, counted once per optimizer step as stock counts them.

DeepSpeed's ``step()`` emits its per-step figures where ``is_gradient_accumulation_boundary()``
holds after its model step: the throughput timer's global step (its samples/sec line), the
monitor's ``Train/Samples/lr`` and ``Train/Samples/loss_scale`` events, and with
``wall_clock_breakdown`` the global timers' line and the ``Train/Samples/elapsed_time_ms_*``
events. ACCO ends a phase twice per optimizer step, so after the model step the engine answers
whether an optimizer step ended there: whether a commit was launched, at the micro-batch where
stock ends its step.

Stock writes those monitor events after its optimizer step, with the global sample count including
that step as the x axis and the learning rate after its scheduler step. ACCO knows both only when
the commit is collected, a phase later: the samples of a step are all ranks' (dynamic phases,
weighting by sample) and a skipped commit has its scheduler step undone then. So the events that
DeepSpeed's own ``step()`` writes for a step whose commit is in flight are held
(:class:`CommitStampedMonitor`) and written when it is booked, with that step's x axis and the
learning rate and loss scale of then: stock's figures for that step, one phase later (the last
step's at the drain: ``destroy()``, a save). Every other event written through ``engine.monitor``
(the user's own, ACCO's metrics) reaches the monitor at once and unchanged, as under stock.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from deepspeed.utils import logger


class CommitStampedMonitor:
    """DeepSpeed's monitor on an ACCO engine (``engine.monitor``): the per-step events DeepSpeed's
    own ``step()`` writes for a step whose commit is in flight are held and written at the commit's
    booking (:meth:`booked`); any other event is written at once, as given. Any other attribute is
    the wrapped monitor's (``MonitorMaster``: ``csv_monitor``, ...).

    Args:
        monitor: DeepSpeed's ``MonitorMaster``.
        holds: whether DeepSpeed's ``step()`` is emitting its per-step figures (after
            its model step) for a commit that was launched and not yet booked.
        current: per event name, how to read its value at the booking (an event not named keeps
            the value it was written with: the wall-clock timings of the step's own micro-batches).
    """

    def __init__(self, monitor, holds: Callable[[], bool], current: Dict[str, Callable[[], Any]]):
        self.monitor = monitor
        self._holds = holds
        self._current = current
        self._held: List[Tuple[str, Any]] = []

    def __getattr__(self, name):
        if name == "monitor":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.monitor, name)

    @property
    def enabled(self) -> bool:
        return self.monitor.enabled

    def write_events(self, event_list) -> None:
        if not self._holds():  # not DeepSpeed's step(), or booked already (a synchronous warm-up step)
            self.monitor.write_events(event_list)
            return
        self._held.extend((name, value) for name, value, _ in event_list)

    def booked(self, x) -> None:
        """A commit was booked and ``x`` is the global sample count with it: write what was held."""
        held, self._held = self._held, []
        if held:
            self.monitor.write_events([(name, self._current[name]() if name in self._current else value, x)
                                       for name, value in held])


def stamped_monitor(engine, driver) -> CommitStampedMonitor:
    """``engine.monitor`` wrapped for an ACCO engine, its lr and loss scale read as DeepSpeed reads them.
    DeepSpeed writes its per-step figures in ``step()`` after its model step, where the engine
    answers whether an optimizer step ended (``_acco_step_ended``, None outside that region)."""
    return CommitStampedMonitor(engine.monitor, lambda: bool(engine._acco_step_ended) and driver.commit_in_flight, {
        "Train/Samples/lr": lambda: engine.get_lr()[0],
        "Train/Samples/loss_scale": engine._get_optimizer_loss_scale,
    })


def unsynchronise_timers(engine) -> None:
    """DeepSpeed's throughput timer synchronises the whole device at every forward and every
    step() by default (``timers.throughput.synchronized``): on a GPU that waits for the lane's
    side stream, so no round would overlap compute. Under ACCO it times on the host instead,
    unless the config asks for the synchronisation explicitly (then a warning says what it
    costs); ``wall_clock_breakdown`` synchronises too and gets the same warning."""
    timer_cfg = getattr(engine.tput_timer, "config", None)
    asked = engine._config._param_dict.get("timers", {}).get("throughput", {}).get("synchronized")
    costly = []
    if timer_cfg is not None and getattr(timer_cfg, "synchronized", False):
        if asked is None:
            engine.tput_timer.config = timer_cfg.model_copy(update={"synchronized": False})
        else:
            costly.append("timers.throughput.synchronized = true")
    if engine.wall_clock_breakdown():
        costly.append("wall_clock_breakdown = true")
    if costly and engine.global_rank == 0:
        logger.warning(f"ACCO: {' and '.join(costly)} synchronise the whole device at every micro-batch, so "
                       "no communication round overlaps compute on a GPU; fix: remove them for training runs")
