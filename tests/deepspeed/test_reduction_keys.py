"""DeepSpeed keys that change how the gradient is reduced or when the step is taken (ds_acco/config_keys.py),
through real engines on 2 gloo ranks: honoured like stock against the float64 reference, or refused."""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer
from reference import reference_run, rel_distance
import workers

GAS, STEPS, WORLD = 4, 3, 2
SUM = {"gradient_allreduce_op": "sum"}
BASE = {"optimizer": "sgd", "schedule": None, "gas": GAS, "steps": STEPS}
ACCO_CASES = {
    "acco-sum": dict(BASE, acco={"enabled": True, "mode": "acco"}, extra=SUM),
    "dpu-sum": dict(BASE, acco={"enabled": True, "mode": "dpu"}, extra=SUM),
    "acco-sum-clip": dict(BASE, acco={"enabled": True, "mode": "acco"}, extra=SUM, clip=2.0),
    "unmanaged": dict(BASE, acco={"enabled": True, "mode": "acco"}, extra={"managed_gradient_accumulation": False},
                      refused=True),
}
STOCK_CASES = {"stock-sum": dict(BASE, acco=None, extra=SUM)}


@pytest.fixture(scope="module")
def runs():
    acco = run_ranks(workers.train_cases, cases=list(ACCO_CASES.values()))
    stock = run_ranks(workers.train_cases, cases=list(STOCK_CASES.values()), use_ds_acco=False)
    out = {n: (acco[0][i], acco[1][i]) for i, n in enumerate(ACCO_CASES)}
    out.update({n: (stock[0][i], stock[1][i]) for i, n in enumerate(STOCK_CASES)})
    return out


def _reference(mode, sum_ranks, clip=0.0):
    return reference_run(TinyNet(seed=0), batch, world=WORLD, gas=GAS, steps=STEPS, mode=mode,
                         make_optimizer=make_optimizer("sgd"), clip=clip, sum_ranks=sum_ranks)


@pytest.mark.parametrize("name,mode,clip", [("stock-sum", "sync", 0.0), ("acco-sum", "acco", 0.0),
                                            ("dpu-sum", "dpu", 0.0), ("acco-sum-clip", "acco", 2.0)])
def test_gradient_allreduce_op_sum_is_honoured(runs, name, mode, clip):
    """``"gradient_allreduce_op": "sum"``: the ranks' gradients are summed (world × the mean), in
    stock ZeRO-1 and in ACCO's rounds alike; each run lands on its own schedule's float64 reference
    with the sum, far from the one with the default mean (SGD: the sum doubles every step here). With
    clipping, the summed gradient's norm is clipped (2.0: active on the sum, not on the mean)."""
    r0, r1 = runs[name]
    summed, averaged = _reference(mode, True, clip), _reference(mode, False, clip)
    err, apart = rel_distance(r0["final"], summed), rel_distance(averaged, summed)
    print(f"{name}: relative distance to the sum reference {err:.2e}, mean vs sum references {apart:.2e}")
    assert apart > 1e-2, "the sum does not move this trajectory: the test could not tell it was ignored"
    if clip:
        assert rel_distance(_reference(mode, True), summed) > 1e-2, "the clip is not active on this trajectory"
    assert err < 1e-5
    for n in r0["final"]:
        assert torch.equal(r0["final"][n], r1["final"][n]), n
    assert r0["global_steps"] == STEPS


def test_unmanaged_gradient_accumulation_is_refused(runs):
    """``"managed_gradient_accumulation": false`` (the caller runs k backward() per step()) is refused
    at initialize, naming the key, the value and the fix, on every rank."""
    for r in runs["unmanaged"]:
        msg = r["refused"]
        assert msg.startswith("managed_gradient_accumulation = false: "), msg
        assert "fix: " in msg and "engine.step() after every engine.backward()" in msg, msg
