"""A round with a non-finite mean gradient skips its update without corrupting any buffer."""
import math

import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import reference_run
import workers

GAS, STEPS = 4, 4
BASE = {"optimizer": "adamw", "schedule": "inv", "gas": GAS, "steps": STEPS}
# micro-batch 6 of rank 1: second half of step 1 (its commit is skipped, its estimate is not);
# micro-batch 8 of rank 0: first half of step 2 (both rounds of step 2 are skipped).
CASES = {
    "acco-second-half": (dict(BASE, acco={"enabled": True, "mode": "acco"}, nan_at=[(1, 6)]), "acco", (), (1,)),
    "acco-first-half": (dict(BASE, acco={"enabled": True, "mode": "acco"}, nan_at=[(0, 8)]), "acco", (2,), (2,)),
    "dpu": (dict(BASE, acco={"enabled": True, "mode": "dpu"}, nan_at=[(0, 5)]), "dpu", (), (1,)),
    # the same with +inf instead of NaN (a check for NaN only, e.g. math.isnan, would miss these)
    "acco-second-half-inf": (dict(BASE, acco={"enabled": True, "mode": "acco"}, inf_grad_at=[(1, 6)]), "acco", (),
                             (1,)),
    "acco-first-half-inf": (dict(BASE, acco={"enabled": True, "mode": "acco"}, inf_grad_at=[(0, 8)]), "acco", (2,),
                            (2,)),
    "dpu-inf": (dict(BASE, acco={"enabled": True, "mode": "dpu"}, inf_grad_at=[(0, 5)]), "dpu", (), (1,)),
}


@pytest.fixture(scope="module")
def runs():
    names = list(CASES)
    out = run_ranks(workers.train_cases, cases=[CASES[n][0] for n in names])
    raising = dict(BASE, acco={"enabled": True, "mode": "acco", "nonfinite": "raise"}, nan_at=[(1, 6)])
    try:
        run_ranks(workers.train_cases, cases=[raising])
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    return {n: out[0][i] for i, n in enumerate(names)}, raised


@pytest.mark.parametrize("name", list(CASES))
def test_skip_matches_reference_and_buffers_stay_clean(runs, name):
    run = runs[0][name]
    _, mode, skip_est, skip_commit = CASES[name]
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode=mode,
                         make_optimizer=make_optimizer("adamw"), make_scheduler=make_scheduler("inv"),
                         skip_estimate=skip_est, skip_commit=skip_commit)
    err = max(float((run["final"][n].double() - want[n]).abs().max()) for n in want)
    assert err < 1e-5
    assert all(torch.isfinite(t).all() for t in run["final"].values())
    assert run["skipped_steps"] == len(skip_commit)
    skipped_rounds = sorted((kind, step) for (kind, step), skipped in run["rounds"] if skipped)
    assert skipped_rounds == sorted([("estimate", t) for t in skip_est] + [("commit", t) for t in skip_commit])
    # only the poisoned micro-batch itself has a NaN loss: later ones are computed at finite weights
    nan_losses = [i for i, l in enumerate(run["losses"]) if math.isnan(l)]
    assert len(nan_losses) <= 1


def test_raise_mode_names_the_round(runs):
    raised = runs[1]
    assert raised is not None and "NonFiniteGradientError" in raised and "commit 1" in raised
