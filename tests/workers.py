"""Functions that run inside spawned ranks (importable by the spawn start method)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer, make_scheduler


def snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def train(case: dict, use_ds_acco: bool = True):
    """Train one case for gas*steps micro-batches; return losses and committed θ_T."""
    import deepspeed
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    model = TinyNet(seed=0)
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    cfg = ds_config(case.get("gas", 4), case.get("acco"), clip=case.get("clip", 0.0))
    init = ds_acco.initialize if use_ds_acco else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, lr_scheduler=sched(opt) if sched else None, config=cfg)
    losses, boundaries, lrs = [], [], []
    probes = {}
    n = case.get("gas", 4) * case["steps"]
    for i in range(n):
        x, y = batch(rank, i)
        loss = engine(x, y)
        engine.backward(loss)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
        if i in case.get("probe_at", ()):
            with ds_acco.committed_weights(engine):
                probes[i] = (engine.global_steps, snapshot(engine.module))
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
        steps = engine.global_steps
    out = {"losses": losses, "final": final, "global_steps": steps, "boundaries": boundaries, "lrs": lrs,
           "probes": probes, "optimizer": type(engine.optimizer).__name__}
    engine.destroy()
    return out


def train_cases(cases, use_ds_acco=True):
    return [train(c, use_ds_acco) for c in cases]
