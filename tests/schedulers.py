"""LR schedulers as users write them, for the skipped-commit tests (tests/core/test_scheduler_undo.py,
tests/deepspeed/test_lr_skipped_commit.py): each ``SCHEDULERS[name](optimizer)`` builds one on a
client optimizer. ``DS_CONFIG_SCHEDULERS``: the same kinds as DeepSpeed ``"scheduler"`` blocks."""
from __future__ import annotations

import math

import torch
from torch.optim import lr_scheduler as torch_lr

TOTAL_STEPS = 12  # the schedules span this many optimizer steps (tests run fewer)


def _sequential(opt):
    # the most common plain-PyTorch warm-up + cosine: its children hold the optimizer
    warmup = torch_lr.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=3)
    cosine = torch_lr.CosineAnnealingLR(opt, T_max=TOTAL_STEPS - 3, eta_min=1e-4)
    return torch_lr.SequentialLR(opt, [warmup, cosine], milestones=[3])


def _chained(opt):
    return torch_lr.ChainedScheduler([torch_lr.ConstantLR(opt, factor=0.5, total_iters=4),
                                      torch_lr.ExponentialLR(opt, gamma=0.8)], optimizer=opt)


def _lambda(opt):
    return torch_lr.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))


def _one_cycle(opt):
    # cycles the momentum too: Adam's betas[0], SGD's momentum
    return torch_lr.OneCycleLR(opt, max_lr=[0.05] * len(opt.param_groups), total_steps=TOTAL_STEPS, pct_start=0.3)


def _hf_cosine(opt):
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=TOTAL_STEPS)


def _ds_warmup_decay(opt):
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    return WarmupDecayLR(opt, total_num_steps=TOTAL_STEPS, warmup_min_lr=0.001, warmup_max_lr=0.02,
                         warmup_num_steps=3, warmup_type="linear")


class MegatronLikeScheduler:
    """Megatron-DeepSpeed's ``OptimizerParamScheduler`` (megatron/optimizer_param_scheduler.py) as far
    as the undo is concerned: ``step(increment)`` adds to ``num_steps`` and writes every group's
    ``lr`` and ``weight_decay`` from it; ``state_dict()`` holds its counters; ``load_state_dict()``
    re-applies the loaded count with ``step(increment=num_steps)`` -- on top of the current count
    (it expects a fresh scheduler), so it does not restore a live one."""

    def __init__(self, optimizer, max_lr=0.02, min_lr=0.002, warmup_steps=64, decay_steps=512, start_wd=0.1,
                 end_wd=0.01):
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps = max_lr, min_lr, warmup_steps, decay_steps
        self.start_wd, self.end_wd = start_wd, end_wd
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        if self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        ratio = min(1.0, (self.num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)

    def get_wd(self):
        ratio = min(1.0, self.num_steps / self.decay_steps)
        return self.start_wd + (self.end_wd - self.start_wd) * ratio

    def step(self, increment):
        self.num_steps += increment
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "start_wd": self.start_wd, "end_wd": self.end_wd,
                "num_steps": self.num_steps}

    def load_state_dict(self, sd):
        for key in ("max_lr", "min_lr", "warmup_steps", "decay_steps", "start_wd", "end_wd"):
            setattr(self, key, sd[key])
        self.step(increment=sd["num_steps"])


SCHEDULERS = {
    "sequential": _sequential,
    "chained": _chained,
    "lambda": _lambda,
    "onecycle": _one_cycle,
    "hf-cosine": _hf_cosine,
    "ds-warmupdecay": _ds_warmup_decay,
}

DS_CONFIG_SCHEDULERS = {
    "ds-warmupdecay": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": TOTAL_STEPS, "warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 3,
        "warmup_type": "linear"}},
}


def settings(optimizer) -> list:
    """Every param group's settings but its parameters (what a scheduler may write), as plain values."""
    return [{k: (v.item() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]
