"""Checkpoints through DeepSpeed's API: exact resume in new processes, stock <-> ACCO, atomic saves."""
import os

import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import reference_run
from timeouts import scaled
import lifecycle_workers
import workers

TOTAL = 22
# after micro-batch: 2 (bootstrap just ended, E_0 in flight), 4 (mid E... phase ends), 6 (mid C_0),
# 8 (mid E_1), 11 (a C→E boundary), 13 (an E→C boundary)
SAVE_AT = (2, 4, 6, 8, 11, 13)
CASES = {
    "acco": {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "acco": {"enabled": True, "mode": "acco"}},
    "dpu": {"optimizer": "sgd", "schedule": "inv", "acco": {"enabled": True, "mode": "dpu"}},
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    case = CASES[request.param]
    save_dir = str(tmp_path_factory.mktemp(f"ckpt-{request.param}"))
    full = run_ranks(lifecycle_workers.checkpoint_save_run, case=case, save_dir=save_dir, save_at=SAVE_AT, total=TOTAL)
    resumed = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=case, save_dir=save_dir, save_at=SAVE_AT, total=TOTAL)
    return request.param, case, save_dir, full, resumed


def test_resume_in_new_processes_is_bit_identical(saved):
    name, _, _, full, resumed = saved
    _assert_resumed_exactly(name, full, resumed, SAVE_AT)


def _assert_resumed_exactly(name, full, resumed, save_at):
    for rank in (0, 1):
        for i in save_at:
            got = resumed[rank][i]
            assert got["optimizer"] == "AccoZeroOptimizer"
            assert got["losses"] == full[rank]["losses"][i + 1:], f"{name}: losses differ after resuming at {i}"
            for n, t in full[rank]["final"].items():
                assert torch.equal(got["final"][n], t), f"{name}: {n} differs after resuming at {i}"
            assert got["global_steps"] == full[rank]["global_steps"]


# The estimate variants with in-flight state of their own (docs/estimate.md), saved where it matters.
VARIANTS = {
    # K = 3 warm-up steps (micro-batches 0-11): saved right after a warm-up step's commit (3), inside a
    # step (6), right at the warm-up's end (11: ACCO's bootstrap next), inside that bootstrap (12) and later
    "warmup": (dict(CASES["acco"], acco={"enabled": True, "mode": "acco", "sync_warmup_steps": 3}),
               (3, 6, 11, 12, 17)),
    # delay compensation: D (θ̃ − θ after a commit, × ḡ̃² after an estimate) in flight at every save
    "delay-compensation": (dict(CASES["acco"], acco={"enabled": True, "mode": "acco",
                                                     "estimate": {"delay_compensation": 1e3}}), SAVE_AT),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved_variant(request, tmp_path_factory):
    case, save_at = VARIANTS[request.param]
    save_dir = str(tmp_path_factory.mktemp(f"ckpt-{request.param}"))
    full = run_ranks(lifecycle_workers.checkpoint_save_run, case=case, save_dir=save_dir, save_at=save_at, total=TOTAL)
    resumed = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=case, save_dir=save_dir, save_at=save_at,
                        total=TOTAL)
    return request.param, save_at, save_dir, full, resumed


def test_variant_resumes_bit_identically(saved_variant):
    """Saved in the synchronous warm-up, at its end, and with delay compensation in flight: a new
    process resumes exactly (D travels with ACCO's in-flight state, this rank's shard)."""
    from ds_acco.deepspeed.optimizer import ACCO_STATE_KEY
    name, save_at, save_dir, full, resumed = saved_variant
    _assert_resumed_exactly(name, full, resumed, save_at)
    states = {i: torch.load(os.path.join(save_dir, f"mb{i}", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                            weights_only=False)["optimizer_state_dict"][ACCO_STATE_KEY] for i in save_at}
    if name == "warmup":
        assert [states[i]["phase"] for i in save_at] == ["sync", "sync", "bootstrap", "bootstrap", "estimate"]
        assert all(states[i]["delay"] is None for i in save_at)
    else:
        shard = sum(t.numel() for g in states[save_at[0]]["groups"] for t in g["live_shard"])
        assert all(states[i]["delay"].numel() == shard for i in save_at)
        assert sum(bool(states[i]["delay"].abs().sum() > 0) for i in save_at) >= 3  # the resumes needed it


def test_checkpoint_adds_only_g_and_this_ranks_shards(saved):
    """Per rank, ACCO adds G and two shards (its part of the live weights and of B's parameters) to
    stock ZeRO-1's files: never a full-size copy of the weights."""
    from ds_acco.deepspeed.optimizer import ACCO_STATE_KEY
    name, _, save_dir, _, _ = saved
    for i in SAVE_AT:
        for rank in (0, 1):
            sd = torch.load(os.path.join(save_dir, f"mb{i}", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                            weights_only=False)
            acco = sd["optimizer_state_dict"][ACCO_STATE_KEY]
            for group in acco["groups"]:
                full = group["grads"].numel()
                assert set(group) == {"grads", "live_shard", "gathered_shard"}, (name, i)
                for key in ("live_shard", "gathered_shard"):
                    assert sum(t.numel() for t in group[key]) * 2 <= full, (name, i, key)


def test_saving_does_not_perturb_training(saved):
    name, case, _, full, _ = saved
    plain = run_ranks(workers.train_cases, cases=[dict(case, steps=TOTAL // 4, gas=4)])[0][0]
    assert plain["losses"][:TOTAL] == full[0]["losses"][:len(plain["losses"])]


def test_acco_checkpoint_loads_into_stock_zero1(saved):
    name, case, save_dir, full, resumed = saved
    stock = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=dict(case, acco=None), save_dir=save_dir,
                      save_at=(11,), total=TOTAL, use_ds_acco=False)
    got = stock[0][11]
    assert got["optimizer"] == "DeepSpeedZeroOptimizer"
    # it starts from the committed θ the ACCO run held at that point
    for n, t in resumed[0][11]["loaded"].items():
        assert torch.equal(got["loaded"][n], t)
    assert got["loaded_steps"] == resumed[0][11]["loaded_steps"]
    assert got["global_steps"] > got["loaded_steps"]


def test_stock_checkpoint_loads_into_acco(tmp_path):
    """A stock ZeRO-1 checkpoint (2 steps) loads into ACCO with exactly the stock weights, and ACCO
    trains on from them, its optimizer state and LR schedule: θ at the end equals the float64
    reference of 2 stock steps followed by ACCO steps on the next micro-batches."""
    case = CASES["acco"]
    stock_case = dict(case, acco=None)
    stock = run_ranks(lifecycle_workers.checkpoint_save_run, case=stock_case, save_dir=str(tmp_path), save_at=(7,), total=8)
    out = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=case, save_dir=str(tmp_path), save_at=(7,), total=TOTAL)
    got = out[0][7]
    assert got["optimizer"] == "AccoZeroOptimizer" and got["loaded_steps"] == 2 == stock[0]["global_steps"]
    for n, t in stock[0]["final"].items():  # saved after its last micro-batch: the stock θ_2 is in the checkpoint
        assert torch.equal(got["loaded"][n], t), f"{n}: loaded weights differ from the stock checkpoint's"
    # Micro-batches 8..21 under ACCO (gas 4): steps of micro-batches 8-11, 12-15, 16-19 commit; 20-21
    # are the first half of the next step (its estimate in flight at the end).
    acco_steps = (TOTAL - 8) // 4
    assert got["global_steps"] == 2 + acco_steps
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=4, steps=acco_steps, mode="acco", stock_steps_first=2,
                         make_optimizer=make_optimizer(case["optimizer"]), make_scheduler=make_scheduler(case["schedule"]),
                         clip=case["clip"])
    err = max(float((got["final"][n].double() - want[n]).abs().max()) for n in want)
    moved = max(float((got["final"][n].double() - got["loaded"][n].double()).abs().max()) for n in want)
    print(f"stock -> ACCO: max abs error vs reference {err:.1e}, moved {moved:.1e} since the load")
    assert err < 1e-5 and moved > 1e-2


@pytest.mark.parametrize("kill_point", ["before_publish", "while_writing"])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, kill_point):
    case = CASES["acco"]
    with pytest.raises(RuntimeError, match="exit code 3"):
        run_ranks(lifecycle_workers.checkpoint_killed_save, world=1, case=case, save_dir=str(tmp_path), kill_point=kill_point)
    assert open(tmp_path / "latest").read() == "good"
    assert not (tmp_path / "bad").exists()
    out = run_ranks(lifecycle_workers.checkpoint_load_latest, world=1, case=case, save_dir=str(tmp_path))[0]
    assert out["path"] is not None and f"{os.sep}good{os.sep}" in out["path"]
    assert out["global_steps"] == 1  # 5 micro-batches of gas 4 in acco: one commit (drained at save)


def test_universal_checkpoint_resumes_at_another_world_size(saved, tmp_path):
    """2 ranks → DeepSpeed's universal checkpoint → 1 rank: committed θ, optimizer state and step
    count carry over; ACCO's per-rank in-flight state cannot, and a fresh phase starts."""
    import subprocess
    import sys
    name, case, save_dir, full, resumed = saved
    if case["optimizer"] != "adamw":
        pytest.skip("DeepSpeed's ds_to_universal converts Adam-style optimizer state only (exp_avg); "
                    f"this case uses {case['optimizer']}")
    out_dir = tmp_path / "universal"
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(save_dir, "mb11"), "--output_folder", str(out_dir / "mb11_universal"),
                        "--inject_missing_state"], capture_output=True, text=True, timeout=scaled(100))
    assert r.returncode == 0, r.stderr[-3000:]
    (out_dir / "latest").write_text("mb11_universal")
    got = run_ranks(lifecycle_workers.universal_resume, world=1, case=case, load_dir=str(out_dir), total=TOTAL, start=12)[0]
    assert got["optimizer"] == "AccoZeroOptimizer"
    assert got["loaded_steps"] == resumed[0][11]["loaded_steps"]
    for n, t in resumed[0][11]["loaded"].items():
        assert torch.equal(got["loaded"][n], t), n
    assert all(l == l for l in got["losses"])  # trains on (finite losses)
