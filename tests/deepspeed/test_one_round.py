"""Mode 'one_round' (docs/estimate.md, "One round per step: the predictors") on DeepSpeed ZeRO-1, 2 gloo
ranks, against an independent float64 reference of the recurrence written here (the predictors' maths
not imported from ds_acco): each predictor matches its own reference and neither "prediction dropped"
(DPU) nor "prediction applied twice"; the committed θ reaches evaluations and exports exactly."""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import _global_mean_grad, _Trainer, rel_distance
import one_round_workers as orw  # noqa: E402

STEPS, GAS, WORLD = 5, 4, 2
CASES = [
    {"name": "ef-adamw", "predictor": {"name": "ef", "coef": 0.5}, "optimizer": "adamw", "schedule": None},
    {"name": "ef-default-sgd-sched", "predictor": None, "optimizer": "sgd", "schedule": "inv"},
    {"name": "ext-adamw", "predictor": {"name": "ext", "coef": 1.0}, "optimizer": "adamw", "schedule": None},
    {"name": "ext1.5-sgd-sched", "predictor": {"name": "ext", "coef": 1.5}, "optimizer": "sgd", "schedule": "inv"},
    {"name": "nag-adamw", "predictor": "nag", "optimizer": "adamw", "schedule": None},
    {"name": "nag2-adamw-sched", "predictor": {"name": "nag", "coef": 2.0}, "optimizer": "adamw", "schedule": "inv"},
    {"name": "nag-adam", "predictor": "nag", "optimizer": "adam", "schedule": None},
]
DEFAULT = {"name": "ef", "coef": 0.5}  # the library's default, written here on its own


def _pred(case):
    p = case["predictor"] if case["predictor"] is not None else DEFAULT
    p = {"name": p} if isinstance(p, str) else p
    return p["name"], p.get("coef", 0.5 if p["name"] == "ef" else 1.0)  # docs/configuration.md's defaults


def predict(kind, coef, theta, prev, point, opt, model, lr):
    """P_{t+1} from θ_t, θ_{t-1}, P_t and the optimizer's committed state (float64)."""
    if kind == "ext":
        return {n: theta[n] + coef * (theta[n] - prev[n]) for n in theta}
    if kind == "ef":
        return {n: theta[n] + (theta[n] - prev[n]) + coef * (theta[n] - point[n]) for n in theta}
    assert kind == "nag"
    out = {}
    name_of = {id(p): n for n, p in model.named_parameters()}
    for group, rate in zip(opt.param_groups, lr):
        b1, b2 = group["betas"]
        wd = group["weight_decay"] if isinstance(opt, torch.optim.AdamW) else 0.0
        for p in group["params"]:
            n, st = name_of[id(p)], opt.state[p]
            t = int(st["step"])
            mhat, vhat = st["exp_avg"] / (1 - b1 ** t), st["exp_avg_sq"] / (1 - b2 ** t)
            out[n] = theta[n] - coef * rate * (wd * theta[n] + mhat / (vhat.sqrt() + group["eps"]))
    return out


def one_round_reference(case, steps=STEPS, twice=False, dropped=False, fresh=False, world=WORLD, skip=(),
                        clip=0.0):
    """θ_T: step t's whole batch at P_t (P_0 = P_1 = θ_0); commit θ_{t+1} = Opt(θ_t, S_t, ḡ(P_t)); the
    round of step t predicts P_{t+2} from θ_{t+1}, θ_t, P_{t+1}, S_{t+1} (nag's η: that round's rate).
    ``dropped``: P_{t+2} = θ_{t+1} (DPU); ``twice``: the prediction's offset from θ applied twice;
    ``fresh``: step t computed at P_{t+1}, predicted from θ_t (one step fresher than the overlap allows).
    ``skip``: steps whose commit is skipped (non-finite gradient: θ, S and the rate stay, P is still
    predicted); ``clip``: DeepSpeed's gradient clipping of the mean."""
    kind, coef = _pred(case)
    tr = _Trainer(TinyNet(seed=0), make_optimizer(case["optimizer"]), make_scheduler(case["schedule"]), clip)
    points = [tr.params(), tr.params()]
    for t in range(steps):
        theta_t = tr.params()
        grads = _global_mean_grad(tr.model, points[t + 1 if fresh else t],
                                  [batch(r, GAS * t + i) for r in range(world) for i in range(GAS)])
        lr = [g["lr"] for g in tr.opt.param_groups]  # the rate of this commit
        if t not in skip:
            tr.commit(grads)
        theta = tr.params()
        nxt = predict(kind, coef, theta, theta_t, points[t + 1], tr.opt, tr.model, lr)
        if dropped:
            nxt = theta
        if twice:
            nxt = {n: theta[n] + 2 * (nxt[n] - theta[n]) for n in theta}
        points.append(nxt)
    return tr.params()


def _ds_case(c, **kw):
    acco = {"enabled": True, "mode": "one_round"}
    if c["predictor"] is not None:
        acco["predictor"] = c["predictor"]
    return {"optimizer": c["optimizer"], "schedule": c["schedule"], "steps": STEPS, "gas": GAS, "acco": acco, **kw}


@pytest.fixture(scope="module")
def runs():
    cases = [_ds_case(c) for c in CASES] + [_ds_case(CASES[0])]  # the first one twice: determinism
    return run_ranks(orw.train_one_round, cases=cases)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_matches_reference(runs, index):
    """Catches: the prediction dropped (the model at θ: DPU), applied twice, one step too fresh (step t
    at P_{t+1}: what a schedule that waited for the round would compute), the wrong η / state, a
    P_0 / P_1 other than θ_0."""
    case = CASES[index]
    r0, r1 = runs[0][index], runs[1][index]
    want = one_round_reference(case)
    dpu = one_round_reference(case, dropped=True)
    twice = one_round_reference(case, twice=True)
    fresh = one_round_reference(case, fresh=True)
    err = rel_distance(r0["final"], want)
    far = min(rel_distance({n: v.float() for n, v in want.items()}, wrong) for wrong in (dpu, twice, fresh))
    print(f"{case['name']}: relative error {err:.2e}; own reference to dropped / twice / fresh: {far:.2e}")
    assert far > 1e-3, "the mutations barely move θ_T: the test could not tell them apart"
    assert err < 1e-5
    for n in r0["final"]:
        assert torch.equal(r0["final"][n], r1["final"][n])
    assert r0["global_steps"] == STEPS


def test_deterministic(runs):
    """Two identical runs: the same θ_T, bit for bit."""
    a, b = runs[0][0], runs[0][len(CASES)]
    assert all(torch.equal(a["final"][n], b["final"][n]) for n in a["final"])


def test_committed_weights_are_theta(runs):
    """The model's replica holds P; inside ``committed_weights()`` the model and ``state_dict()`` are θ,
    the fp32 masters, bit for bit, at every probe; training after the blocks goes on unchanged."""
    for r in runs[0][:len(CASES)]:
        assert r["probes"], "no probe ran"
        for i, (steps, module_sd, masters, live_differs) in r["probes"].items():
            assert steps == (i + 1) // GAS, (i, steps)  # the commit launched is booked by the block
            for n in masters:
                assert torch.equal(module_sd[n], masters[n]), (i, n)
        assert any(d for *_, d in r["probes"].values()), "the model never held a point other than θ"
        assert r["export_refused"] == "one_round_export"


@pytest.mark.parametrize("name", ["ef", "ext", "nag"])
@pytest.mark.parametrize("save_at", [9, 11], ids=["mid-phase", "phase-end"])
def test_resume_exact(tmp_path, name, save_at):
    """Saved with the commit round in flight (its P_{k+2} in B, P_{k+1} in the model, ef's P buffer),
    resumed in a fresh engine: the losses after the save and θ_T equal the uninterrupted run's, bit for
    bit; so do the saving run's (the save's gather of θ is undone). Catches a checkpoint that stores
    the model's θ (the evaluation block's) as B's P, or drops ef's buffer."""
    case = _ds_case({"predictor": name, "optimizer": "adamw", "schedule": "inv"})
    out = run_ranks(orw.resume, case=case, save_dir=str(tmp_path), save_at=save_at, total=GAS * (STEPS + 1))
    for r in out:
        plain_losses, plain_theta = r["plain"]
        for run in ("saving", "resumed"):
            losses, theta = r[run]
            assert losses == plain_losses, run
            assert all(torch.equal(theta[n], plain_theta[n]) for n in plain_theta), run


def test_destroy_leaves_theta_and_memory(runs):
    """After ``engine.destroy()`` the model holds θ_T (the gather of the close); the predictor's
    persistent bytes are docs/estimate.md's: ef one fp32 copy of the shard, ext and nag none."""
    for case, r in zip(CASES, runs[0]):
        assert all(torch.equal(r["after_destroy"][n], r["final"][n]) for n in r["final"])
        assert all(torch.equal(r["masters"][n], r["final"][n]) for n in r["final"])
        want = r["shard_bytes"] if _pred(case)[0] == "ef" else 0
        assert r["predictor_bytes"] == want, case["name"]
        assert r["shard_bytes"] > 0
