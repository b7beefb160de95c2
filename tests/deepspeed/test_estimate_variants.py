"""The estimate variants of the ``"acco"`` block (docs/estimate.md) on 2 gloo ranks against the
independent float64 reference (tests/reference.py), each compared with the paper's schedule too:
matching the variant's recurrence must not also match the paper's (the variant really changes the
trajectory), and ``"estimate": "paper"`` is today's run bit for bit. The variants: the estimate's
learning rate × c (``lr_scale``), Adam's committed second moment (``second_moment``), delay
compensation of the first half in the commit (``delay_compensation`` λ) and the synchronous warm-up
(``sync_warmup_steps`` K: the first K steps are stock ZeRO-1's)."""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import DEFAULT_LR_SCALE, PAPER_LR_SCALE, reference_run, rel_distance
from timeouts import scaled
import workers

STEPS, GAS = 4, 4
# λ: large enough that the compensation moves θ_T by ~2.6% (relative) from the paper's on TinyNet
LAM = 1e3
K = 2  # warm-up steps of STEPS
CASES = [
    {"name": "lr-scale-2-adamw", "estimate": {"lr_scale": 2.0}, "ref": {"lr_scale": 2.0}, "optimizer": "adamw",
     "metrics": {"estimate_drift_every": 1}},
    # the drift metric sampled every 3 steps over 7: the commits of steps 0, 3 and 6 measure it
    {"name": "drift-every-3", "lag_only": True, "estimate": {"lr_scale": 2.0}, "ref": {"lr_scale": 2.0},
     "optimizer": "adamw", "steps": 7, "metrics": {"estimate_drift_every": 3}},
    {"name": "lr-scale-2-sgd", "estimate": {"lr_scale": 2.0}, "ref": {"lr_scale": 2.0}, "optimizer": "sgd"},  # over SGD's 1.5
    {"name": "lr-scale-1.5-adamw-clip", "estimate": {"lr_scale": 1.5}, "ref": {"lr_scale": 1.5}, "optimizer": "adamw",
     "clip": 0.05},
    {"name": "committed-v-adamw", "estimate": {"second_moment": "committed"}, "ref": {"committed_second_moment": True},
     "optimizer": "adamw"},
    {"name": "committed-v-adam-fused-lr2", "estimate": {"second_moment": "committed", "lr_scale": 2.0},
     "ref": {"committed_second_moment": True, "lr_scale": 2.0}, "optimizer": "adamw-fused", "ref_optimizer": "adamw"},
    {"name": "dc-adamw", "estimate": {"delay_compensation": LAM}, "ref": {"delay_compensation": LAM},
     "optimizer": "adamw"},
    {"name": "dc-adamw-clip", "estimate": {"delay_compensation": LAM}, "ref": {"delay_compensation": LAM},
     "optimizer": "adamw", "clip": 0.05},
    {"name": "dc-adamw-fused-lr2", "estimate": {"delay_compensation": LAM, "lr_scale": 2.0},
     "ref": {"delay_compensation": LAM, "lr_scale": 2.0}, "optimizer": "adamw-fused", "ref_optimizer": "adamw"},
    {"name": "dc-adam-committed-v", "estimate": {"delay_compensation": 10.0, "second_moment": "committed"},
     "ref": {"delay_compensation": 10.0, "committed_second_moment": True}, "optimizer": "adam"},
    # a NaN in step 1's first half (its estimate and commit are skipped) and an inf in step 2's second
    # half (its commit only): D after a skipped estimate and after a skipped commit
    {"name": "dc-adamw-nonfinite", "estimate": {"delay_compensation": LAM}, "optimizer": "adamw", "steps": 6,
     "ref": {"delay_compensation": LAM, "skip_estimate": (1,), "skip_commit": (1, 2)},
     "paper": {"skip_estimate": (1,), "skip_commit": (1, 2)}, "nan_at": [(1, 4)], "inf_grad_at": [(0, 11)]},
    {"name": "warmup-adamw", "warmup": K, "ref": {"sync_warmup_steps": K}, "optimizer": "adamw",
     "probe_at": (3, 7, 9), "metrics": {"estimate_drift": True, "estimate_drift_every": 1}},
    {"name": "warmup-sgd-lr1.5", "estimate": {"lr_scale": 1.5}, "warmup": 1,
     "ref": {"sync_warmup_steps": 1, "lr_scale": 1.5}, "optimizer": "sgd"},
    {"name": "warmup-dc-adamw-lr2", "estimate": {"delay_compensation": LAM, "lr_scale": 2.0}, "warmup": K,
     "ref": {"sync_warmup_steps": K, "delay_compensation": LAM, "lr_scale": 2.0}, "optimizer": "adamw"},
    # every step in the warm-up: stock ZeRO-1's schedule, next to the real stock engine below
    {"name": "warmup-all", "warmup": STEPS, "ref": {"sync_warmup_steps": STEPS}, "optimizer": "adamw",
     "probe_at": (3, 7)},
    {"name": "stock", "acco": None, "ref": {}, "optimizer": "adamw", "probe_at": (3, 7)},
    {"name": "paper", "estimate": "paper", "ref": {"lr_scale": PAPER_LR_SCALE}, "optimizer": "adamw"},
    # v0.3's estimate spelt out key by key: what "paper" must equal bit for bit
    {"name": "paper-keys", "estimate": {"lr_scale": 1.0, "second_moment": "update", "delay_compensation": 0.0},
     "ref": {"lr_scale": PAPER_LR_SCALE}, "optimizer": "adamw"},
    {"name": "default", "estimate": None, "ref": {}, "optimizer": "adamw"},
]


def _case(c):
    acco = {"enabled": True, "mode": "acco"}
    if c.get("estimate") is not None:
        acco["estimate"] = c["estimate"]
    if c.get("warmup"):
        acco["sync_warmup_steps"] = c["warmup"]
    if c.get("metrics"):
        acco["metrics"] = c["metrics"]
    out = {"optimizer": c["optimizer"], "schedule": "inv", "steps": c.get("steps", STEPS), "gas": GAS,
           "acco": None if "acco" in c else acco, "clip": c.get("clip", 0.0)}
    out.update({k: c[k] for k in ("nan_at", "inf_grad_at", "probe_at") if k in c})
    return out


@pytest.fixture(scope="module")
def runs():
    results = run_ranks(workers.train_cases, cases=[_case(c) for c in CASES], timeout=scaled(400))
    return {c["name"]: (results[0][i], results[1][i]) for i, c in enumerate(CASES)}


def _reference(c, steps=None, mode="acco", **variant):
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=steps or c.get("steps", STEPS), mode=mode,
                         make_optimizer=make_optimizer(c.get("ref_optimizer", c["optimizer"])),
                         make_scheduler=make_scheduler("inv"), clip=c.get("clip", 0.0), **variant)


VARIANTS = [c for c in CASES if c["ref"] and "acco" not in c and c["ref"].get("lr_scale") != PAPER_LR_SCALE
            and not c.get("lag_only")]


@pytest.mark.parametrize("case", VARIANTS, ids=lambda c: c["name"])
def test_variant_matches_its_recurrence_and_not_the_papers(runs, case):
    r0, r1 = runs[case["name"]]
    want = _reference(case, **case["ref"])
    paper = _reference(case, **{"lr_scale": PAPER_LR_SCALE, **case.get("paper", {})})
    err, apart = rel_distance(r0["final"], want), rel_distance(paper, want)
    print(f"{case['name']}: relative error {err:.2e}; the paper's schedule is {apart:.2e} away")
    assert err < 1e-5
    assert apart > 100 * max(err, 1e-7), "the variant barely changes the trajectory: the test would not notice it"
    for n in r0["final"]:
        assert torch.equal(r0["final"][n], r1["final"][n])


def test_the_paper_key_is_the_papers_schedule_bit_for_bit(runs):
    """``"estimate": "paper"`` is v0.3's estimate (lr_scale 1, v updated, no compensation) bit for bit,
    and the paper's recurrence; the default is not (it is the look-ahead's, below)."""
    paper, keys = runs["paper"][0], runs["paper-keys"][0]
    want = _reference(CASES[-1], lr_scale=PAPER_LR_SCALE)
    assert rel_distance(paper["final"], want) < 1e-5
    assert all(torch.equal(paper["final"][n], keys["final"][n]) for n in paper["final"])
    assert paper["losses"] == keys["losses"]


def test_the_default_estimate_is_the_look_ahead():
    """The default the reference assumes is the library's (each written down on its own)."""
    import torch
    from ds_acco.config import AccoConfig
    from reference import SGD_LR_SCALE, default_lr_scale
    assert AccoConfig.from_block({"enabled": True}).estimate.lr_scale == DEFAULT_LR_SCALE == 2.0
    assert AccoConfig.from_block({"enabled": True, "estimate": "paper"}).estimate.lr_scale == PAPER_LR_SCALE
    p = [torch.nn.Parameter(torch.zeros(1))]

    class Heavy(torch.optim.SGD):  # a subclass: its base's family, in both
        pass
    for opt in (torch.optim.SGD(p, lr=0.1, momentum=0.9), Heavy(p, lr=0.1), torch.optim.AdamW(p)):
        library = AccoConfig.from_block({"enabled": True}).for_optimizer(opt).estimate.lr_scale
        assert library == default_lr_scale(opt), type(opt).__name__
    assert default_lr_scale(torch.optim.SGD(p, lr=0.1)) == SGD_LR_SCALE == 1.5


def test_the_default_run_is_the_look_ahead_recurrence_bit_for_bit(runs):
    """A config without an estimate key runs lr_scale 2: the same bits as asking for it, on the
    look-ahead's recurrence and away from the paper's."""
    default, la2 = runs["default"][0], runs["lr-scale-2-adamw"][0]
    assert all(torch.equal(default["final"][n], la2["final"][n]) for n in default["final"])
    assert default["losses"] == la2["losses"]
    want, paper = _reference(CASES[-1]), _reference(CASES[-1], lr_scale=PAPER_LR_SCALE)
    assert rel_distance(default["final"], want) < 1e-5 < 100 * 1e-5 < rel_distance(paper, want)


def test_delay_compensation_skips_as_the_reference_does(runs):
    """Which rounds the non-finite case skipped (the reference above takes the same skips)."""
    skipped = {k for k, s in runs["dc-adamw-nonfinite"][0]["rounds"] if s}
    assert skipped == {("estimate", 1), ("commit", 1), ("commit", 2)}
    assert runs["dc-adamw-nonfinite"][0]["skipped_steps"] == 2


def test_sync_warmup_is_stock_zero1s_schedule(runs):
    """The first K steps are stock's: accumulation boundaries every A micro-batches, the commit
    waited for in the step() that launched it (global_steps and the committed θ, stock's, right
    after it), the LR read after each step() stock's; then ACCO's phases of A/2. With every step in
    the warm-up, θ_T is the real stock engine's, within float rounding, and far from ACCO's."""
    stock, paper = runs["stock"][0], runs["paper"][0]
    assert stock["optimizer"] == "DeepSpeedZeroOptimizer"
    for name in ("warmup-all", "warmup-adamw"):
        run = runs[name][0]
        assert run["lrs"] == stock["lrs"], name
        warm = GAS * (STEPS if name == "warmup-all" else K)
        assert run["boundaries"][:warm] == stock["boundaries"][:warm] == [i % GAS == GAS - 1 for i in range(warm)]
        assert run["boundaries"][warm:] == paper["boundaries"][:GAS * STEPS - warm], name
        for i in (3, 7):  # right after the step() of a warm-up step's last micro-batch
            steps, theta = run["probes"][i]
            assert steps == stock["probes"][i][0] == (i + 1) // GAS, (name, i)
            assert rel_distance(theta, stock["probes"][i][1]) < 1e-6, (name, i)
    steps, theta = runs["warmup-adamw"][0]["probes"][9]  # ACCO's bootstrap from θ_K: nothing committed since
    assert steps == K and rel_distance(theta, stock["probes"][7][1]) < 1e-6
    # no estimate, no estimate drift for the warm-up's steps (nor one for its last commit, read with step K+1)
    records = runs["warmup-adamw"][0]["metrics"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [("estimate_micro_batches_global" in r, "prev_step_estimate_drift" in r) for r in records] == \
        [(False, False)] * K + [(True, False)] + [(True, True)] * (STEPS - K - 1)
    got, want = runs["warmup-all"][0]["final"], stock["final"]
    err, apart = rel_distance(got, want), rel_distance(paper["final"], want)
    print(f"warm-up over all {STEPS} steps vs the stock engine: {err:.1e}; ACCO's (paper) θ_T is {apart:.1e} away")
    assert err < 1e-6 and apart > 1000 * err
    assert runs["warmup-all"][0]["global_steps"] == stock["global_steps"] == STEPS


def test_variants_needing_adams_second_moment_refuse_other_optimizers():
    out = run_ranks(workers.train_cases, cases=[
        {**_case({"optimizer": "sgd", "estimate": {"second_moment": "committed"}}), "refused": True}],
        timeout=scaled(60))
    for message, key in zip(out[0], ("acco.estimate.second_moment = 'committed'",
                                     "acco.estimate.delay_compensation = 2.0")):
        assert message["refused"].startswith(key), message
        assert "reads the committed second moment" in message["refused"] and "SGD" in message["refused"]
        assert "fix:" in message["refused"]


def _reference_lag(case, steps=STEPS, **variant):
    """The reference's drift ‖θ̃_{t+1} − θ_{t+1}‖ / ‖θ_{t+1} − θ_t‖ and cosine of (θ̃_{t+1} − θ_t, θ_{t+1} − θ_t)
    for t = 0 .. steps-2 (what the commit of step t measures)."""
    thetas = [{n: p.detach().double() for n, p in TinyNet(seed=0).named_parameters()}]
    estimates = []
    for t in range(1, steps):
        log = []
        thetas.append(reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=t, mode="acco",
                                    make_optimizer=make_optimizer(case.get("ref_optimizer", case["optimizer"])),
                                    make_scheduler=make_scheduler("inv"), clip=case.get("clip", 0.0),
                                    estimate_log=log, **variant))
        estimates.append(log[-1])  # θ̃_t
    out = []
    for t in range(steps - 1):
        est, th0, th1 = estimates[t], thetas[t], thetas[t + 1]
        sq = lambda a, b: sum(float(((a[n] - b[n]) ** 2).sum()) for n in th0)  # noqa: E731
        miss, commit, estimate = sq(est, th1), sq(th1, th0), sq(est, th0)
        out.append((miss ** 0.5 / commit ** 0.5, (commit + estimate - miss) / (2 * (commit * estimate) ** 0.5)))
    return out


@pytest.mark.parametrize("name,measured", [("lr-scale-2-adamw", [0, 1, 2]), ("drift-every-3", [0, 3]),
                                           ("default", [0])])
def test_drift_and_cosine_metrics_are_the_references(runs, name, measured):
    """The sampled commits' drift and cosine (metrics 'prev_step_estimate_drift' / '_cos', reported
    with the next commit) equal the reference's for the same step: the lag metric the fidelity table
    reports. Sampled (acco.metrics.estimate_drift_every): with 1 every commit's (the last one's is
    never read: no round follows it), with 3 the commits of steps 0 and 3 (and 6, the last), by
    default (100) step 0's only; on both ranks."""
    case = next(c for c in CASES if c["name"] == name)
    steps = case.get("steps", STEPS)
    want = [lag for t, lag in enumerate(_reference_lag(case, steps, **case["ref"])) if t in measured]
    for rank in (0, 1):
        metrics = runs[name][rank]["metrics"]
        assert len(metrics) == steps
        records = [m for m in metrics if "prev_step_estimate_drift" in m]
        assert [m["step"] for m in records] == [t + 2 for t in measured]  # commit t's, read with step t+1's
        assert all("prev_step_estimate_cos" not in m for m in metrics if m not in records)
    got = [(m["prev_step_estimate_drift"], m["prev_step_estimate_cos"]) for m in records]
    assert len(got) == len(want) == len(measured)
    for (d, c), (wd, wc) in zip(got, want):
        assert d == pytest.approx(wd, rel=1e-4) and c == pytest.approx(wc, rel=1e-4, abs=1e-5)
    assert max(d for d, _ in want) > 0.05 and min(c for _, c in want) < 0.9999  # not a degenerate case
