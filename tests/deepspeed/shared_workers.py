"""Ranks that trace what the schedule does, per micro-batch and per round, through the real DeepSpeed
engine (tests/deepspeed/test_shared.py: accumulation 'shared' at equal shares does what fixed does).

The trace is the recording accelerator's log (ds_acco/testing/recording.py: the lane's stream
protocol, and every host read of a tensor value, as on an asynchronous device), with these entries
added, each on the thread that did it:
  * ``collective``: a call of :mod:`ds_acco.comm.collectives` (every collective ACCO issues goes
    through it) or of torch.distributed's object / barrier collectives;
  * ``submit`` / ``lane wait``: a round (or drain probe) handed to the lane, and the compute thread
    blocking on one, by the handle's name (its kind and step);
  * ``round``: a submitted function starting on the lane (what follows, on the lane, is that round);
  * ``decide`` / ``end phase``: the schedule's phase-end decision (once per micro-batch) and a
    phase end, so a wait moved from one to the other shows;
  * marks ``mb <i>`` (after micro-batch i's step()) and ``drain <i>`` / ``drained <i>`` (around
    an evaluation through ``ds_acco.committed_weights``).
"""
from __future__ import annotations

import functools
import os
import threading
import time

import torch.distributed as dist

import ds_acco
from ds_acco.comm import collectives
from ds_acco.testing.recording import Entry, RecordingAccelerator
from fixtures import TinyNet, batch, ds_config, make_optimizer
from stream_workers import LANE_THREAD, adam_step_counts

# what a schedule issues or waits for: the rest of the recording log (ops) is the model's own work
TRACED = ("mark", "read", "sync", "record", "wait", "collective", "submit", "lane wait", "round", "decide",
          "end phase")
COLLECTIVES = ("reduce_in_place", "gather_in_place", "gather_shards", "sum_scalars")
DIST_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "barrier", "broadcast")


class _Tracer:
    def __init__(self, acc: RecordingAccelerator):
        self.acc = acc

    def note(self, kind: str, what: str) -> None:
        with self.acc._lock:
            self.acc.log.append(Entry(kind, threading.current_thread().name, what=what))

    def wrap(self, owner, name: str, kind: str, what=None) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def traced(*args, **kwargs):
            self.note(kind, what(*args, **kwargs) if what is not None else name)
            return inner(*args, **kwargs)
        setattr(owner, name, traced)


def trace_run(case: dict) -> dict:
    """Train TinyNet through DeepSpeed's engine (``case``: gas, steps, acco block, sleep: seconds per
    micro-batch of this rank, drain_every: evaluate after every n-th micro-batch) with everything
    in the module docstring traced; returns each thread's trace (``compute``: the main thread, by
    micro-batch; ``lane``: the lane's thread, by round), the shares after each micro-batch and the
    final committed weights."""
    import ds_acco.deepspeed.optimizer as ds_opt
    from deepspeed.accelerator import get_accelerator
    rank = int(os.environ["RANK"])
    acc = RecordingAccelerator()
    tracer = _Tracer(acc)
    seam = ds_opt._stream_accelerator
    ds_opt._stream_accelerator = lambda device: acc
    try:
        model = TinyNet(seed=0)
        gas = case.get("gas", 4)
        opt = make_optimizer("adamw")(model)
        engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, config=ds_config(gas, case["acco"]))
    finally:
        ds_opt._stream_accelerator = seam
    acc.exclude_reads = adam_step_counts(opt)
    saved = {name: getattr(collectives, name) for name in COLLECTIVES}
    saved_dist = {name: getattr(dist, name) for name in DIST_COLLECTIVES}
    for name in COLLECTIVES:
        tracer.wrap(collectives, name, "collective")
    for name in DIST_COLLECTIVES:
        tracer.wrap(dist, name, "collective")
    schedule = engine.optimizer.schedule
    lane = schedule.lane
    tracer.wrap(schedule, "decide_phase_end", "decide")
    tracer.wrap(schedule, "end_phase", "end phase")
    tracer.wrap(lane, "wait", "lane wait", what=lambda handle: handle.name)
    inner_submit = lane.submit

    def submit(name, fn, **kwargs):
        tracer.note("submit", name)

        def traced_round():
            tracer.note("round", name)
            return fn()
        return inner_submit(name, traced_round, **kwargs)
    lane.submit = submit

    sleep = case.get("sleep", 0.0)
    drain_every = case.get("drain_every", 0)
    n = gas * case.get("steps", 6)
    shares = []
    try:
        with acc.recording(), acc.watching(get_accelerator()):
            for i in range(n):
                loss = engine(*batch(rank, i))
                engine.backward(loss)
                if sleep:
                    time.sleep(sleep)  # the same compute on every rank: equal shares
                engine.step()
                acc.mark(f"mb {i}")
                shares.append(getattr(schedule.phases, "shares", None))
                if drain_every and (i + 1) % drain_every == 0:
                    acc.mark(f"drain {i}")
                    with ds_acco.committed_weights(engine):
                        pass
                    acc.mark(f"drained {i}")
            acc.mark("close")
            with ds_acco.committed_weights(engine):
                final = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
            engine.destroy()
    finally:
        for name, fn in saved.items():
            setattr(collectives, name, fn)
        for name, fn in saved_dist.items():
            setattr(dist, name, fn)
    return {"compute": _by_mark(acc, lambda e: e.thread != LANE_THREAD),
            "lane": _by_round(acc), "shares": shares, "final": final,
            "seconds_per_micro_batch": schedule.seconds_per_micro_batch}


def _entries(acc: RecordingAccelerator, keep):
    return [e for e in acc.log if e.kind in TRACED and keep(e)]


def _by_mark(acc: RecordingAccelerator, keep) -> list:
    """The compute side's trace cut at its marks: [(mark, [(kind, what) since the previous mark])]."""
    out, since = [], []
    for e in _entries(acc, keep):
        if e.kind == "mark":
            out.append((e.what, since))
            since = []
        else:
            since.append((e.kind, e.what))
    out.append(("end", since))
    return out


def _by_round(acc: RecordingAccelerator) -> list:
    """The lane's trace cut at each submitted function's start: [(name, [(kind, what)])]."""
    out = []
    for e in _entries(acc, lambda e: e.thread == LANE_THREAD):
        if e.kind == "round":
            out.append((e.what, []))
        elif out:
            out[-1][1].append((e.kind, e.what))
        else:
            out.append(("before any round", [(e.kind, e.what)]))
    return out


def trace_runs(cases):
    return [trace_run(c) for c in cases]
