"""The estimate variants of the ``"acco"`` block (docs/estimate.md) on 2 gloo ranks against the
independent float64 reference (tests/reference.py), each compared with the paper's schedule too:
matching the variant's recurrence must not also match the paper's (the variant really changes the
trajectory), and ``"estimate": "paper"`` is today's run bit for bit."""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import reference_run, rel_distance
from timeouts import scaled
import workers

STEPS, GAS = 4, 4
CASES = [
    {"name": "lr-scale-2-adamw", "estimate": {"lr_scale": 2.0}, "ref": {"lr_scale": 2.0}, "optimizer": "adamw"},
    {"name": "lr-scale-1.5-sgd", "estimate": {"lr_scale": 1.5}, "ref": {"lr_scale": 1.5}, "optimizer": "sgd"},
    {"name": "lr-scale-1.5-adamw-clip", "estimate": {"lr_scale": 1.5}, "ref": {"lr_scale": 1.5}, "optimizer": "adamw",
     "clip": 0.05},
    {"name": "committed-v-adamw", "estimate": {"second_moment": "committed"}, "ref": {"committed_second_moment": True},
     "optimizer": "adamw"},
    {"name": "committed-v-adam-fused-lr2", "estimate": {"second_moment": "committed", "lr_scale": 2.0},
     "ref": {"committed_second_moment": True, "lr_scale": 2.0}, "optimizer": "adamw-fused", "ref_optimizer": "adamw"},
    {"name": "paper", "estimate": "paper", "ref": {}, "optimizer": "adamw"},
    {"name": "default", "estimate": None, "ref": {}, "optimizer": "adamw"},
]


def _case(c):
    acco = {"enabled": True, "mode": "acco"}
    if c["estimate"] is not None:
        acco["estimate"] = c["estimate"]
    return {"optimizer": c["optimizer"], "schedule": "inv", "steps": STEPS, "gas": GAS, "acco": acco,
            "clip": c.get("clip", 0.0)}


@pytest.fixture(scope="module")
def runs():
    results = run_ranks(workers.train_cases, cases=[_case(c) for c in CASES], timeout=scaled(200))
    return {c["name"]: (results[0][i], results[1][i]) for i, c in enumerate(CASES)}


def _reference(c, **variant):
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode="acco",
                         make_optimizer=make_optimizer(c.get("ref_optimizer", c["optimizer"])),
                         make_scheduler=make_scheduler("inv"), clip=c.get("clip", 0.0), **variant)


@pytest.mark.parametrize("case", [c for c in CASES if c["ref"]], ids=lambda c: c["name"])
def test_variant_matches_its_recurrence_and_not_the_papers(runs, case):
    r0, r1 = runs[case["name"]]
    want, paper = _reference(case, **case["ref"]), _reference(case)
    err, apart = rel_distance(r0["final"], want), rel_distance(paper, want)
    print(f"{case['name']}: relative error {err:.2e}; the paper's schedule is {apart:.2e} away")
    assert err < 1e-5
    assert apart > 100 * max(err, 1e-7), "the variant barely changes the trajectory: the test would not notice it"
    for n in r0["final"]:
        assert torch.equal(r0["final"][n], r1["final"][n])


def test_the_paper_key_is_the_papers_schedule_bit_for_bit(runs):
    paper, plain = runs["paper"][0], runs["default"][0]
    want = _reference(CASES[-1])
    assert rel_distance(paper["final"], want) < 1e-5
    assert all(torch.equal(paper["final"][n], plain["final"][n]) for n in paper["final"])
    assert paper["losses"] == plain["losses"]


def test_variants_needing_adams_second_moment_refuse_other_optimizers():
    out = run_ranks(workers.train_cases, cases=[
        {**_case({"optimizer": "sgd", "estimate": {"second_moment": "committed"}}), "refused": True}],
        timeout=scaled(60))
    for message in out[0]:
        assert "reads the committed second moment" in message["refused"] and "SGD" in message["refused"]
        assert "fix:" in message["refused"]


def _reference_lag(case, **variant):
    """The reference's drift ‖θ̃_{t+1} − θ_{t+1}‖ / ‖θ_{t+1} − θ_t‖ and cosine of (θ̃_{t+1} − θ_t, θ_{t+1} − θ_t)
    for t = 0 .. STEPS-2 (what the commit of step t measures)."""
    thetas = [{n: p.detach().double() for n, p in TinyNet(seed=0).named_parameters()}]
    estimates = []
    for t in range(1, STEPS):
        log = []
        thetas.append(reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=t, mode="acco",
                                    make_optimizer=make_optimizer(case.get("ref_optimizer", case["optimizer"])),
                                    make_scheduler=make_scheduler("inv"), clip=case.get("clip", 0.0),
                                    estimate_log=log, **variant))
        estimates.append(log[-1])  # θ̃_t
    out = []
    for t in range(STEPS - 1):
        est, th0, th1 = estimates[t], thetas[t], thetas[t + 1]
        sq = lambda a, b: sum(float(((a[n] - b[n]) ** 2).sum()) for n in th0)  # noqa: E731
        miss, commit, estimate = sq(est, th1), sq(th1, th0), sq(est, th0)
        out.append((miss ** 0.5 / commit ** 0.5, (commit + estimate - miss) / (2 * (commit * estimate) ** 0.5)))
    return out


@pytest.mark.parametrize("name", ["default", "lr-scale-2-adamw"])
def test_drift_and_cosine_metrics_are_the_references(runs, name):
    """Each commit's drift and cosine (metrics 'prev_step_estimate_drift' / '_cos', reported with the
    next commit) equal the reference's for the same step: the lag metric the fidelity table reports."""
    case = next(c for c in CASES if c["name"] == name)
    want = _reference_lag(case, **case["ref"])
    records = [m for m in runs[name][0]["metrics"] if "prev_step_estimate_drift" in m]
    got = [(m["prev_step_estimate_drift"], m["prev_step_estimate_cos"]) for m in records]
    assert len(got) == len(want) == STEPS - 1
    for (d, c), (wd, wc) in zip(got, want):
        assert d == pytest.approx(wd, rel=1e-4) and c == pytest.approx(wc, rel=1e-4, abs=1e-5)
    assert max(d for d, _ in want) > 0.05 and min(c for _, c in want) < 0.9999  # not a degenerate case
