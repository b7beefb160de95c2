"""Rank functions for tests/deepspeed/test_commit_resume.py: ``ds_acco.on_commit`` across a save and
a resume, and loads into an engine whose parameters are lent (an export or a save during a commit
phase leaves them viewing B's gathered weights until the phase end: see ds_acco/core/schedule/committed.py)."""
from __future__ import annotations

import os

import torch

import ds_acco
from lifecycle_workers import _engine_for, _feed
from workers import snapshot

DECAY = 0.8


def _rank() -> int:
    return int(os.environ["RANK"])


def _committed(engine) -> dict:
    with ds_acco.committed_weights(engine):  # a no-op for a stock engine
        return snapshot(engine.module)


def _in_flight(engine) -> str:
    schedule = getattr(engine.optimizer, "schedule", None)
    return str(None if schedule is None else schedule.round_in_flight)


class _Ema:
    """An EMA of the model's weights, updated by ``ds_acco.on_commit`` (and the steps it was called for)."""

    def __init__(self, engine, state=None):
        self.module = engine.module
        self.weights = snapshot(engine.module) if state is None else {n: t.clone() for n, t in state[0].items()}
        self.steps = [] if state is None else list(state[1])
        self.handle = ds_acco.on_commit(engine, self)

    def __call__(self, t: int) -> None:
        self.steps.append(t)
        with torch.no_grad():
            for n, p in self.module.named_parameters():
                self.weights[n].mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)

    def state(self):
        """What a user serialises (a copy: taken after ``save_checkpoint`` returns, see docs/api.md)."""
        return {n: t.clone() for n, t in self.weights.items()}, list(self.steps)


def ema_across_resume(case: dict, save_dir: str, save_at: int, total: int) -> dict:
    """Three runs of ``total`` micro-batches with an EMA through ``on_commit``: uninterrupted; the same
    with ``save_checkpoint`` after micro-batch ``save_at`` (the EMA serialised right after it); and a
    fresh engine that loads that checkpoint and the EMA and trains on. Returns each run's EMA and steps."""
    rank = _rank()
    out = {}
    engine = _engine_for(case)
    ema = _Ema(engine)
    _feed(engine, rank, 0, total)
    engine.destroy()  # the last commit reaches the model here
    out["plain"] = ema.state()

    engine = _engine_for(case)
    ema, saved = _Ema(engine), {}

    def save(i: int) -> None:
        if i == save_at:
            saved["kind"] = _in_flight(engine)
            engine.save_checkpoint(save_dir, tag="mid")
            saved["ema"] = ema.state()
    _feed(engine, rank, 0, total, save)
    engine.destroy()
    out["saving"], out["kind_at_save"] = ema.state(), saved["kind"]

    engine = _engine_for(case)
    path, _ = engine.load_checkpoint(save_dir, tag="mid")
    assert path is not None
    ema = _Ema(engine, saved["ema"])
    _feed(engine, rank, save_at + 1, total)
    engine.destroy()
    out["resumed"] = ema.state()
    return out


def rollback_while_lent(case: dict, save_dir: str, save_at: int, resave_at: int, total: int,
                        load_kwargs: dict) -> dict:
    """In one process: save after micro-batch ``save_at``, train on, save again after ``resave_at``
    (an ACCO engine's parameters lent after it, with the commit launched at that step boundary in
    flight), load the first save (``load_kwargs``) and train on to ``total``. Returns the committed
    weights at the first save, those right after the load, the losses after it, the final weights,
    and an uninterrupted run's losses and final weights."""
    rank = _rank()
    engine = _engine_for(case)
    plain_losses = _feed(engine, rank, 0, total)
    plain_final = _committed(engine)
    engine.destroy()

    engine = _engine_for(case)
    out = {"plain_losses": plain_losses[save_at + 1:], "plain_final": plain_final}

    def during(i: int) -> None:
        if i == save_at:
            out["saved"] = _committed(engine)
            engine.save_checkpoint(save_dir, tag="k")
        if i == resave_at:
            out["kind_at_resave"] = _in_flight(engine)
            engine.save_checkpoint(save_dir, tag="later")
    _feed(engine, rank, 0, resave_at + 1, during)
    schedule = getattr(engine.optimizer, "schedule", None)
    out["swapped_at_load"] = schedule is not None and schedule.committed.swapped
    path, _ = engine.load_checkpoint(save_dir, tag="k", **load_kwargs)
    assert path is not None
    out["loaded"] = _committed(engine)
    out["losses"] = _feed(engine, rank, save_at + 1, total)
    out["final"] = _committed(engine)
    engine.destroy()
    return out


def direct_optimizer_load_while_lent(case: dict, save_dir: str, save_at: int, total: int) -> dict:
    """A save during a commit phase (the parameters lent after it), then DeepSpeed's optimizer
    ``load_state_dict`` called directly with the saved ZeRO states: whether the parameters view the
    flat live weights DeepSpeed restores into, and the model's weights against those."""
    rank = _rank()
    engine = _engine_for(case)
    _feed(engine, rank, 0, save_at + 1)
    engine.save_checkpoint(save_dir, tag="k")
    schedule = engine.optimizer.schedule
    out = {"kind_at_save": str(schedule.round_in_flight), "swapped_before": schedule.committed.swapped}
    states = [torch.load(os.path.join(save_dir, "k", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
                         weights_only=False)["optimizer_state_dict"] for r in range(2)]
    engine.optimizer.load_state_dict(states)
    spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in engine.optimizer.bit16_groups_flat]
    out["params_view_live"] = all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in engine.module.parameters())
    out["swapped_after"] = schedule.committed.swapped
    engine.destroy()
    return out
