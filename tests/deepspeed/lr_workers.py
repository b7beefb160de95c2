"""Rank functions for the LR-schedule tests (tests/deepspeed/test_lr_skipped_commit.py): one
engine per case, ACCO or stock, trained on TinyNet with a scheduler and forced skips, recording
which settings each optimizer step used and what a caller reads after each ``step()``."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer
from schedulers import DS_CONFIG_SCHEDULERS, SCHEDULERS, settings

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1,
        "min_loss_scale": 1}


def _engine(case):
    import deepspeed
    model = TinyNet(seed=0)
    extra = {"fp16": FP16} if case.get("fp16") else {}
    if case["scheduler"].startswith("config:"):
        extra["scheduler"] = DS_CONFIG_SCHEDULERS[case["scheduler"].split(":", 1)[1]]
    cfg = ds_config(case.get("gas", 4), case.get("acco"), **extra)
    if case.get("fp16"):
        # DeepSpeed refuses fp16 where oneDNN lacks fp16 kernels; torch's CPU fp16 kernels run this
        # tiny model, so stock's real overflow skip can be compared (as tests/deepspeed/workers.py does)
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    opt = make_optimizer(case.get("optimizer", "adamw"))(model)
    sched = None if case["scheduler"].startswith("config:") else SCHEDULERS[case["scheduler"]](opt)
    init = ds_acco.initialize if case.get("acco") else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    return engine, opt


def record_used(engine, basic):
    """The settings each optimizer step used: stock, those in the param groups when the wrapped
    optimizer's step runs (never for a skipped step); ACCO, those each round captured at its launch,
    with the round's kind, step and whether it was skipped (filled in when it is collected)."""
    used = []
    if not hasattr(engine.optimizer, "driver"):
        # ZeRO steps the wrapped optimizer once per param group, with that group alone in param_groups
        def pre_step(opt, args, kwargs):
            if not used or used[-1]["step"] != engine.global_steps:
                used.append({"step": engine.global_steps, "settings": []})
            used[-1]["settings"] += settings(opt)
        basic.register_step_pre_hook(pre_step)
        return used
    schedule = engine.optimizer.driver.schedule
    shard = schedule.context.shard_optimizer
    capture, after_launch = shard.settings, schedule.after_launch

    def captured():
        out = capture()
        used.append({"settings": settings(shard.optimizer)})
        return out

    def launched(kind):
        used[-1].update(kind=kind.value, step=schedule.step_index)
        after_launch(kind)

    def collected(result):
        for u in used:
            if u.get("kind") == result.kind.value and u.get("step") == result.step:
                u["skipped"] = result.skipped

    shard.settings, schedule.after_launch = captured, launched
    schedule.round_observers.append(collected)
    return used


def train_lr(case: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, basic = _engine(case)
        rank = dist.get_rank()  # (initialised by the engine)
        used = record_used(engine, basic)
        read = []
        if case.get("scheduler_step_first"):  # a real ordering mistake: torch warns in stock
            engine.lr_scheduler.step()
        gas = case.get("gas", 4)
        for i in range(gas * case["steps"]):
            x, y = batch(rank, i)
            if [rank, i] in [list(p) for p in case.get("nan_at", ())]:
                x = x.clone()
                x[0, 0] = float("nan")  # a non-finite gradient on one rank: the step is skipped
            dtype = next(engine.module.parameters()).dtype
            loss = engine(x.to(dtype), y.to(dtype))
            engine.backward(loss)
            engine.step()
            read.append(settings(basic))  # what a caller reads right after step() (Megatron logs it)
        if hasattr(engine.optimizer, "drain"):
            engine.optimizer.drain()  # the last commit, collected (a checkpoint or the exit does it too)
        sched = engine.lr_scheduler
        out = {"used": used, "read": read, "final": settings(basic), "skipped_steps": engine.skipped_steps,
               "global_steps": engine.global_steps, "last_lr": list(sched.get_last_lr()),
               "scheduler_state": _plain(sched.state_dict())}
        engine.destroy()
    out["order_warnings"] = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    return out


def _plain(state):
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items() if not callable(v)}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    return state.item() if torch.is_tensor(state) else state


def train_lr_cases(cases):
    return [train_lr(c) for c in cases]
