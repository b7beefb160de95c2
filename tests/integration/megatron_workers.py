"""Rank functions for tests/test_megatron_protocol.py: Megatron-DeepSpeed's exact call sequence.

``megatron/core/pipeline_parallel/schedules.py forward_backward_no_pipelining`` (DeepSpeed path):
``set_gradient_accumulation_boundary(False)``; A-1 x (forward, ``engine.backward(loss)``);
``set_gradient_accumulation_boundary(True)``; forward; ``engine.backward(loss)``. Then
``megatron/training.py train_step``: ``engine.step(lr_kwargs={'increment': n})`` and
``update_successful = engine.was_step_applied()``. With ``--no-pipeline-parallel`` the loss is not
divided by the number of micro-batches (DeepSpeed's backward scales it by 1/A).
``evaluate()``: ``model.eval()``; under ``torch.no_grad()`` forward_backward_no_pipelining with
``forward_only=True`` (the boundary calls, forwards, no backward); ``model.train()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer
from schedulers import settings

INCREMENT = 32  # Megatron: num_microbatches * micro_batch_size * data_parallel_size


class IncrementLR(torch.optim.lr_scheduler.LambdaLR):
    """The fixtures' "inv" schedule with Megatron's ``step(increment=...)`` signature; counts what
    it was given so a test can check one advance per commit with the latest lr_kwargs."""

    def __init__(self, opt):
        self.calls, self.consumed = 0, 0
        super().__init__(opt, lambda s: 1.0 / (1.0 + 0.5 * s))

    def step(self, increment=None):
        if increment is not None:
            self.calls += 1
            self.consumed += increment
        super().step()


def make_increment_lr(opt):
    return IncrementLR(opt)


def _committed(engine):
    with ds_acco.committed_weights(engine):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def megatron_run(case: dict):
    """``case``: mode, gas, iters, protocol ('megatron' or 'per_mb'), nan_at [(rank, i)], evaluate,
    acco_extra (more keys of the acco block), scheduler ('megatron-like': tests/schedulers.py's stand-in for Megatron's own; default IncrementLR)."""
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    gas, iters = case["gas"], case["iters"]
    if case.get("evaluate"):
        ds_acco.install()  # Megatron's evaluate() then runs on committed weights
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    if case.get("scheduler") == "megatron-like":
        from schedulers import MegatronLikeScheduler
        sched = MegatronLikeScheduler(opt)
    else:
        sched = IncrementLR(opt)
    acco = None if case["mode"] == "stock" else {"enabled": True, "mode": case["mode"], **case.get("acco_extra", {})}
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(gas, acco))
    from lr_workers import record_used
    used = record_used(engine, opt)
    nan_at = [tuple(p) for p in case.get("nan_at", ())]
    counter = iter(range(10**9))

    def forward():
        i = next(counter)
        x, y = batch(rank, i)
        if (rank, i) in nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        return engine(x, y)

    applied, steps, skipped, lrs, evals, logged_lrs, logged = [], [], [], [], [], [], []
    for it in range(iters):
        if case["protocol"] == "megatron":
            engine.set_gradient_accumulation_boundary(False)
            for _ in range(gas - 1):
                engine.backward(forward())
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(forward())
            engine.step(lr_kwargs={"increment": INCREMENT})
            applied.append(engine.was_step_applied())
        else:  # the per-micro-batch loop ACCO was built around
            for _ in range(gas):
                engine.backward(forward())
                engine.step(lr_kwargs={"increment": INCREMENT})
        steps.append(engine.global_steps)
        skipped.append(engine.skipped_steps)
        lrs.append(engine.get_lr()[0])
        logged_lrs.append(engine.optimizer.param_groups[0]["lr"])  # what Megatron logs after step()
        logged.append(settings(opt))
        if case.get("evaluate"):
            evals.append(_megatron_evaluate(engine, gas, rank))
    final = _committed(engine) if acco else {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = {"final": final, "applied": applied, "global_steps": steps, "skipped_steps": skipped, "lrs": lrs,
           "sched_calls": getattr(sched, "calls", None), "sched_consumed": getattr(sched, "consumed", None),
           "evals": evals, "logged_lrs": logged_lrs, "logged": logged, "used": used,
           "sched_state": sched.state_dict() if case.get("scheduler") == "megatron-like" else None}
    engine.destroy()
    if case.get("evaluate"):
        ds_acco.uninstall()
    return out


def _megatron_evaluate(engine, gas, rank):
    """Megatron's evaluate(): eval(), forward-only micro-batches with the boundary calls, train().
    Returns (loss seen by evaluate, loss at the committed weights, loss at the live weights)."""
    x, y = batch(rank, 10**6)
    with torch.no_grad():
        live = float(engine(x, y))
    engine.eval()
    with torch.no_grad():
        engine.set_gradient_accumulation_boundary(False)
        seen = [float(engine(x, y)) for _ in range(gas - 1)]
        engine.set_gradient_accumulation_boundary(True)
        seen.append(float(engine(x, y)))
    engine.train()
    with torch.no_grad():
        back = float(engine(x, y))
        with ds_acco.committed_weights(engine):
            committed = float(engine(x, y))
    return {"seen": seen, "committed": committed, "live": live, "live_after": back}


def megatron_cases(cases):
    return [megatron_run(c) for c in cases]


def megatron_load_run(case: dict, save_dir: str):
    """Megatron's iterations (see the module docstring) with a checkpoint saved after iteration
    ``save_at``'s ``step()`` and loaded in iteration ``load_at`` between its last ``backward()`` (which
    launches ACCO's commit of that iteration) and its ``step()``. ``case``: name, mode ('stock', 'acco',
    'dpu'), gas, iters, save_at, load_at, scheduler ('increment': IncrementLR, 'megatron-like'),
    nan_at [(rank, micro-batch)]. Returns what a caller reads after every ``step()`` and the settings
    every optimizer step used (tests/deepspeed/lr_workers.py ``record_used``)."""
    import os
    from lr_workers import record_used
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    gas = case["gas"]
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    if case["scheduler"] == "megatron-like":
        from schedulers import MegatronLikeScheduler
        sched = MegatronLikeScheduler(opt)
    else:
        sched = IncrementLR(opt)
    acco = None if case["mode"] == "stock" else {"enabled": True, "mode": case["mode"]}
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(gas, acco))
    used = record_used(engine, opt)
    it = 0
    stock_step_lrs = {}  # stock: iteration -> the lr its optimizer step used (ZeRO steps group 0 first)
    if acco is None:
        def pre_step(o, args, kwargs):
            stock_step_lrs.setdefault(it, o.param_groups[0]["lr"])
        opt.register_step_pre_hook(pre_step)
    nan_at = [tuple(p) for p in case.get("nan_at", ())]
    path = os.path.join(save_dir, case["name"])
    after_step = []
    for it in range(case["iters"]):
        for k in range(gas):
            engine.set_gradient_accumulation_boundary(k == gas - 1)
            x, y = batch(rank, it * gas + k)
            if (rank, it * gas + k) in nan_at:
                x = x.clone()
                x[0, 0] = float("nan")
            engine.backward(engine(x, y))
        if it == case["load_at"]:
            loaded, _ = engine.load_checkpoint(path, tag="saved")
            assert loaded is not None
        engine.step(lr_kwargs={"increment": INCREMENT})
        after_step.append({"lr": engine.get_lr()[0], "logged": settings(opt), "applied": engine.was_step_applied(),
                           "scheduler": sched.state_dict() if case["scheduler"] == "megatron-like"
                           else sched.last_epoch})
        if it == case["save_at"]:
            engine.save_checkpoint(path, tag="saved")
    engine.destroy()  # ACCO: the last commit is collected here
    # ACCO: one commit launched per iteration (in its last backward), in launch order
    step_lrs = ([stock_step_lrs.get(i) for i in range(case["iters"])] if acco is None else
                [u["settings"][0]["lr"] for u in used if u["kind"] == "commit"])
    return {"after_step": after_step, "step_lrs": step_lrs, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps}


def megatron_load_cases(cases, save_dir):
    return [megatron_load_run(c, save_dir) for c in cases]
