"""The one-round predictors of the fidelity simulator (benchmarks/multirun.py; docs/estimate.md, "One
round per step: the predictors") against an independent float64 reference: the real model
(benchmarks.gpt.CausalLM, in float64), torch's own AdamW and DeepSpeed's WarmupCosineLR stepping the
commit, the whole batch's gradient taken at the predicted point P_t by ordinary autograd, and each
predictor written per tensor from its formula, reading AdamW's moments from the optimizer's state.

Per step t the simulator's point P_t and commit θ_{t+1} must equal the reference's to float32
rounding; the same reference with the prediction dropped (plain DPU) or applied twice must be far
off -- the tests check that margin too, so a tolerance cannot hide either mistake."""
import math

import pytest
import torch

from benchmarks import multirun
from benchmarks.data import micro_batches
from benchmarks.gpt import CausalLM, param_groups

S = multirun.Setting(n_embd=8, n_layer=1, n_head=2, seq_len=8, micro_batch=2, gas=2, world=2, steps=5, warmup=2,
                     lr=1e-2, eval_every=5, eval_batches=1)
SEED = 1
CHECKED = ["dpu", "ext1", "ext2", "nag", "nag2", "ef"]
TOL = 1e-4  # float32 against float64, relative to the largest update norm: measured 1.0-1.7e-5; wrong answers >= 0.67


def reference(predict: str, c: float, twice=False, s=S, seed=SEED):
    """float64: per step t the point P_t and the commit θ_{t+1}. ``predict`` as the Variant's field,
    ``c`` its coefficient; ``twice``: the prediction's offset from θ_t applied twice (a mutation)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    train, _ = multirun._splits(s.seq_len)
    torch.manual_seed(seed)
    model = CausalLM(s.seq_len, s.n_embd, s.n_layer, s.n_head).double()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(param_groups(model), lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps,
                            weight_decay=s.weight_decay)
    sched = WarmupCosineLR(opt, total_num_steps=s.steps, warmup_num_steps=s.warmup, warmup_min_ratio=0.0,
                           cos_min_ratio=s.cos_min_ratio, warmup_type="linear")
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    streams = [micro_batches(train, s.micro_batch, r, s.world, seed) for r in range(s.world)]
    theta = {n: p.detach().clone() for n, p in params.items()}
    before = dict(theta)  # θ_{t-1}; θ_{-1} = θ_0
    point = dict(theta)  # P_0 = θ_0
    points, commits = [], []
    for t in range(s.steps):
        batch = [[next(st) for _ in range(s.gas)] for st in streams]
        rows = [mb for per_rank in batch for mb in per_rank]
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(point[n])
        model.zero_grad()
        (sum(model(mb) for mb in rows) / len(rows)).backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        divisor = max(1.0, (norm + 1e-6) / s.clip)
        lr = opt.param_groups[0]["lr"]
        nxt = {}
        for n, p in params.items():  # P_{t+1}, from θ_t, θ_{t-1}, P_t and S_t only
            th = theta[n]
            if predict == "ext":
                nxt[n] = th + c * (th - before[n])
            elif predict == "ef":
                nxt[n] = th + (th - before[n]) + c * (th - point[n])
            elif predict == "nag" and t >= 1:
                state = opt.state[p]
                k = int(state["step"])
                assert k == t
                m_hat = state["exp_avg"] / (1 - s.beta1 ** k)
                v_hat = state["exp_avg_sq"] / (1 - s.beta2 ** k)
                wd = s.weight_decay if id(p) in decayed else 0.0
                nxt[n] = th - c * lr * (wd * th + m_hat / (v_hat.sqrt() + s.eps))
            else:  # dpu, or nag before the first commit
                nxt[n] = th.clone()
            if twice:
                nxt[n] = th + 2 * (nxt[n] - th)
        with torch.no_grad():  # the commit: from θ_t, with the clipped whole-batch mean
            for n, p in params.items():
                p.copy_(theta[n])
                p.grad = grads[n] / divisor
        opt.step()
        sched.step()
        new = {n: p.detach().clone() for n, p in params.items()}
        points.append(point)
        commits.append(new)
        before, theta, point = theta, new, nxt
    return points, commits


@pytest.fixture(scope="module")
def simulated():
    trace = []
    multirun.run_group(S, [(v, SEED) for v in CHECKED], trace=trace)
    return trace


def _dist(trace, r, ref_points, ref_commits):
    """max over steps of ‖P_sim − P_ref‖ and ‖θ_sim − θ_ref‖, relative to the largest update ‖θ_{t+1} − θ_t‖
    (step 0's is 0: the warm-up starts at rate 0)."""
    worst = 0.0
    thetas = [ref_points[0]] + ref_commits
    scale = max(math.sqrt(sum(float(((b[n] - a[n]) ** 2).sum()) for n in a)) for a, b in zip(thetas, thetas[1:]))
    for t, step in enumerate(trace):
        for key, ref in (("first_at", ref_points[t]), ("second_at", ref_points[t]), ("theta_next", ref_commits[t])):
            d = math.sqrt(sum(float(((step[key][n][r].double() - ref[n]) ** 2).sum()) for n in ref))
            worst = max(worst, d / scale)
    return worst


@pytest.mark.parametrize("name", CHECKED)
def test_predictor_matches_the_float64_reference(simulated, name):
    v = multirun.VARIANTS[name]
    r = CHECKED.index(name)
    err = _dist(simulated, r, *reference(v.predict, v.pc))
    assert err < TOL, (name, err)
    if name == "dpu":
        return
    dropped = _dist(simulated, r, *reference("dpu", 0.0))  # the prediction left out: plain DPU
    twice = _dist(simulated, r, *reference(v.predict, v.pc, twice=True))
    print(f"{name}: err {err:.2e}, prediction dropped {dropped:.2e}, applied twice {twice:.2e}")
    assert dropped > 10 * TOL and twice > 10 * TOL, (name, err, dropped, twice)


def test_dpu_is_one_step_stale(simulated):
    """ACCO.md's DPU: steps 0 and 1 at θ_0, step t ≥ 1 at θ_{t-1}."""
    r = CHECKED.index("dpu")
    for t, step in enumerate(simulated):
        want = simulated[t - 2]["theta_next"] if t >= 2 else simulated[0]["first_at"]
        for n, x in step["first_at"].items():
            assert torch.equal(x[r], want[n][r]), (t, n)


def test_an_unknown_predictor_is_refused():
    multirun.VARIANTS["bogus"] = multirun.Variant("bogus", predict="extrapolate")
    try:
        with pytest.raises(ValueError, match="extrapolate"):
            multirun.run_group(S, [("bogus", 0)])
    finally:
        del multirun.VARIANTS["bogus"]
