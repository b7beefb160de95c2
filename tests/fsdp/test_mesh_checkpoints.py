"""FSDP2 checkpoints on data-parallel meshes that are not the whole world: 4 ranks as two
independent ACCO jobs, the 'dp' groups {0, 1} and {2, 3} of a (job 2, dp 2) mesh, each saving on
its own schedule to its own directory, mid-phase with a round in flight, and each stopped by a
SIGTERM at its own micro-batch (acco.sigterm 'checkpoint', one directory setting for both). Every
save, load and publication must run on the job's own mesh: a default-group barrier or DCP over the
world pairs one job's collectives with the other's (or waits for ranks that never come), and a
publication by global rank 0 leaves the other job's checkpoint unpublished. Resumed in fresh
processes, every later loss and the final weights equal the uninterrupted run's, also when a job's
checkpoint is resumed by the ranks of the other job."""
import os

import pytest
import torch

from ds_acco.core.checks.refusals import REFUSALS
from dist import run_ranks
from timeouts import scaled
import fsdp_workers

TOTAL = 16
ACCO = {"enabled": True, "mode": "acco", "sigterm": "checkpoint"}
# gas 4: phases of 2 micro-batches; after micro-batches 2, 4 and 8 a phase is half done and the
# round launched at its start is in flight. The jobs save a different number of times.
SAVES = {0: [4], 1: [2, 8]}
SIGTERM = {0: (1, 6), 1: (2, 9)}  # job -> (global rank signalled, after its micro-batch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mesh_ckpt"))
    case = {"optimizer": "adamw", "schedule": "inv", "gas": 4,
            "acco": dict(ACCO, sigterm_checkpoint_dir=os.path.join(root, "sigterm"))}
    saved = run_ranks(fsdp_workers.mesh_checkpoint_saves, world=4, timeout=scaled(120), case=case, root=root,
                      saves=SAVES, sigterm=SIGTERM, total=TOTAL)
    stopped_after = {job: saved[2 * job]["stopped_after"] for job in (0, 1)}
    resumed = run_ranks(fsdp_workers.mesh_checkpoint_resumes, world=4, timeout=scaled(120), case=case, root=root,
                        saves=SAVES, stopped_after=stopped_after, total=TOTAL)
    return {"saved": saved, "resumed": resumed, "root": root}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_each_job_publishes_its_own_checkpoints(runs):
    root = runs["root"]
    for job, points in SAVES.items():
        assert sorted(os.listdir(os.path.join(root, f"job{job}"))) == sorted(f"mb{i}" for i in points)
    # one sigterm_checkpoint_dir in the shared config: a directory per data-parallel group, named
    # by the global rank of its rank 0; nothing half-written left anywhere
    assert sorted(os.listdir(os.path.join(root, "sigterm"))) == ["dp-group-0", "dp-group-2"]
    assert [r["sigterm_dir"] for r in runs["saved"]] == [os.path.join(root, "sigterm", f"dp-group-{g}")
                                                         for g in (0, 0, 2, 2)]
    for dirpath, dirnames, _ in os.walk(root):
        assert not [d for d in dirnames if "acco-partial" in d or "acco-retired" in d], dirpath
    for r in runs["saved"]:  # each save drained a round launched at the start of its phase
        assert r["saved_with_a_round_in_flight"] == [True] * len(SAVES[r["job"]])


def test_saving_does_not_change_training(runs):
    for r in runs["saved"]:
        assert r["saving_losses"] == r["losses"], f"rank {r['rank']}"


@pytest.mark.parametrize("job", [0, 1])
def test_sigterm_stops_one_job_at_one_round(runs, job):
    ranks = [r for r in runs["saved"] if r["job"] == job]
    assert [r["stopped"] for r in ranks] == [143, 143]
    assert ranks[0]["stopped_after"] == ranks[1]["stopped_after"] < TOTAL - 1
    assert ranks[0]["stopped_after"] >= SIGTERM[job][1]


@pytest.mark.parametrize("job", [0, 1])
def test_resumes_in_fresh_processes_are_exact(runs, job):
    for saved, resumed in zip(runs["saved"], runs["resumed"]):
        if saved["job"] != job:
            continue
        points = [(i, i) for i in SAVES[job]] + [("sigterm", saved["stopped_after"])]
        for key, after in points:
            got = resumed[key]
            assert got["losses"] == saved["losses"][after + 1:], f"rank {saved['rank']}: losses after {key}"
            assert _equal(got["final"], saved["final"]), f"rank {saved['rank']}: final weights after {key}"
            assert got["global_steps"] == saved["global_steps"] == TOTAL // 4
            assert got["loaded_steps"] == (after + 1) // 4  # the commits collected by micro-batch ``after``


def test_a_checkpoint_resumes_exactly_on_other_global_ranks(runs):
    """Each job resumed the other job's last save on that job's data: the in-flight state is kept
    per rank of the data-parallel mesh, not per global rank."""
    saved = runs["saved"]
    for resumed in runs["resumed"]:
        origin = saved[resumed["rank"] ^ 2]  # the rank of the other job with the same mesh rank
        after = SAVES[origin["job"]][-1]
        got = resumed["moved"]
        assert got["losses"] == origin["losses"][after + 1:], f"rank {resumed['rank']}"
        assert _equal(got["final"], origin["final"]), f"rank {resumed['rank']}"


def test_the_jobs_trained_apart(runs):
    """Each job trained on its own data: a checkpoint read by the wrong job would be caught."""
    saved = runs["saved"]
    assert _equal(saved[0]["final"], saved[1]["final"]) and _equal(saved[2]["final"], saved[3]["final"])
    assert not _equal(saved[0]["final"], saved[2]["final"])


def test_hsdp_stays_refused(runs):
    for r in runs["saved"]:
        assert "not HSDP or 2-D meshes" in r["hsdp"] and "fix:" in r["hsdp"], r["hsdp"]
        assert r["hsdp"].endswith(REFUSALS["fsdp_mesh"].fix), r["hsdp"]
