"""AccoFSDP over a data-parallel mesh that spans a subset of the world: ranks 0 and 1 of 3 (rank 2
builds nothing), and the 'dp' dimension of a 2-D mesh of 4 ranks. The rounds' process group is
created by the mesh's ranks alone, the config check runs on the mesh's group, and training ends on
the same weights as over a 2-rank world; afterwards the world still creates groups together.
Also: close() with a failed round in flight still gives the model back to plain FSDP."""
import pytest
import torch

from dist import run_ranks
from timeouts import scaled
import fsdp_workers

# comm_timeout_s also bounds a rounds' group whose creation reads a stale rendezvous (a mutation)
CASE = {"optimizer": "adamw", "schedule": "inv", "gas": 4, "steps": 3,
        "acco": {"enabled": True, "mode": "acco", "comm_timeout_s": 30}}


@pytest.fixture(scope="module")
def runs():
    return {layout: run_ranks(fsdp_workers.data_parallel_meshes, world=world, timeout=scaled(150), case=CASE,
                              layout=layout)
            for layout, world in (("world", 2), ("subset", 3), ("2d", 4))}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("layout", ["subset", "2d"])
def test_a_mesh_over_some_ranks_trains_as_over_a_world_of_its_size(runs, layout):
    reference = runs["world"]
    trained = [r for r in runs[layout] if "final" in r]
    assert len(trained) == {"subset": 2, "2d": 4}[layout]
    if layout == "2d":
        assert sorted(tuple(r["dp_ranks"]) for r in trained) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for r in trained:
        assert r["rounds_group_rank_sum"] == sum(r["dp_ranks"])  # the rounds' group is the mesh's ranks
        want = reference[r["dp_ranks"].index(r["rank"])]
        assert r["global_steps"] == want["global_steps"] == CASE["steps"]
        assert r["losses"] == want["losses"]
        assert _same(r["final"], want["final"]), f"rank {r['rank']} ended elsewhere than the 2-rank world"
    world = len(runs[layout])
    assert [r["rank_sum"] for r in runs[layout]] == [float(sum(range(world)))] * world


def test_a_second_engine_over_the_same_subset_gets_a_group_of_its_own(runs):
    trained = [r for r in runs["subset"] if "final" in r]
    assert [r["again"] for r in trained] == [1, 1]  # one committed step each, rank 1 arriving late


def test_a_subset_with_eagerly_initialised_nccl_is_refused_with_the_fix(runs):
    for r in runs["subset"][:2]:
        error = r["bound_device_error"]
        assert "ranks [0, 1] of 3" in error and "device_id" in error, error
        assert "fix: call init_process_group without device_id" in error, error


def test_close_with_a_failed_round_in_flight_gives_the_model_back_to_fsdp(runs):
    for r in runs["world"]:
        failed = r["failed_close"]
        assert failed["raised"] is not None and "NonFiniteGradientError" in failed["raised"], failed
        assert failed["hooks"] == 0 and failed["plain_fsdp_grads"]
