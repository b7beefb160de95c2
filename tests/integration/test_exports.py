"""What a user exports is what they evaluated (issue 33, item 2).

A real ``accelerate.Accelerator`` (DeepSpeed plugin) and a real ``transformers.Trainer`` train a
tiny GPT-2 with ACCO on 2 CPU ranks; the loop ends with the commit round of its last step in
flight and the model's parameters on the estimate θ̃ (``in_flight == COMMIT`` is asserted, and so
is θ̃ != θ: the state every export starts from). Each export path is then taken on its own, from
that state, and a fresh process reloads what it wrote and evaluates it: its weights must be the
committed θ the in-loop evaluation (inside ``ds_acco.committed_weights``) ran on, bit for bit, and
its held-out loss that evaluation's loss. Before the fix every path but ``Trainer.save_model``,
``save_checkpoint`` and ``zero_to_fp32`` exported θ̃ (max abs difference ~1e-3 here).
"""
from __future__ import annotations

import pytest
import torch

from dist import run_ranks
from timeouts import scaled

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
import export_workers  # noqa: E402

GAS, STEPS = 4, 3  # 12 micro-batches, phases of 2: the last phase end launches the commit of step 3


def _equal(a: dict, b: dict) -> bool:
    return a.keys() <= b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())


def _max_diff(a: dict, b: dict) -> float:
    return max(float((t - b[n]).abs().max()) for n, t in a.items())


def _assert_exports_are_theta(trained: list, reloaded: dict) -> None:
    theta = trained[0]["committed"]
    for r in trained:
        assert r["in_flight"] == "RoundKind.COMMIT", r["in_flight"]  # the loop ended mid-commit
        assert _max_diff(r["estimate"], theta) > 1e-5  # ... with the model on θ̃ != θ
        assert _equal(r["committed"], theta) and r["eval_loss"] == trained[0]["eval_loss"]
        assert all(r["live_between"]), r["live_between"]  # each export started from the loop's state
    assert set(reloaded) == set(trained[0]["paths"]) and reloaded
    for name, got in reloaded.items():
        assert _equal(theta, got["weights"]), (
            f"{name}: exported weights are not the committed θ (max diff {_max_diff(theta, got['weights']):.3g}; "
            f"to the estimate θ̃: {_max_diff(trained[0]['estimate'], got['weights']):.3g})")
        assert got["eval_loss"] == trained[0]["eval_loss"], (name, got["eval_loss"], trained[0]["eval_loss"])


@pytest.mark.slow  # a 2-rank Accelerate run and a fresh process that reloads it (~3 s)
def test_accelerate_exports_are_the_committed_weights(tmp_path):
    case = {"gas": GAS, "steps": STEPS}
    trained = run_ranks(export_workers.accelerate_exports, case=case, out_dir=str(tmp_path), timeout=scaled(120))
    assert trained[0]["engine"] == "AccoEngine" and trained[0]["num_processes"] == 2
    assert trained[0]["global_steps"] == STEPS
    assert set(trained[0]["paths"]) == {"get_state_dict", "unwrap_model().state_dict", "save_pretrained",
                                        "save_16bit_model", "zero_to_fp32"}
    (reloaded,) = run_ranks(export_workers.reload_and_evaluate, world=1, paths=trained[0]["paths"],
                            timeout=scaled(60))  # a fresh process
    _assert_exports_are_theta(trained, reloaded)


def test_accelerate_training_after_an_export_is_bit_identical(tmp_path):
    """An export in the middle of the loop (rank 0 alone, then every rank) returns the committed θ
    of that moment -- what ``committed_weights`` shows there -- and the run then goes on exactly as
    one that never exported: the same losses and final weights, bit for bit."""
    # After micro-batch 3 a phase end launched the commit of step 1 (model on θ̃_1), after 4 that commit is
    # still in flight mid-phase; after 6 the estimate of step 2 is (the model is on θ_1: nothing to swap).
    at = (3, 4, 6)
    case = {"gas": GAS, "steps": STEPS, "at": at}
    out = run_ranks(export_workers.accelerate_export_mid_loop, case=case, out_dir=str(tmp_path), timeout=scaled(120))
    for rank, r in enumerate(out):
        ev, ex = r["evaluated"], r["exported"]
        assert [ev["seen"][f"kind{i}"] for i in at] == ["RoundKind.COMMIT"] * 2 + ["RoundKind.ESTIMATE"]
        assert ev["losses"] == ex["losses"]
        assert _equal(ev["final"], ex["final"]) and ev["global_steps"] == ex["global_steps"] == STEPS
        for i in at:
            if rank == 0:
                assert _equal(ev["seen"][i], ex["seen"][i]), f"rank-0 export after micro-batch {i}"
            assert _equal(ev["seen"][i], ex["seen"][f"all{i}"]), f"get_state_dict after micro-batch {i}"


@pytest.mark.slow  # a Trainer run and a reload (~30 s)
def test_trainer_exports_are_the_committed_weights(tmp_path):
    case = {"gas": GAS, "steps": STEPS, "out_dir": str(tmp_path)}
    trained = run_ranks(export_workers.trainer_exports, case=case, timeout=scaled(150))
    assert trained[0]["engine"] == "AccoEngine"
    (reloaded,) = run_ranks(export_workers.reload_and_evaluate, world=1, paths=trained[0]["paths"],
                            timeout=scaled(60))
    _assert_exports_are_theta(trained, reloaded)
    assert trained[0]["trainer_eval_loss"] == trained[1]["trainer_eval_loss"]


# -- FSDP2 -----------------------------------------------------------------------------------------
FSDP_AT = (3, 4, 6)  # as above: a commit launched, a commit mid-phase, an estimate mid-phase
FSDP_CASES = {
    "resident": {"optimizer": "adamw", "acco": {"enabled": True, "mode": "acco"}},
    "sharded": {"optimizer": "adamw", "sharded": True, "acco": {"enabled": True, "mode": "acco"}},
    "dpu-sharded": {"optimizer": "adamw", "sharded": True, "acco": {"enabled": True, "mode": "dpu"}},
    # an optimizer without a functional estimate steps the master shards themselves during the
    # estimate round (then restores them): the export after micro-batch 5 meets it mid-step
    "resident-rmsprop": {"optimizer": "rmsprop", "slow_estimate": True, "at": (3, 5),
                         "acco": {"enabled": True, "mode": "acco"}},
}


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp2_state_dict_is_the_committed_weights(tmp_path, name):
    """``model.state_dict()`` of an AccoFSDP model (and torch's ``get_model_state_dict`` over it)
    is the committed θ, mid-loop and after it; training then goes on bit for bit; a fresh process
    reloading the full state dict gets θ and the in-loop evaluation's loss. Before, the resident
    layout's state_dict() freed the live weights (the next forward refused), and every layout read
    the master shards while the commit round in flight was stepping them."""
    case = {"gas": GAS, "steps": STEPS, "at": FSDP_AT, **FSDP_CASES[name]}
    at = case["at"]
    out = run_ranks(export_workers.fsdp_exports, case=case, out_dir=str(tmp_path), timeout=scaled(120))
    for rank, r in enumerate(out):
        ev, ex = r["evaluated"], r["exported"]
        assert ex["in_flight"] == "RoundKind.COMMIT"  # the loop ended with a commit in flight
        assert ev["losses"] == ex["losses"] and _equal(ev["final"], ex["final"])
        assert ev["global_steps"] == ex["global_steps"] == STEPS
        assert ev["eval_loss"] == ex["eval_loss"]
        for i in at:
            assert _equal(ev["seen"][i], ex["seen"][i]), f"{name}: get_model_state_dict after micro-batch {i}"
            if rank == 0:
                assert _equal(ev["seen"][f"local{i}"], ex["seen"][f"local{i}"]), f"{name}: rank-0 state_dict at {i}"
    if name == "resident":
        kinds = [out[0]["evaluated"]["seen"][f"kind{i}"] for i in at]
        assert kinds == ["RoundKind.COMMIT"] * 2 + ["RoundKind.ESTIMATE"]
    (reloaded,) = run_ranks(export_workers.reload_tiny_and_evaluate, world=1, path=str(tmp_path / "fsdp_full.pt"),
                            timeout=scaled(30))
    assert _equal(out[0]["evaluated"]["final"], reloaded["weights"])
    assert reloaded["eval_loss"] == out[0]["evaluated"]["eval_loss"]
