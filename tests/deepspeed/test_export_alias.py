"""Exports read later (issue 40, item 4): a real ``torch.distributed.checkpoint.async_save`` whose
staging runs in the background while the loop goes on, and an EMA of the weights, under ACCO and
under stock ZeRO-1, on 2 gloo ranks with real DeepSpeed engines."""
import pytest
import torch

from dist import run_ranks
from timeouts import scaled
import alias_workers

ACCO = {"mode": "acco"}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())


def _max_diff(a: dict, b: dict) -> float:
    return max(float((t - b[n]).abs().max()) for n, t in a.items())


@pytest.mark.parametrize("acco", [None, ACCO, pytest.param({"mode": "dpu"}, marks=pytest.mark.slow)],
                         ids=["stock", "acco", "dpu"])
def test_async_save_writes_the_weights_of_the_call(tmp_path, acco):
    """``dcp.async_save(model.state_dict())`` at a step boundary and mid-phase, staged in DCP's
    background thread a micro-batch or two later (before the next optimizer step): the saved
    tensors are the committed θ of the call, bit for bit, as stock's are its weights of the call;
    training goes on exactly as without the saves. Before the fix, ACCO's save 1 held θ̃_2."""
    out = run_ranks(alias_workers.ds_async_save, case={"acco": acco}, out_dir=str(tmp_path), timeout=scaled(120))
    for r in out:
        if acco is not None:
            assert r["kind1"] == "RoundKind.COMMIT", r["kind1"]  # the save met the commit in flight
        for k in (1, 2):
            assert _equal(r[f"saved{k}"], r[f"expected{k}"]), (
                f"save {k}: max diff to the committed weights of the call {_max_diff(r[f'saved{k}'], r[f'expected{k}']):.3g}")
        assert not _equal(r["expected1"], r["final"])  # the weights moved on after the saves
        assert r["losses"] == r["plain_losses"] and _equal(r["final"], r["plain_final"])


def test_ema_over_committed_steps_matches_stock_recipe():
    """An EMA updated once per optimizer step: under ACCO through ``ds_acco.on_commit`` it averages
    exactly ACCO's committed θ_1..θ_T (computed the same way as stock's EMA over its own θ_t), in
    order, once each; the stock recipe (``parameters()`` after ``step()``) under ACCO averages the
    estimates instead, which the hook is there to avoid."""
    case = {"steps": 3, "decay": 0.8}
    stock = run_ranks(alias_workers.ds_ema, case={**case, "acco": None}, timeout=scaled(90))
    acco = run_ranks(alias_workers.ds_ema, case={**case, "acco": ACCO}, timeout=scaled(120))
    for is_acco, r in [(False, r) for r in stock] + [(True, r) for r in acco]:
        assert len(r["thetas"]) == 3
        expected = {n: t.clone() for n, t in r["theta0"].items()}
        for theta in r["thetas"]:  # the same update, over the run's own θ_1..θ_T
            alias_workers._ema_update(expected, theta.items(), case["decay"])
        assert _equal(r["ema"], expected), _max_diff(r["ema"], expected)
        if is_acco:
            assert r["hooked_steps"] == [1, 2, 3]
            assert _max_diff(r["naive"], expected) > 1e-6  # the stock recipe under ACCO: not θ
    assert _equal(stock[0]["ema"], stock[1]["ema"]) and _equal(acco[0]["ema"], acco[1]["ema"])
    assert _max_diff(stock[0]["ema"], acco[0]["ema"]) > 0  # two trajectories: each EMA is over its own θ_t
