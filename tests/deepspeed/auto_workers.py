"""Rank functions of tests/deepspeed/test_auto.py (importable by the spawn start method)."""
from __future__ import annotations

import torch.distributed as dist

import ds_acco
from ds_acco.core.schedule import auto
from fixtures import TinyNet, ds_config, make_optimizer
from one_round_workers import _steps
from workers import snapshot


def _engine(case):
    """An engine for ``case``; ``case["times"]``: each rank's measured (C, R), through auto's test seam."""
    times = case.get("times")
    auto.measure_hook = None if times is None else (lambda rank, step, c, r: tuple(times[rank]))
    model = TinyNet(seed=0)
    opt = make_optimizer(case.get("optimizer", "adamw"))(model)
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, config=ds_config(case["gas"], case["acco"]))
    lines = []
    choice = engine.optimizer.schedule.auto
    if choice is not None and choice.announce is not None:  # the decision's line to the engine's log (rank 0)
        announce = choice.announce
        choice.announce = lambda line: (lines.append(line), announce(line))
    return engine, lines


def _end(engine, losses, lines):
    schedule = engine.optimizer.schedule
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
    out = {"losses": losses, "final": final, "global_steps": engine.global_steps, "lines": lines,
           "mode": schedule.mode, "phase": schedule.phase.value,
           "decision": None if schedule.auto is None else schedule.auto.decision}
    engine.destroy()
    return out


def train(case):
    engine, lines = _engine(case)
    losses = []
    _steps(engine, dist.get_rank(), 0, case["gas"] * case["steps"], losses)
    return _end(engine, losses, lines)


def train_cases(cases):
    return [train(c) for c in cases]


def resume(case, save_dir, save_at, total, resumed_times):
    """Saved after micro-batch ``save_at`` and trained on; loaded into a fresh engine (whose measured times,
    ``resumed_times``, would decide otherwise) and trained on: both runs' results after the save."""
    saving, lines = _engine(case)
    rank = dist.get_rank()
    losses = []
    _steps(saving, rank, 0, save_at + 1, losses)
    saving.save_checkpoint(save_dir, tag="mid")
    losses = []
    _steps(saving, rank, save_at + 1, total, losses)
    out = {"saving": _end(saving, losses, lines)}
    resumed, lines = _engine(dict(case, times=resumed_times))
    resumed.load_checkpoint(save_dir, tag="mid")
    losses = []
    _steps(resumed, rank, save_at + 1, total, losses)
    out["resumed"] = _end(resumed, losses, lines)
    return out
