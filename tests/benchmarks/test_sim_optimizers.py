"""benchmarks/sim_optimizers.py's stacked recurrences (issue 43 item 4) are the stock optimizers they stand
for: each run's slice, stepped with its own gradients under a changing learning rate, equals torch's Adam /
SGD, transformers' Adafactor and lion-pytorch's Lion stepping that run alone; ACCO's estimate at c = 2 equals
that optimizer stepped at lr x 2 from the committed state, the state left as it was. The float32 tolerance
is far below the distance between the paper's estimate (c = 1) and the look-ahead one (c = 2)."""
import copy

import pytest
import torch

from benchmarks import multirun
from benchmarks.sim_optimizers import SimOptimizer, check_variants

R = 3
SHAPES = {"w": (5, 7), "e": (4, 3), "b": (7,)}  # matrices decay (multirun's mask), the vector does not
DECAY = {n: len(shape) >= 2 for n, shape in SHAPES.items()}
SETTING = multirun.Setting(weight_decay=0.1)
LRS = {"adam": 1e-3, "sgd": 0.1, "adafactor": 1e-2, "lion": 3e-4}
SCHEDULE = (0.3, 1.0, 0.7, 0.5)  # the peak LR's multiple at each step


def _reference(kind, params):
    """The stock optimizer over one run's parameters, weight decay on the matrices only."""
    wd = SETTING.weight_decay
    groups = [{"params": [p for n, p in params.items() if DECAY[n]], "weight_decay": wd},
              {"params": [p for n, p in params.items() if not DECAY[n]], "weight_decay": 0.0}]
    lr = LRS[kind]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(SETTING.beta1, SETTING.beta2), eps=SETTING.eps)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if kind == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    from lion_pytorch import Lion
    return Lion(groups, lr=lr, betas=(0.9, 0.99))


def _step(opt, params, grads, lr):
    for group in opt.param_groups:
        group["lr"] = lr
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt.step()


def _setup(kind):
    gen = torch.Generator().manual_seed(0)
    theta = {n: torch.randn(R, *shape, generator=gen) for n, shape in SHAPES.items()}
    grads = [{n: torch.randn(R, *shape, generator=gen) for n, shape in SHAPES.items()} for _ in SCHEDULE]
    ref = []
    for r in range(R):
        params = {n: torch.nn.Parameter(t[r].clone()) for n, t in theta.items()}
        ref.append((params, _reference(kind, params)))
    return theta, grads, ref


def _err(theta, ref):
    return max(float((theta[n][r] - params[n].detach()).abs().max()) for r, (params, _) in enumerate(ref)
               for n in theta)


@pytest.mark.parametrize("kind", ["adam", "sgd", "adafactor", "lion"])
def test_stacked_step_is_the_stock_optimizer(kind):
    theta, grads, ref = _setup(kind)
    sim = SimOptimizer(kind, SETTING, theta, DECAY)
    moved = 0.0
    for k, mult in enumerate(SCHEDULE):
        lr = LRS[kind] * mult
        new = sim.step(theta, grads[k], lr, commit=True)
        moved = max(moved, max(float((new[n] - theta[n]).abs().max()) for n in theta))
        theta = new
        for r, (params, opt) in enumerate(ref):
            _step(opt, params, {n: g[r] for n, g in grads[k].items()}, lr)
        err = _err(theta, ref)
        assert err < 1e-6, (kind, k, err)
    assert moved > 1e-4  # the steps are real ones, 100x the tolerance


@pytest.mark.parametrize("kind", ["adam", "sgd", "adafactor", "lion"])
@pytest.mark.parametrize("commits", [0, 2])
def test_estimate_is_a_step_at_scaled_lr_state_discarded(kind, commits):
    theta, grads, ref = _setup(kind)
    sim = SimOptimizer(kind, SETTING, theta, DECAY)
    lr = LRS[kind]
    for k in range(commits):
        theta = sim.step(theta, grads[k], lr, commit=True)
        for r, (params, opt) in enumerate(ref):
            _step(opt, params, {n: g[r] for n, g in grads[k].items()}, lr)
    state = copy.deepcopy(sim.state)
    g_half = grads[commits + 1]
    c = torch.tensor([1.0, 2.0, 2.0])  # run 0: the paper's estimate, runs 1-2: the look-ahead one
    est = sim.step(theta, g_half, c * lr, commit=False)
    assert sim.commits == commits
    for n, st in state.items():  # the estimate's state is discarded
        for key, x in st.items():
            assert (x is None and sim.state[n][key] is None) or torch.equal(x, sim.state[n][key]), (n, key)
    errs = []
    for r, (params, opt) in enumerate(ref):
        params2 = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
        opt2 = _reference(kind, params2)
        opt2.load_state_dict(opt.state_dict())
        _step(opt2, params2, {n: g[r] for n, g in g_half.items()}, lr * float(c[r]))
        errs.append(max(float((est[n][r] - params2[n].detach()).abs().max()) for n in est))
    est1 = sim.step(theta, g_half, lr, commit=False)  # c = 1 for every run: paper vs la2 on runs 1-2
    dist = min(max(float((est[n][r] - est1[n][r]).abs().max()) for n in est) for r in (1, 2))
    print(f"{kind}: estimate error {max(errs):.2e}, paper-vs-la2 distance {dist:.2e}")
    assert max(errs) < 1e-6, errs
    assert dist > 1e3 * max(max(errs), 1e-9)


def test_moment_reading_variants_are_adamw_only():
    check_variants("adamw", [multirun.VARIANTS["keep_v"], multirun.VARIANTS["dc"], multirun.VARIANTS["nag"]])
    check_variants("sgd", [multirun.VARIANTS[v] for v in ("stock", "paper", "la2", "warm", "ext1")])
    for v in ("keep_v", "dc", "nag"):
        with pytest.raises(ValueError, match=f"variant {v}: it reads AdamW's moments; optimizer 'lion'"):
            check_variants("lion", [multirun.VARIANTS[v]])
    with pytest.raises(ValueError, match="optimizer 'rmsprop'"):
        SimOptimizer("rmsprop", SETTING, {}, {})


@pytest.mark.parametrize("kind", ["adam", "sgd", "adafactor", "lion"])
def test_run_group_trains_under_each_optimizer(kind):
    """The stacked simulator under the optimizer: stock and paper share step 0's first half (θ̃_0 = θ_0) and
    part once the LR is above 0 (DeepSpeed's schedule: 0, 0, ...); the losses are finite."""
    s = multirun.Setting(n_embd=32, n_layer=1, n_head=2, micro_batch=2, gas=2, steps=4, warmup=1, eval_every=4,
                         eval_batches=1, lr=LRS[kind] * 10, optimizer=kind)
    trace = []
    recs = multirun.run_group(s, [("stock", 0), ("paper", 0), ("la2", 0)], trace=trace)
    assert all(torch.isfinite(torch.tensor(r["tail_mean"])) for r in recs)
    name = next(iter(trace[0]["first_at"]))
    assert torch.equal(trace[0]["first_at"][name][0], trace[0]["first_at"][name][1])
    assert torch.equal(trace[0]["theta_next"][name][0], trace[0]["theta_next"][name][1])  # same commit at t = 0
    assert not torch.equal(trace[3]["first_at"][name][0], trace[3]["first_at"][name][1])  # warm-up over: estimates
    assert not torch.equal(trace[3]["first_at"][name][1], trace[3]["first_at"][name][2])  # c = 1 vs c = 2
