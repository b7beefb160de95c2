"""A scheduler the caller steps itself keeps stock's schedule when ACCO skips a commit.

Accelerate (and through it the HF Trainer) steps its own ``AcceleratedScheduler`` right after each
optimizer step, and stock skips that step when the optimizer step was skipped
(``step_was_skipped``: fp16 overflow). Under ACCO the caller steps it right after the ``step()``
that launched the commit, before anyone can know the commit will be skipped (a non-finite
gradient, found when the round runs); ACCO undoes that scheduler step when it collects the
skipped commit (``AccoDriver.caller_scheduler_step``, installed by ``ds_acco.install()``).

A real ``accelerate.Accelerator`` with a torch ``LambdaLR``; a NaN in one rank's micro-batch of step
1. Stock fp32 has no skip to compare with, so the reference is a fresh scheduler stepped as
Accelerate steps it (``num_processes`` times per optimizer step) on the applied steps only: each
applied commit's settings, as its round captured them at launch, must equal the reference's, bit
for bit.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, make_optimizer
from schedulers import settings
from timeouts import scaled

pytest.importorskip("accelerate")
import hf_workers  # noqa: E402

GAS, STEPS = 4, 5
NAN_AT = [(1, 6)]  # step 1, second half: its commit is skipped (ACCO); DPU: its only round
SKIPPED = (1,)
CASES = {"acco": {"acco": {}, "nan_at": NAN_AT}, "dpu": {"acco": {}, "mode": "dpu", "nan_at": NAN_AT},
         # step 1 is a step of the synchronous warm-up: its commit is collected inside the step() that
         # launched it, before Accelerate steps its scheduler, which must then not be stepped at all
         "acco-warmup": {"acco": {"sync_warmup_steps": 3}, "nan_at": NAN_AT}}


@pytest.fixture(scope="module")
def runs():
    keys = list(CASES)
    out = run_ranks(hf_workers.accelerate_cases, cases=[{"gas": GAS, "steps": STEPS, **CASES[k]} for k in keys],
                    timeout=scaled(150))
    return [dict(zip(keys, per_rank)) for per_rank in out]


def _reference(num_processes):
    opt = make_optimizer("adamw")(TinyNet(seed=0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + hf_workers.LR_LAMBDA_DECAY * s))
    used = []
    with warnings.catch_warnings():  # no optimizer step precedes these scheduler steps: torch warns
        warnings.simplefilter("ignore", UserWarning)
        for t in range(STEPS):
            if t not in SKIPPED:
                used.append(settings(opt))
                for _ in range(num_processes):
                    sched.step()
    return used, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("mode", list(CASES))
def test_accelerates_scheduler_step_is_undone_with_a_skipped_commit(runs, mode):
    for rank_runs in runs:
        run = rank_runs[mode]
        assert run["engine"] == "AccoEngine" and run["skipped_steps"] == len(SKIPPED)
        commits = [u for u in run["used"] if u["kind"] == "commit"]
        assert [c["step"] for c in commits if c["skipped"]] == list(SKIPPED)
        want, final_lr = _reference(run["num_processes"])
        assert [c["settings"] for c in commits if not c["skipped"]] == want
        assert run["final_lr"] == final_lr
        assert run["order_warnings"] == []
