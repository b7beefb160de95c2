"""Exports from a plain DeepSpeed loop (``engine.module.state_dict()``): the hold of the committed θ
at its edges. The real clients (Accelerate, HF Trainer, FSDP2) are in tests/integration/test_exports.py."""
import pytest
import torch

from dist import run_ranks
from timeouts import scaled
import export_workers


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())


def test_an_export_holds_theta_until_training_goes_on():
    r0, r1 = run_ranks(export_workers.ds_hold_edges, timeout=scaled(60))
    theta = r0["committed"]
    assert r0["in_flight"] == r1["in_flight"] == "RoundKind.COMMIT"
    # a deep copy of the model belongs to no schedule: its state_dict() leaves the engine on θ̃
    assert not r0["held_after_copies"] and r0["copy_is_estimate"]
    assert _equal(r0["exported"], theta)  # rank 0 alone, fixed mode: no collective, no hang
    # an evaluation (eval mode, no autograd) right after the export runs on what was exported ...
    assert _equal(r0["eval_weights"], theta) and r0["eval_after_export"] == r0["committed_loss"]
    # ... a forward in training mode is back on the estimate
    assert r0["train_forward_on_estimate"]
    assert r0["consolidation_holds"]  # DeepSpeed's AutoTP export path holds θ too
    for r in (r0, r1):  # destroy() leaves θ in the model for good, and no hook behind
        assert _equal(r["after_destroy"], theta) and r["hooks_after_destroy"] == 0
    assert _equal(r1["committed"], theta)


def test_dynamic_mode_export_on_one_rank_never_waits_for_peers():
    """Dynamic accumulation: a peer may launch the round holding θ only later, so an export on
    rank 0 alone does not wait for it (it could hang): while unfinished it is refused at once with
    the fix; once finished it is taken without any collective; the drains still pair up after."""
    dyn = {"min_micro_batches": 1, "max_micro_batches": 6, "check_every": 1}
    case = {"acco": {"mode": "dpu", "accumulation": "dynamic", "dynamic": dyn}, "slow": 2.0, "micro_batches": 10}
    r0, r1 = run_ranks(export_workers.ds_dynamic_export, case=case, timeout=scaled(90))
    assert r0["in_flight"] == "RoundKind.COMMIT"
    assert r0["refused"] and r0["refused"].startswith("RoundInFlightError") and "fix:" in r0["refused"], r0["refused"]
    assert "committed_weights" in r0["refused"]
    assert r0["unfinished_after_refusal"]  # refused without waiting for the round
    assert r0["estimate_left_alone"]
    assert _equal(r0["exported"], r0["committed"])
    assert _equal(r0["committed"], r1["committed"])
