"""ACCO with tensor parallelism: 4 gloo ranks, 2 data-parallel x 2 tensor-parallel, a hand-split
model (tests/deepspeed/tp_workers.py) against the float64 reference of the unsplit model at data-parallel
world 2. Rounds run on the data-parallel group; the gradient norm (so the clip and the skip) is
summed over the tensor-parallel group too, replicated parameters counted once."""
import pytest
import torch

from dist import run_ranks
from reference import reference_run, rel_distance
from fixtures import batch
from timeouts import scaled
import tp_workers
from tp_workers import FullNet, assert_near_reference, assert_replicas_agree, gather_full, make_optimizer

STEPS, GAS = 3, 4
ACCO = {"enabled": True, "mode": "acco"}
CASES = [
    # SGD: the update is linear in the clip factor, so a norm that counts a replicated parameter
    # twice, or misses the other tensor-parallel rank's shard, moves θ_T far beyond the tolerance.
    {"name": "acco-sgd-clip", "acco": ACCO, "optimizer": "sgd", "clip": 0.05},
    {"name": "acco-adamw-clip", "acco": ACCO, "optimizer": "adamw", "clip": 0.05},
    {"name": "stock-sgd-clip", "acco": None, "optimizer": "sgd", "clip": 0.05},
    # a NaN written into tensor-parallel rank 1's gradient only (global rank 1, micro-batch 6: the
    # second half of step 1): every rank must skip commit 1, tensor-parallel rank 0 included
    {"name": "acco-sgd-nan-on-one-tp-rank", "acco": ACCO, "optimizer": "sgd", "clip": 0.0, "nan_grad_at": [[1, 6]],
     "skip_commit": (1,)},
]
# SIGTERM on global rank 1 only (tensor-parallel rank 1 of data-parallel group {1, 3}): the other
# data-parallel group {0, 2} must stop at the same round, or its ranks wait in the tensor-parallel
# all-reduces of the next forward for peers that left
SIGTERM_CASE = {"name": "acco-sigterm-one-tp-rank", "acco": dict(ACCO, sigterm="stop"), "optimizer": "sgd", "clip": 0.0,
                "sigterm_at": [1, 5], "steps": 8, "gas": GAS}

# Per-rank phase lengths cannot work when every forward is a tensor-parallel collective (and the
# tensor-parallel peers sit in different data-parallel groups, which decide their phases apart)
REFUSED = [{"name": f"{a}-refused", "acco": dict(ACCO, accumulation=a), "optimizer": "sgd", "refused": True,
            "steps": 1, "gas": GAS} for a in ("dynamic", "shared")]


# Saved after micro-batch 7 (mid-phase of step 2, a round in flight), with AdamW and clipping,
# then loaded by fresh engines that train on: each rank's own mp-rank / zero-rank files
RESUME_CASE = {"name": "acco-adamw-clip-save", "acco": ACCO, "optimizer": "adamw", "clip": 0.05, "steps": 4, "gas": GAS}
SAVE_AT = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("tp-ckpt"))
    saving = dict(RESUME_CASE, save=(ckpt, SAVE_AT))
    cases = [{**c, "steps": STEPS, "gas": GAS} for c in CASES] + [SIGTERM_CASE] + REFUSED + [saving]
    results = run_ranks(tp_workers.train_tp_cases, world=4, timeout=scaled(240), cases=cases)
    out = {c["name"]: [results[r][i] for r in range(4)] for i, c in enumerate(cases)}
    resumed = dict(RESUME_CASE, name="resumed", resume=(ckpt, SAVE_AT))
    out["resumed"] = [r[0] for r in run_ranks(tp_workers.train_tp_cases, world=4, timeout=scaled(240), cases=[resumed])]
    return out


def _reference(case, clip=None):
    return reference_run(FullNet(seed=0), batch, world=2, gas=GAS, steps=STEPS,
                         mode="acco" if case["acco"] else "sync", make_optimizer=make_optimizer(case["optimizer"]),
                         clip=case["clip"] if clip is None else clip, skip_commit=case.get("skip_commit", ()))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_the_unsplit_reference(runs, case):
    ranks = runs[case["name"]]
    finals = [r["final"] for r in ranks]
    assert_replicas_agree(case["name"], finals, replicated=("scale", "fc2_bias"))
    got = gather_full(finals[0], finals[:2])
    want = _reference(case)
    assert_near_reference(case["name"], got, want, FullNet(seed=0))
    if case["clip"]:  # clipping is active: the unclipped trajectory is far
        assert rel_distance({n: v.float() for n, v in _reference(case, clip=0.0).items()}, want) > 1e-3
    assert all(r["skipped_steps"] == len(case.get("skip_commit", ())) for r in ranks)


def test_sigterm_on_one_tensor_parallel_rank_stops_every_rank_at_the_same_round(runs):
    ranks = runs[SIGTERM_CASE["name"]]
    assert all(r["stopped"] == 143 for r in ranks), ranks
    assert len({(r["done"], r["global_steps"]) for r in ranks}) == 1, ranks  # the same micro-batch and step
    assert ranks[0]["done"] < SIGTERM_CASE["steps"] * GAS


@pytest.mark.parametrize("accumulation", ["dynamic", "shared"])
def test_per_rank_phase_lengths_are_refused_under_tensor_parallelism(runs, accumulation):
    for out in runs[f"{accumulation}-refused"]:
        msg = out.get("refused", "")
        assert f"acco.accumulation = '{accumulation}'" in msg and "tensor parallelism" in msg, out
        assert '"accumulation": "fixed"' in msg


def test_checkpoint_resume_mid_phase_is_exact(runs):
    """Every rank's shard, optimizer state and round in flight come back: the resumed ranks'
    losses and committed weights equal the uninterrupted run's bit for bit."""
    for rank in range(4):
        full, resumed = runs[RESUME_CASE["name"]][rank], runs["resumed"][rank]
        assert resumed["losses"] == full["losses"][SAVE_AT:], rank
        for n in full["final"]:
            assert torch.equal(resumed["final"][n], full["final"][n]), (rank, n)
        assert resumed["global_steps"] == full["global_steps"] == RESUME_CASE["steps"]
        # and saving disturbed nothing: the saving run is the never-saving case of the same config
        # (STEPS steps of it) micro-batch for micro-batch, past the save point
        never_saved = runs["acco-adamw-clip"][rank]["losses"]
        assert SAVE_AT < len(never_saved) and full["losses"][:len(never_saved)] == never_saved, rank
