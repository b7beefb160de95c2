"""The estimate, default (the family's: look-ahead lr_scale 2, SGD 1.5) and ``"paper"``, with every optimizer family the docs
name, float and tensor learning rates, on a real DeepSpeed engine over 2 gloo ranks
(docs/estimate.md): each run is θ_T of its own float64 recurrence (tests/reference.py, which steps a
deep copy of the same torch optimizer at lr × c) and far from the other variant's. Optimizers without
a functional step (Adagrad, RMSprop, Adafactor, a user-defined one, tensor rates) take their real step
on the round's own copies of the param groups: the compute thread never sees the estimate's rate in
the live groups, checked with the step held on the lane while the compute thread reads them."""
import pytest

from dist import run_ranks
from ds_ops import op_unavailable
from fixtures import TENSOR_LR, TinyNet, batch, make_optimizer, make_scheduler
from reference import DEFAULT_LR_SCALE, PAPER_LR_SCALE, SGD_LR_SCALE, reference_run, rel_distance
from test_estimate_variants import GAS, STEPS, _case
from timeouts import scaled
import optimizer_workers
import workers

TORCH = ["sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor", "heavy-ball"]  # heavy-ball: user-defined
FLOAT_ONLY = {"adafactor-hf": "adafactor-hf", "ds:adamw-torch": "adamw1", "ds:adamw-fused": "adamw1",
              "ds:adam-fused": "adam", "cpu-adamw": "adamw"}  # name -> the reference's optimizer
SKIP = {"cpu-adamw": op_unavailable("CPUAdamBuilder")}
# Adafactor's step depends on each tensor's shape and norm, and ZeRO-1 steps flat shards: no single-process
# recurrence of 2-D parameters gives ZeRO-1's Adafactor. These runs equal the synchronous debug mode's (the
# same rounds on the compute thread) bit for bit, and the two variants' runs are apart.
SHARD_DEPENDENT = ("adafactor",)
FAMILIES = [(n, n) for n in TORCH] + [(n + TENSOR_LR, n) for n in TORCH] + \
    [(n, ref) for n, ref in FLOAT_ONLY.items() if not SKIP.get(n)]
# DeepSpeed's config-built optimizers take no client scheduler; DeepSpeed replaces a client Adagrad with a
# new one built from its defaults, which the client's scheduler no longer reaches
NO_SCHEDULER = ("ds:", "adagrad")
VARIANTS = {"default": (None, DEFAULT_LR_SCALE), "paper": ("paper", PAPER_LR_SCALE)}
# The normalised-update family's default is the paper's estimate (docs/estimate.md#the-default-per-optimizer-
# family): their "default" case asks for lr_scale 2 explicitly, so that both rates stay covered.
NORMALISED = ("adafactor",)
# SGD's default is its family's, 1.5 (the "default" case leaves the block's lr_scale unset).
CASES = [{"name": f"{opt}-{v}", "optimizer": opt, "ref_optimizer": ref,
          "lr_scale": SGD_LR_SCALE if ref == "sgd" and v == "default" else c,
          "estimate": {"lr_scale": c} if opt.startswith(NORMALISED) and est is None else est,
          "other": PAPER_LR_SCALE if v == "default" else DEFAULT_LR_SCALE,
          "schedule": None if opt.startswith(NO_SCHEDULER) else "inv"}
         for opt, ref in FAMILIES for v, (est, c) in VARIANTS.items()]
QUICK = [c for c in CASES if c["name"] in ("adam:tensor-lr-default", "adamw:tensor-lr-default", "rmsprop-default")]


def _train(cases):
    specs = [{**_case(c), "schedule": c["schedule"]} for c in cases]
    for c in cases:
        if c["optimizer"].startswith(SHARD_DEPENDENT):
            synchronous = {**_case(c), "schedule": c["schedule"]}
            synchronous["acco"] = {**synchronous["acco"], "synchronous": True}
            specs.append(synchronous)
    results = run_ranks(workers.train_cases, cases=specs, timeout=scaled(40 + 15 * len(specs)))
    names = [c["name"] for c in cases] + [c["name"] + "-synchronous" for c in cases
                                          if c["optimizer"].startswith(SHARD_DEPENDENT)]
    return {n: (results[0][i], results[1][i]) for i, n in enumerate(names)}


def _reference(case, lr_scale):
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode="acco", lr_scale=lr_scale,
                         make_optimizer=make_optimizer(case["ref_optimizer"]),
                         make_scheduler=make_scheduler(case["schedule"]))


def _check(case, runs):
    r0, r1 = runs[case["name"]]
    assert all(r0["final"][n].equal(r1["final"][n]) for n in r0["final"])
    if case["optimizer"].startswith(SHARD_DEPENDENT):
        variant = "paper" if case["name"].endswith("-default") else "default"
        other = runs[case["name"].rsplit("-", 1)[0] + "-" + variant][0]
        apart = rel_distance(other["final"], r0["final"])
        print(f"{case['name']}: the synchronous run's bits; the other variant's run is {apart:.2e} away")
        assert all(r0["final"][n].equal(runs[case["name"] + "-synchronous"][0]["final"][n]) for n in r0["final"])
        assert apart > 1e-4, "the variants barely differ: the test would not notice a wrong rate"
        return
    want, other = _reference(case, case["lr_scale"]), _reference(case, case["other"])
    err, apart = rel_distance(r0["final"], want), rel_distance(other, want)
    print(f"{case['name']}: relative error {err:.2e}; the other variant's recurrence is {apart:.2e} away")
    assert err < 1e-5
    assert apart > 100 * max(err, 1e-7), "the variants barely differ: the test would not notice a wrong rate"


@pytest.fixture(scope="module")
def quick_runs():
    return _train(QUICK)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c["name"])
def test_tensor_rates_and_a_real_step_under_the_default_estimate(quick_runs, case):
    """Adam / AdamW with ``lr=torch.tensor(...)`` raised at the first estimate round under the default
    lr_scale 2 (blaming acco.dynamic.lr_scaling); now the look-ahead's recurrence, as RMSprop's."""
    _check(case, quick_runs)


@pytest.mark.slow
def test_every_optimizer_family_runs_each_estimate_variants_recurrence():
    runs = _train(CASES)
    for case in CASES:
        _check(case, runs)


def test_the_compute_thread_never_reads_the_estimates_rate():
    """Every round's step is held on the lane while the compute thread reads the param groups and
    ``engine.get_lr()``: they hold the rate read after the launching ``step()``, while the held step of
    each estimate round read it × lr_scale 2 (and of each commit, the rate captured at its launch).
    A user-defined optimizer (no functional step), float and tensor rates, a scheduler stepping."""
    runs = run_ranks(optimizer_workers.read_lr_while_rounds_step, timeout=scaled(120),
                     cases=[{"steps": 3, "tensor_lr": False}, {"steps": 3, "tensor_lr": True}])
    for rounds in [r for rank in runs for r in rank]:
        assert len(rounds) == 2 * 3
        for k, (at_launch, seen, live, get_lr) in enumerate(rounds):
            assert live == get_lr and live[0] == at_launch, (k, rounds)  # nothing written meanwhile
            if k % 2 == 0:  # an estimate round (phases alternate, the estimate first): lr × 2, in its own groups
                assert seen == DEFAULT_LR_SCALE * at_launch and seen not in live, (k, rounds)
            else:  # its commit: step t's rate, captured at the launch (the scheduler has stepped since)
                assert seen == rounds[k - 1][0] != at_launch, (k, rounds)
