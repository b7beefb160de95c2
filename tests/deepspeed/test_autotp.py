"""ACCO under DeepSpeed's AutoTP (``"tensor_parallel": {"autotp_size": 2}``: DeepSpeed splits the
model and builds the tensor-parallel groups itself, no user ``mpu``): 4 gloo ranks, 2 data-parallel
x 2 tensor-parallel (tests/deepspeed/tp_workers.py ``train_autotp``).

Stock AutoTP and ACCO (fixed) are each compared with the float64 reference of the unsplit TinyNet
at data-parallel world 2: stock with the synchronous recurrence, ACCO with ACCO's. Stock equal to
its reference shows the reference is what AutoTP computes; ACCO equal to its own then means ACCO
under AutoTP is stock AutoTP + the ACCO recurrence. Per-rank phase lengths (dynamic, shared) are
refused, from the config before any engine exists, and from what the engine built when the
tensor-parallel size comes from ``deepspeed.tp_model_init`` rather than the config. A stock engine
on a data x sequence-parallel mesh shows the built layout is read from DeepSpeed's groups.
"""
import pytest
import torch

import tp_workers
from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer
from reference import reference_run, rel_distance
from timeouts import scaled
from tp_workers import assert_near_reference, assert_replicas_agree, gather_autotp

STEPS, GAS = 3, 4
ACCO = {"enabled": True, "mode": "acco"}
CASES = [
    # SGD: the update is linear in the clip factor, so a norm that counts the replicated fc2.bias
    # twice, or misses the other tensor-parallel rank's shards, moves θ_T far beyond the tolerance
    # (the clipped steps are so small that ACCO's and stock's recurrences nearly coincide here).
    {"name": "stock-sgd-clip", "acco": None, "optimizer": "sgd", "clip": 0.05},
    {"name": "acco-sgd-clip", "acco": ACCO, "optimizer": "sgd", "clip": 0.05},
    # AdamW: ACCO's and stock's recurrences end 3e-3 apart, 300x the tolerance: each run must
    # follow its own.
    {"name": "stock-adamw-clip", "acco": None, "optimizer": "adamw", "clip": 0.05, "modes_apart": True},
    {"name": "acco-adamw-clip", "acco": ACCO, "optimizer": "adamw", "clip": 0.05, "modes_apart": True},
]
REFUSED = [{"name": f"{a}-refused", "acco": dict(ACCO, accumulation=a), "optimizer": "sgd", "refused": True}
           for a in ("dynamic", "shared")]
# The config has no autotp_size: DeepSpeed merges tp_model_init's size into it inside initialize,
# after ds_acco read it, so only the check of what the engine built can see the tensor parallelism.
TP_MODEL_INIT = {"name": "tp-model-init-dynamic-refused", "acco": dict(ACCO, accumulation="dynamic"),
                 "optimizer": "sgd", "refused": True, "via": "tp_model_init"}
MESH = {"name": "stock-sequence-parallel-mesh", "acco": None, "optimizer": "sgd", "via": "mesh"}


@pytest.fixture(scope="module")
def runs():
    cases = [{"steps": STEPS, "gas": GAS, **c} for c in CASES + REFUSED + [TP_MODEL_INIT, MESH]]
    results = run_ranks(tp_workers.train_autotp_cases, world=4, timeout=scaled(300), cases=cases)
    return {c["name"]: [results[r][i] for r in range(4)] for i, c in enumerate(cases)}


def _reference(case, clip=None):
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS,
                         mode="acco" if case["acco"] else "sync", make_optimizer=make_optimizer(case["optimizer"]),
                         clip=case["clip"] if clip is None else clip)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_autotp_matches_the_unsplit_reference(runs, case):
    ranks = runs[case["name"]]
    want_engine = "AccoEngine" if case["acco"] else "DeepSpeedEngine"
    assert all(r["engine"] == want_engine and r["mp_world_size"] == 2 for r in ranks), ranks
    assert [(r["tp_rank"], r["dp_rank"]) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r["global_steps"] == STEPS for r in ranks)
    finals = [r["final"] for r in ranks]
    assert finals[0]["fc1.weight"].shape == (5, 6) and finals[0]["fc2.weight"].shape == (3, 5)  # AutoTP split them
    assert_replicas_agree(case["name"], finals, replicated=("fc2.bias",))
    got = gather_autotp(finals[:2])
    assert_near_reference(case["name"], got, _reference(case), TinyNet(seed=0))
    assert rel_distance(got, _reference(case, clip=0.0)) > 1e-3  # the clip is active
    if case.get("modes_apart"):  # the other recurrence (stock for ACCO, ACCO for stock) is far away
        assert rel_distance(got, _reference(dict(case, acco=None if case["acco"] else ACCO))) > 1e-3


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_autotp_export_is_the_committed_weights(runs, case):
    """AutoTP's consolidated export (``accelerator.get_state_dict`` under AutoTP), taken right after
    the loop with ACCO's last commit round in flight, is the committed θ the evaluation sees."""
    ranks = runs[case["name"]]
    exported = ranks[0]["exported"]
    assert all(r["exported"] is None for r in ranks[1:])  # the whole model on rank 0 only
    theta = gather_autotp([r["final"] for r in ranks[:2]])
    assert exported.keys() == theta.keys()
    assert all(torch.equal(exported[n], theta[n]) for n in theta), case["name"]


@pytest.mark.parametrize("accumulation", ["dynamic", "shared"])
def test_per_rank_phase_lengths_are_refused_under_autotp(runs, accumulation):
    for out in runs[f"{accumulation}-refused"]:
        msg = out.get("refused", "")
        assert f"acco.accumulation = '{accumulation}' with tensor parallelism" in msg, out
        assert "tensor_parallel.autotp_size = 2" in msg and 'fix: set "accumulation": "fixed"' in msg, msg


def test_tensor_parallelism_the_engine_built_is_refused(runs):
    """tp_model_init's size reaches the config only inside deepspeed.initialize: refused from the
    engine's groups, at check point 2, before ACCO's driver (no ACCO engine is returned)."""
    for out in runs[TP_MODEL_INIT["name"]]:
        msg = out.get("refused", "")
        assert "acco.accumulation = 'dynamic' with tensor parallelism (AutoTP's model-parallel group size = 2" \
            in msg, out
        assert 'fix: set "accumulation": "fixed"' in msg


def test_sequence_parallelism_is_read_from_the_groups_the_engine_built(runs):
    for out in runs[MESH["name"]]:
        assert out["sequence_parallel"] == 2, out
        assert "acco.enabled = true with sequence parallelism: the engine's sequence-parallel group size = 2" \
            in out.get("refused", ""), out
