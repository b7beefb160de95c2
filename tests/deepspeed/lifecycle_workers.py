"""Checkpoint, fault, SIGTERM and soak runs inside spawned ranks (split from workers.py, which
holds the training runs)."""
from __future__ import annotations

import ds_acco
from dist import settled_thread_count
from fixtures import TinyNet, WideNet, batch, ds_config, make_optimizer, make_scheduler
from workers import snapshot


def _engine_for(case, use_ds_acco=True):
    import deepspeed
    model = WideNet(seed=0) if case.get("model") == "wide" else TinyNet(seed=0)
    cfg = ds_config(case.get("gas", 4), case.get("acco"), clip=case.get("clip", 0.0), **case.get("extra", {}))
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    init = ds_acco.initialize if use_ds_acco else deepspeed.initialize
    if case.get("fp16_on_cpu"):
        # DeepSpeed refuses fp16 where oneDNN lacks fp16 kernels; torch's CPU fp16 kernels run
        # this tiny model, so the real fp16 path (loss scaler, fp16 weights) can be exercised.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    engine, *_ = init(model=model, optimizer=opt, lr_scheduler=sched(opt) if sched else None, config=cfg)
    return engine


def _feed(engine, rank, start, stop, on_micro_batch=None):
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for i in range(start, stop):
        loss = engine(*(t.to(dtype) for t in batch(rank, i)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if on_micro_batch is not None:
            on_micro_batch(i)
    return losses


def checkpoint_save_run(case, save_dir, save_at, total):
    """Train ``total`` micro-batches, saving a checkpoint (tag 'mb<i>') after each micro-batch in ``save_at``."""
    rank = int(__import__("os").environ["RANK"])
    engine = _engine_for(case)

    def maybe_save(i):
        if i in save_at:
            engine.save_checkpoint(save_dir, tag=f"mb{i}")
    losses = _feed(engine, rank, 0, total, maybe_save)
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
    steps = engine.global_steps
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0))
    engine.destroy()
    return {"losses": losses, "final": final, "global_steps": steps, "loss_scale": scale}


def checkpoint_resume_runs(case, save_dir, save_at, total, use_ds_acco=True):
    """For each tag: a new engine loads it and trains on to ``total``."""
    rank = int(__import__("os").environ["RANK"])
    out = {}
    for i in save_at:
        engine = _engine_for(case, use_ds_acco)
        path, _ = engine.load_checkpoint(save_dir, tag=f"mb{i}")
        assert path is not None
        loaded_steps = engine.global_steps
        with ds_acco.committed_weights(engine):
            loaded = snapshot(engine.module)
        losses = _feed(engine, rank, i + 1, total)
        with ds_acco.committed_weights(engine):
            final = snapshot(engine.module)
        out[i] = {"losses": losses, "final": final, "global_steps": engine.global_steps,
                  "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0)),
                  "loaded_steps": loaded_steps, "loaded": loaded, "optimizer": type(engine.optimizer).__name__}
        engine.destroy()
    return out


def checkpoint_killed_save(case, save_dir, kill_point):
    """Save tag 'good', train on, then die (exit code 3) during the save of tag 'bad'."""
    import os
    import ds_acco.core.lifecycle.publish as ckpt
    rank = int(__import__("os").environ["RANK"])
    engine = _engine_for(case)
    _feed(engine, rank, 0, 5)
    engine.save_checkpoint(save_dir, tag="good")
    _feed(engine, rank, 5, 9)
    if kill_point == "before_publish":
        ckpt.publish = lambda *a, **k: os._exit(3)
    else:  # in the middle of DeepSpeed writing the files
        import torch as _torch
        real_save, calls = _torch.save, []

        def dying_save(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                os._exit(3)
            return real_save(*a, **k)
        _torch.save = dying_save
    engine.save_checkpoint(save_dir, tag="bad")
    return "not killed"


def checkpoint_load_latest(case, save_dir):
    engine = _engine_for(case)
    path, _ = engine.load_checkpoint(save_dir)
    with ds_acco.committed_weights(engine):
        theta = snapshot(engine.module)
    out = {"path": path, "global_steps": engine.global_steps, "theta": theta}
    engine.destroy()
    return out


def mismatched_init(per_rank_acco):
    """Each rank gets its own acco block; return the error's refusal key and text (or 'NO ERROR')."""
    import os
    rank = int(os.environ["RANK"])
    model = TinyNet()
    try:
        engine, *_ = ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model),
                                        config=ds_config(4, per_rank_acco[rank]))
        engine.destroy()
        return None, "NO ERROR"
    except ValueError as exc:
        return getattr(exc, "refusal", None), str(exc)


def rank_dies(case, die_rank, die_at):
    """``die_rank`` exits abruptly after micro-batch ``die_at``; the others report how they ended."""
    import os
    import time
    rank = int(os.environ["RANK"])
    engine = _engine_for(case)
    t0 = None
    try:
        for i in range(10**6):
            if rank == die_rank and i == die_at:
                os._exit(7)
            if i == die_at:
                t0 = time.monotonic()
            _feed(engine, rank, i, i + 1)
        return {"error": None}
    except Exception as exc:  # the survivor's view
        return {"error": f"{type(exc).__name__}: {exc}",
                "seconds_after_death": time.monotonic() - t0 if t0 else None}


def soak(case, micro_batches, sample_every):
    """Train many micro-batches; sample memory, threads and outstanding work as it goes."""
    import os
    import threading

    rank = int(os.environ["RANK"])
    engine = _engine_for(case)
    schedule = engine.optimizer.schedule
    page = os.sysconf("SC_PAGE_SIZE")
    samples = []

    def sample(i):
        if i % sample_every == 0 or i == micro_batches - 1:
            # the round in flight allocates shard-sized temporaries on the lane: let it finish so
            # RSS shows only what stays (changes timing only; the schedule is the same)
            schedule.drain()
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page
            samples.append({
                "micro_batch": i,
                "rss_mb": rss / 2**20,
                "threads": threading.active_count(),
                "os_threads": len(os.listdir("/proc/self/task")),
                "inflight": int(schedule.inflight is not None),
                "lane_queue": schedule.lane._queue.qsize(),
                "history": len(schedule.history),
                "metrics_records": len(engine.optimizer.driver.metrics.records),
                "rounds_submitted": schedule.lane.rounds_submitted,
            })
    _feed(engine, rank, 0, micro_batches, sample)
    engine.destroy()
    return samples


def sigterm_run(case, signal_rank, signal_at, total):
    """``signal_rank`` gets SIGTERM after micro-batch ``signal_at``; report where each rank stopped."""
    import os
    import signal
    rank = int(os.environ["RANK"])
    engine = _engine_for(case)
    done = 0
    try:
        for i in range(total):
            _feed(engine, rank, i, i + 1)
            done = i + 1
            if rank == signal_rank and i == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return {"stopped": False, "done": done}
    except SystemExit as exc:
        return {"stopped": True, "code": exc.code, "done": done, "global_steps": engine.global_steps}


def universal_resume(case, load_dir, total, start):
    """Load a universal checkpoint (any world size) into an ACCO engine and train on."""
    import os
    rank = int(os.environ["RANK"])
    case = dict(case, extra={"checkpoint": {"load_universal": True}})
    model = TinyNet(seed=1)  # different init: everything must come from the checkpoint
    cfg = ds_config(case.get("gas", 4), case.get("acco"), **case["extra"])
    opt = make_optimizer(case["optimizer"])(model)
    engine, *_ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    path, _ = engine.load_checkpoint(load_dir)
    with ds_acco.committed_weights(engine):
        loaded = snapshot(engine.module)
    steps = engine.global_steps
    losses = _feed(engine, rank, start, total)
    out = {"path": path, "loaded": loaded, "loaded_steps": steps, "losses": losses,
           "optimizer": type(engine.optimizer).__name__}
    engine.destroy()
    return out


def stop_at_same_count(case, total, save_dir):
    """Feed ``total`` micro-batches on every rank (rank speeds differ: ``case['sleep']``), then save a
    checkpoint (a drain), as HF Trainer or Megatron do at an agreed micro-batch count. Reports where
    each rank stood and how the drain and save ended."""
    import os
    import time
    rank = int(os.environ["RANK"])
    engine = _engine_for(case)
    schedule = engine.optimizer.schedule
    sleep = case.get("sleep", {}).get(str(rank), 0.0)
    positions, error, t0 = [], None, None
    try:
        for i in range(total):
            loss = engine(*batch(rank, i))
            engine.backward(loss)
            if sleep:
                time.sleep(sleep)
            engine.step()
            positions.append((schedule.lane.rounds_submitted, schedule.phase.value))
        t0 = time.monotonic()
        engine.save_checkpoint(save_dir, tag="stop")
    except Exception as exc:  # a round its peer never joined (comm_timeout_s), or the peer gone
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    out = {"positions": positions, "error": error, "global_steps": engine.global_steps,
           "drain_s": None if t0 is None else time.monotonic() - t0}
    if error is None:
        engine.destroy()
    return out


def destroy_after_failed_round(case):
    """The round in flight at ``engine.destroy()`` fails (a non-finite gradient with acco.nonfinite
    'raise'): what destroy() raised, whether DeepSpeed's own destroy() ran, and whether the
    SIGTERM handler before ACCO's is back. Also what the driver logged at construction with
    ``one_queue_serialisation`` standing in for a device with CUDA_DEVICE_MAX_CONNECTIONS=1, and
    whether the lane then ran its rounds synchronously."""
    import logging
    import os
    import signal

    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_acco.core import driver as driver_module
    rank = int(os.environ["RANK"])
    checked, logged = [], []

    def fake_warning(device, synchronous):
        checked.append((str(device), synchronous))
        return "CONNECTIONS WARNING"

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append((record.levelname, record.getMessage()))
    handler = Keep()
    logging.getLogger("ds_acco").addHandler(handler)
    real_warning, driver_module.one_queue_serialisation = driver_module.one_queue_serialisation, fake_warning
    before = signal.getsignal(signal.SIGTERM)
    try:
        engine = _engine_for(case)
    finally:
        driver_module.one_queue_serialisation = real_warning
        logging.getLogger("ds_acco").removeHandler(handler)
    destroyed = []
    real_destroy = DeepSpeedEngine.destroy

    def spy(self):
        destroyed.append(type(self).__name__)
        return real_destroy(self)
    DeepSpeedEngine.destroy = spy
    try:
        for i in range(case["gas"] // 2):  # one phase: its round is in flight at destroy()
            x, y = batch(rank, i)
            if i == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            engine.backward(engine(x, y))
            engine.step()
        assert engine.optimizer.schedule.round_in_flight is not None
        lane_synchronous = engine.optimizer.driver.lane.synchronous
        try:
            engine.destroy()
            raised = None
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
    finally:
        DeepSpeedEngine.destroy = real_destroy
    return {"raised": raised, "deepspeed_destroy_ran": destroyed,
            "sigterm_restored": signal.getsignal(signal.SIGTERM) is before,
            "warning_checked": checked, "warnings_logged": [m for lvl, m in logged if lvl == "WARNING"],
            "lane_synchronous": lane_synchronous}


def threads_after_destroy(case, use_ds_acco=True):
    """Native thread counts: before the engine, after training, after destroy(); the rounds' group's
    gloo worker threads must be gone after destroy() (at_exit.end_groups)."""
    import gc
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if not dist.is_initialized():
        import deepspeed
        deepspeed.init_distributed(get_accelerator().communication_backend_name())
    dist.barrier()
    before = settled_thread_count()
    engine = _engine_for(case, use_ds_acco)
    _feed(engine, dist.get_rank(), 0, 10)
    trained = settled_thread_count()
    engine.destroy()
    gc.collect()
    return {"before": before, "trained": trained, "destroyed": settled_thread_count()}
