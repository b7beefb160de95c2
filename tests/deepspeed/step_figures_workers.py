"""Rank functions for tests/deepspeed/test_step_figures.py: every per-step figure DeepSpeed emits
(throughput timer, monitor events, progress and wall-clock log lines), recorded at DeepSpeed's own
objects, for one engine trained a fixed number of optimizer steps.

The monitor is DeepSpeed's csv_monitor (one file per event name, rows ``step, value``); the log
lines are read where DeepSpeed writes them: the throughput timer's logging function, the
``step=..., skipped=...`` progress line (DeepSpeed's logger) and the wall-clock timers' ``log``.
Like a user's training loop, each run also writes its own event through ``engine.monitor`` after
every micro-batch (:data:`USER_EVENT`, its own x axis), and rank 0 records whether it was in the
monitor's file right after the call.
"""
from __future__ import annotations

import csv
import logging
import os

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer
from lr_workers import FP16

USER_EVENT = "User/micro_batch"  # x: the micro-batch's index, value: 10x it
TIMER_COUNTERS = ("global_step_count", "micro_step_count", "epoch_count", "batch_size", "start_step")


def _record_logs(engine):
    """DeepSpeed's log lines of this engine, as they are written (rank 0 writes them)."""
    from deepspeed.utils import logger
    lines = {"tput": [], "progress": [], "timers": []}
    engine.tput_timer.logging = lambda line: lines["tput"].append(line.split(", RunningAvg")[0])
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: (lines["progress"].append(record.getMessage())
                                   if ", skipped=" in record.getMessage() else None)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log = engine.timers.log
    engine.timers.log = lambda names, *a, **k: (lines["timers"].append(tuple(names)), log(names, *a, **k))[1]
    return lines, handler


def read_monitor(path: str) -> dict:
    """csv_monitor's files: {event name: [(x, value), ...]} (values as written)."""
    return {name[:-len(".csv")]: read_monitor_file(os.path.join(path, name)) for name in sorted(os.listdir(path))}


def read_monitor_file(path: str) -> list:
    """One event's csv_monitor file: [(x, value), ...] ([] before its first write)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = list(csv.reader(f))[1:]
    return [(int(x), v) for x, v in rows]


def step_figures_run(case: dict, monitor_dir: str) -> dict:
    """``case``: name, mode ('stock', 'acco', 'dpu'), protocol ('per_mb': step() after every
    backward; 'megatron': the caller sets the boundary and calls step() once per A micro-batches),
    gas, steps, nan_at [(rank, micro-batch)], fp16 (DeepSpeed's dynamic loss scaler), wall_clock
    (``wall_clock_breakdown``)."""
    from deepspeed.utils import logger
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    gas, steps = case["gas"], case["steps"]
    extra = {"csv_monitor": {"enabled": True, "output_path": monitor_dir, "job_name": case["name"]},
             "steps_per_print": 1, "wall_clock_breakdown": case.get("wall_clock", False)}
    if case.get("fp16"):
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True  # torch's CPU fp16 kernels run TinyNet
        extra["fp16"] = FP16
    acco = None if case["mode"] == "stock" else {"enabled": True, "mode": case["mode"], "metrics": {"monitor": False}}
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                         config=ds_config(gas, acco, **extra))
    lines, handler = _record_logs(engine)
    nan_at = {tuple(p) for p in case.get("nan_at", ())}
    dtype = next(engine.module.parameters()).dtype
    timer_after_step = []  # the throughput timer's counters after every step() call
    user_writes = []  # per user event: (commit in flight when written, its rows in the monitor's file right after)
    user_file = os.path.join(monitor_dir, case["name"], USER_EVENT.replace("/", "_") + ".csv")
    for i in range(gas * steps):
        x, y = batch(rank, i)
        if (rank, i) in nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        if case["protocol"] == "megatron" and i % gas == 0:
            engine.set_gradient_accumulation_boundary(False)
        if case["protocol"] == "megatron" and i % gas == gas - 1:
            engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(x.to(dtype), y.to(dtype)))
        if case["protocol"] == "per_mb" or i % gas == gas - 1:
            engine.step()
            timer_after_step.append({k: getattr(engine.tput_timer, k) for k in TIMER_COUNTERS})
        driver = getattr(engine.optimizer, "driver", None)
        in_flight = driver is not None and driver.commit_in_flight
        engine.monitor.write_events([(USER_EVENT, 10 * i, i)])
        if rank == 0:
            user_writes.append((in_flight, len(read_monitor_file(user_file))))
    engine.destroy()  # ACCO: the last commit is collected here
    logger.removeHandler(handler)
    logger.setLevel(logging.WARNING)
    out = {"timer": timer_after_step, "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
           "global_samples": engine.global_samples, "micro_steps": engine.micro_steps, "lines": lines,
           "user_writes": user_writes}
    dist.barrier()
    if rank == 0:
        out["events"] = read_monitor(os.path.join(monitor_dir, case["name"]))
        out["user_events"] = out["events"].pop(USER_EVENT.replace("/", "_"))
    return out


def step_figures_cases(cases, monitor_dir):
    return [step_figures_run(c, monitor_dir) for c in cases]
