"""Mode 'auto' (docs/configuration.md) on DeepSpeed ZeRO-1, 2 gloo ranks: after K stock steps every rank
runs the mode the measured times pick (given here through auto's test seam, ``auto.measure_hook``, so the
decision is deterministic), bit for bit the run that names that mode: stock's steps for good (the
synchronous warm-up forever), ``"mode": "acco"`` or ``"one_round"`` with ``"sync_warmup_steps": K``."""
import pytest
import torch

import auto_workers as aw  # noqa: E402
from dist import run_ranks

pytestmark = pytest.mark.slow  # three 2-rank launches (~25 s idle): the slow tier; auto's rule is quick (test_auto_decide)

STEPS, GAS, WORLD, K = 6, 4, 2, 3
AUTO = {"enabled": True, "mode": "auto", "auto_probe_steps": K}
ALL = dict(AUTO, auto_modes=["stock", "acco", "one_round"])
# (C, R) per rank, hand-computed with the step-time rules: stock C + R, fixed 2·max(C/2, R), one-round max(C, R)
STOCK_TIMES = [(1.0, 1.0)] * WORLD  # stock 2.0, fixed 2.0: not 5% faster -> stock
ACCO_TIMES = [(1.0, 0.2)] * WORLD  # stock 1.2, fixed 1.0 -> acco
ONE_TIMES = [(1.0, 0.8)] * WORLD  # stock 1.8, fixed 1.6, one-round 1.0 -> one_round (when listed)
# rank 0 alone would pick acco, rank 1 alone stock (stock 2.5, fixed 3.0); agreed: max C 1.0, min R 0.2 -> acco
SPLIT_TIMES = [(1.0, 0.2), (1.0, 1.5)]
CASES = {
    "auto-stock": {"acco": AUTO, "times": STOCK_TIMES},
    "warmup-forever": {"acco": {"enabled": True, "sync_warmup_steps": STEPS}},
    "auto-acco": {"acco": AUTO, "times": ACCO_TIMES},
    "acco-after-K": {"acco": {"enabled": True, "sync_warmup_steps": K}},
    "auto-one-round": {"acco": ALL, "times": ONE_TIMES},
    "auto-default-no-one-round": {"acco": AUTO, "times": ONE_TIMES},
    "one-round-after-K": {"acco": {"enabled": True, "mode": "one_round", "sync_warmup_steps": K}},
    "auto-split": {"acco": dict(AUTO, comm_timeout_s=60.0), "times": SPLIT_TIMES},
    "acco": {"acco": {"enabled": True}},
}


@pytest.fixture(scope="module")
def runs():
    names = list(CASES)
    out = run_ranks(aw.train_cases, cases=[dict(CASES[n], gas=GAS, steps=STEPS) for n in names])
    return {n: [out[r][i] for r in range(WORLD)] for i, n in enumerate(names)}


def _same(a, b):
    return a["losses"] == b["losses"] and all(torch.equal(a["final"][n], b["final"][n]) for n in a["final"])


@pytest.mark.parametrize("name,want,same_as,other", [
    ("auto-stock", "stock", "warmup-forever", "acco-after-K"),
    ("auto-acco", "acco", "acco-after-K", "warmup-forever"),
    ("auto-one-round", "one_round", "one-round-after-K", "acco-after-K"),
    ("auto-default-no-one-round", "acco", "acco-after-K", "one-round-after-K"),
])
def test_decision_runs_the_named_mode_bit_for_bit(runs, name, want, same_as, other):
    """Catches: a decision other than the rule's (one_round without opting in), the chosen mode started
    at another step or from another point (P ≠ θ_K), stock's steps left after K, a sync step predicted."""
    for rank in range(WORLD):
        got, ref, far = runs[name][rank], runs[same_as][rank], runs[other][rank]
        assert got["decision"]["choice"] == want and got["decision"]["step"] == K
        assert _same(got, ref), (name, rank)
        assert not _same(got, far), f"{same_as} and {other} do not differ: the comparison could not fail"
        assert got["global_steps"] == STEPS
    stock_run = runs["auto-stock"][0]
    assert stock_run["phase"] == "sync" and runs["auto-acco"][0]["mode"] == "acco"
    assert runs["auto-one-round"][0]["mode"] == "one_round"


def test_log_line_reproduces_the_choice(runs):
    """Rank 0 logs one line with C, R, r, each candidate's predicted step, the choice, the rule and the
    key that forces it; the other ranks log nothing."""
    (line,) = runs["auto-one-round"][0]["lines"]
    assert "C = 1 s" in line and "R = 0.8 s" in line and "r = R/(C/2) = 1.6" in line
    assert "stock 1.8 s, acco 1.6 s, one_round 1 s" in line and "chose one_round" in line
    assert '"mode": "one_round", "sync_warmup_steps": 3' in line
    assert "one_round" not in runs["auto-acco"][0]["lines"][0].split("predicted step:")[1].split(";")[0]
    assert runs["auto-one-round"][1]["lines"] == []


def test_ranks_with_different_times_take_one_decision(runs):
    """Rank 0 measured a round that fixed hides, rank 1 one it does not: both run acco (the slowest rank's
    compute against the round the last rank saw), the same weights as acco after K stock steps.
    Catches: each rank deciding on its own times (they diverge: different modes, weights or a hang)."""
    r0, r1 = runs["auto-split"]
    assert r0["decision"] == r1["decision"] and r0["decision"]["choice"] == "acco"
    assert (r0["decision"]["compute_s"], r0["decision"]["round_s"]) == (1.0, 0.2)
    for rank in range(WORLD):
        assert _same(runs["auto-split"][rank], runs["acco-after-K"][rank])


@pytest.mark.parametrize("case,save_at,resumed_times", [
    # decided one_round at step 3; saved at step 4 (a round in flight); the fresh engine's times say stock
    ({"acco": ALL, "times": ONE_TIMES}, GAS * 4 + 1, STOCK_TIMES),
    # saved mid-probe (step 1, mid-phase): the measurements go on from the checkpoint's; the decision at K
    ({"acco": AUTO, "times": ACCO_TIMES}, GAS + 1, ACCO_TIMES),
], ids=["after-decision", "mid-probe"])
def test_resume_continues_exactly(tmp_path, case, save_at, resumed_times):
    """A resume goes on in the mode chosen, without measuring again: losses and θ_T equal the run that
    saved. Catches: the decision not saved (re-measured: stock here, or the mode refused as a mismatch)."""
    total = GAS * (STEPS + 1)
    out = run_ranks(aw.resume, case=dict(case, gas=GAS), save_dir=str(tmp_path), save_at=save_at, total=total,
                    resumed_times=resumed_times)
    for rank in range(WORLD):
        saving, resumed = out[rank]["saving"], out[rank]["resumed"]
        assert resumed["decision"] == saving["decision"] and saving["decision"]["step"] == K
        assert _same(resumed, saving), rank
        assert resumed["mode"] == saving["mode"]


def _one_round_after_k(gamma=0.5, start_at_theta_k=True):
    """θ_T of K stock steps then the one-round mode (ef γ) from θ_K: P_K = P_{K+1} = θ_K (float64)."""
    from fixtures import TinyNet, batch, make_optimizer
    from reference import _global_mean_grad, _Trainer
    tr = _Trainer(TinyNet(seed=0), make_optimizer("adamw"), None, 0.0)
    start = tr.params()
    batches = lambda t: [batch(r, GAS * t + i) for r in range(WORLD) for i in range(GAS)]  # noqa: E731
    for t in range(K):
        tr.commit(_global_mean_grad(tr.model, tr.params(), batches(t)))
    p0 = tr.params() if start_at_theta_k else start
    points = {K: tr.params(), K + 1: p0}
    for t in range(K, STEPS):
        before = tr.params()
        tr.commit(_global_mean_grad(tr.model, points[t], batches(t)))
        theta = tr.params()
        points[t + 2] = {n: theta[n] + (theta[n] - before[n]) + gamma * (theta[n] - points[t + 1][n]) for n in theta}
    return tr.params()


def test_one_round_after_k_stock_steps_is_the_recurrence_from_theta_k(runs):
    """``"mode": "one_round", "sync_warmup_steps": K`` (what auto's one_round is, bit for bit): K stock
    steps, then the one-round recurrence started at θ_K. Catches: the predictor's point left at θ_0
    (not restarted at the bootstrap), a stock step's round writing a prediction."""
    from reference import rel_distance
    want, stale = _one_round_after_k(), _one_round_after_k(start_at_theta_k=False)
    assert rel_distance(stale, want) > 1e-3
    assert rel_distance(runs["one-round-after-K"][0]["final"], want) < 1e-5
