"""Rank functions of tests/deepspeed/test_one_round.py (importable by the spawn start method)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer, make_scheduler
from workers import master_weights, snapshot

PROBES = (5, 11, 14)  # micro-batches after which an evaluation block reads the model


def _engine(case):
    model = TinyNet(seed=0)
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched(opt) if sched else None,
                                         config=ds_config(case["gas"], case["acco"], clip=case.get("clip", 0.0)))
    return engine


def train(case):
    """Train ``case``; probe θ in evaluation blocks; try one export outside a block (refused)."""
    engine = _engine(case)
    rank = dist.get_rank()
    probes, refused = {}, None
    for i in range(case["gas"] * case["steps"]):
        x, y = batch(rank, i)
        if [rank, i] in [list(p) for p in case.get("nan_at", ())]:
            x = x.clone()
            x[0, 0] = float("nan")  # a non-finite gradient on one rank: the step's commit is skipped
        engine.backward(engine(x, y))
        engine.step()
        if i == case["gas"] + 1:
            try:
                engine.module.state_dict()
            except ValueError as exc:
                refused = getattr(exc, "refusal", repr(exc))
        if i in PROBES:
            live = snapshot(engine.module)  # the parameters as training runs on them (P)
            with ds_acco.committed_weights(engine):
                sd = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
                masters = master_weights(engine)
                probes[i] = (engine.global_steps, sd, masters, any(not torch.equal(live[n], sd[n]) for n in live))
            after = snapshot(engine.module)
            assert all(torch.equal(live[n], after[n]) for n in live), "the block did not put P back"
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
        masters = master_weights(engine)
        steps = engine.global_steps
    schedule = engine.optimizer.schedule
    predictor = schedule.context.predictor
    shard_bytes = sum(v.numel() * v.element_size() for g in schedule.groups for v in g.shard_values())
    engine.destroy()
    return {"final": final, "masters": masters, "global_steps": steps, "probes": probes, "export_refused": refused,
            "skipped_steps": engine.skipped_steps,
            "after_destroy": snapshot(engine.module), "predictor_bytes": predictor.extra_bytes,
            "shard_bytes": shard_bytes}


def train_one_round(cases):
    return [train(c) for c in cases]


def _steps(engine, rank, lo, hi, losses):
    for i in range(lo, hi):
        x, y = batch(rank, i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())


def _theta(engine):
    with ds_acco.committed_weights(engine):
        return snapshot(engine.module)


def resume(case, save_dir, save_at, total):
    """Uninterrupted; saved after micro-batch ``save_at`` (the round in flight) and trained on; loaded
    into a fresh engine and trained on: losses after the save and θ_T of all three."""
    out = {}
    plain = _engine(case)
    rank = dist.get_rank()
    losses = []
    _steps(plain, rank, 0, total, losses)
    out["plain"] = (losses[save_at + 1:], _theta(plain))
    plain.destroy()
    saving = _engine(case)
    losses = []
    _steps(saving, rank, 0, save_at + 1, losses)
    saving.save_checkpoint(save_dir, tag="mid")
    losses = []
    _steps(saving, rank, save_at + 1, total, losses)
    out["saving"] = (losses, _theta(saving))
    saving.destroy()
    resumed = _engine(case)
    resumed.load_checkpoint(save_dir, tag="mid")
    losses = []
    _steps(resumed, rank, save_at + 1, total, losses)
    out["resumed"] = (losses, _theta(resumed))
    resumed.destroy()
    return out
