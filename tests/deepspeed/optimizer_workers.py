"""Ranks of tests/deepspeed/test_estimate_optimizers.py: a real step held on the communication thread
while the compute thread reads the learning rate (importable by the spawn start method)."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import ds_acco
from fixtures import HeavyBall, TinyNet, batch, ds_config, make_scheduler, param_groups
from timeouts import scaled


class HeldHeavyBall(HeavyBall):
    """HeavyBall whose step, when armed and run off the main thread (a round on the lane), notes the
    rate it reads (its own groups: the round's), then waits inside the step until released."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.hold = {"armed": False, "entered": threading.Event(), "release": threading.Event(), "seen": None}

    def step(self, closure=None):
        hold = self.hold
        if hold["armed"] and threading.current_thread() is not threading.main_thread():
            hold["armed"] = False
            hold["seen"] = _value(self.param_groups[0]["lr"])
            hold["entered"].set()
            if not hold["release"].wait(scaled(60)):
                raise TimeoutError("the compute thread never released the held step")
        return super().step(closure)


def _value(lr) -> float:
    return lr.item() if torch.is_tensor(lr) else float(lr)


def read_lr_while_rounds_step(cases: list) -> list:
    return [read_lr_while_a_round_steps(c) for c in cases]


def read_lr_while_a_round_steps(case: dict) -> list:
    """Train ``case["steps"]`` steps of 4 micro-batches; every round's step is held on the lane while the
    compute thread reads ``optimizer.param_groups[i]["lr"]`` and ``engine.get_lr()``. Returns, per round:
    (the rate read after the launching step(), the rate the held step read, the live rates read while
    it was held, engine.get_lr() then)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = TinyNet(seed=0)
    opt = HeldHeavyBall(param_groups(model), lr=torch.tensor(0.05) if case["tensor_lr"] else 0.05, weight_decay=0.01)
    acco = {"enabled": True, "mode": "acco", **case.get("acco", {})}
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=make_scheduler("inv")(opt),
                                         config=ds_config(4, acco))
    hold, rounds = opt.hold, []
    for i in range(4 * case["steps"]):
        launches = i % 2 == 1  # a phase of 2 micro-batches ends here: its round is launched in step()
        if launches:
            hold["entered"].clear()
            hold["release"].clear()
            hold["armed"] = True
        x, y = batch(rank, i)
        engine.backward(engine(x, y))
        engine.step()
        if launches:
            at_launch = _value(opt.param_groups[0]["lr"])
            if not hold["entered"].wait(scaled(60)):
                raise TimeoutError(f"round launched at micro-batch {i} never reached the optimizer's step")
            live = [_value(g["lr"]) for g in opt.param_groups]
            get_lr = [_value(lr) for lr in engine.get_lr()]
            hold["release"].set()
            rounds.append((at_launch, hold["seen"], live, get_lr))
    engine.destroy()
    return rounds
