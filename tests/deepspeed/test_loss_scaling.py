"""fp16 dynamic loss scaling under ACCO (DeepSpeed's own scaler, in both adapters).

The loss is scaled in backward, so G carries the scale. The scaler is updated once per committed
step (halved after a skipped, overflowing step; doubled after ``loss_scale_window`` clean ones),
and G is rescaled by the same power of two at that moment, so a round never mixes scales; each
round divides by the scale G carried when it was packed. An overflow skips the round's update
(an estimate falls back to θ) -- the non-finite path of test_nonfinite.py.

1. Exactness, in fp32 with DeepSpeed's DynamicLossScaler swapped in: every multiplication by a
   power of two is exact there, so a scaled run must be bit-identical to the unscaled one while
   the scale changes several times mid-run (it would not be if G mixed two scales).
2. Real fp16 on CPU (DeepSpeed engine and FSDP2 with fp16 compute): a huge initial scale
   overflows first; the skipped steps, the scale trajectory (replayed with DeepSpeed's scaler)
   and the committed θ (vs the float64 reference with the same skips) are checked.
"""
import pytest
import torch

import fsdp_workers
from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer
from reference import check_real_fp16, replay_scales

GAS, STEPS = 4, 6
SIM = {"init_scale": 2.0 ** 8, "scale_window": 2, "min_scale": 1, "delayed_shift": 1,
       "consecutive_hysteresis": False}
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 1,
        "min_loss_scale": 1}
BASE = {"optimizer": "sgd", "gas": GAS, "steps": STEPS}
# nan_at: (rank, micro-batch) of an injected non-finite gradient
SIM_CASES = {
    "acco": dict(BASE, acco={"enabled": True, "mode": "acco"}, nan_at=[(1, 6)]),
    "acco-first-half": dict(BASE, acco={"enabled": True, "mode": "acco"}, nan_at=[(0, 8)]),
    "dpu": dict(BASE, acco={"enabled": True, "mode": "dpu"}, nan_at=[(0, 5)]),
}
# engine.optimizer.override_loss_scale(...) after micro-batches 4, 10, 16: each in the middle of a
# phase (mode acco, gas 4: phases of two micro-batches), up and down
OVERRIDE = dict(SIM_CASES["acco"], override_at={4: 2.0 ** 10, 10: 2.0 ** 3, 16: 2.0 ** 6})
REAL_STEPS = 10
REAL_DS = dict(optimizer="sgd", gas=GAS, steps=REAL_STEPS, acco={"enabled": True, "mode": "acco"},
               extra={"fp16": FP16}, fp16_on_cpu=True)
REAL_FSDP = dict(optimizer="sgd", gas=GAS, steps=REAL_STEPS, acco={"enabled": True, "mode": "acco"},
                 extra={"fp16": FP16}, mp="fp16")


FSDP_SAVE_AT, FSDP_TOTAL = (6, 13, 21), 28


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = list(SIM_CASES)
    cases = [SIM_CASES[n] for n in names] + [dict(SIM_CASES[n], sim_scaler=SIM) for n in names] + [OVERRIDE, REAL_DS]
    outs = run_ranks(fsdp_workers.loss_scaling, ds_cases=cases, fsdp_case=REAL_FSDP,
                     ckpt_dir=str(tmp_path_factory.mktemp("fsdp-fp16")), save_at=FSDP_SAVE_AT, total=FSDP_TOTAL)
    out = outs[0]
    k = len(names)
    return {"plain": dict(zip(names, out["ds"][:k])), "scaled": dict(zip(names, out["ds"][k:2 * k])),
            "override": out["ds"][2 * k],
            "real_ds": out["ds"][-1], "real_fsdp": out["fsdp"], "fsdp_ckpt": [o["fsdp_ckpt"] for o in outs]}


@pytest.mark.parametrize("name", list(SIM_CASES))
def test_scaled_run_is_bit_identical_to_unscaled(runs, name):
    plain, scaled = runs["plain"][name], runs["scaled"][name]
    scales = [m["loss_scale"] for m in scaled["metrics"]]
    moves = list(zip([SIM["init_scale"]] + scales, scales))
    assert any(b < a for a, b in moves) and any(b > a for a, b in moves), scales  # halved and doubled mid-run
    for n in plain["final"]:
        assert torch.equal(plain["final"][n], scaled["final"][n]), n
    assert scaled["skipped_steps"] == plain["skipped_steps"] >= 1
    assert scaled["rounds"] == plain["rounds"]
    flags = [m["skipped"] for m in scaled["metrics"]]
    assert scales == replay_scales(flags, **SIM)
    # the backward passes use the initial scale or that of an update (it changes only at commits)
    assert set(scaled["loss_scales"]) <= set(scales) | {SIM["init_scale"]}


def test_loss_scale_set_mid_phase_is_applied_to_the_accumulated_gradients(runs):
    """A scale set from outside between two micro-batches of a phase: G is rescaled before the
    next backward, so the run stays bit-identical to the unscaled one."""
    plain, run = runs["plain"]["acco"], runs["override"]
    assert sorted(set(run["loss_scales"])) == [1.0, 2.0 ** 3, 2.0 ** 6, 2.0 ** 10]
    for n in plain["final"]:
        assert torch.equal(plain["final"][n], run["final"][n]), n
    assert run["rounds"] == plain["rounds"]


@pytest.mark.parametrize("which", ["real_ds", "real_fsdp"])
def test_real_fp16_skips_overflows_and_matches_the_reference(runs, which):
    run = runs[which]
    if which == "real_ds":
        assert run["param_dtype"] == "torch.float16"  # FSDP2: fp16 compute copies of fp32 sharded params
    check_real_fp16(run, TinyNet(seed=0), batch, world=2, gas=GAS, steps=REAL_STEPS, fp16=FP16,
                    make_optimizer=make_optimizer("sgd"), label=f"{which} (fp16)")


def test_real_fp16_fsdp_resumes_bit_identically(runs):
    """AccoFSDP with fp16 compute: the scaler state and G's scale travel in its checkpoint."""
    for rank, ck in enumerate(runs["fsdp_ckpt"]):
        full = ck["full"]
        for i in FSDP_SAVE_AT:
            assert ck[i]["losses"] == full["losses"][i + 1:], f"rank {rank}: losses differ after resuming at {i}"
            assert all(torch.equal(ck[i]["final"][n], t) for n, t in full["final"].items()), (rank, i)
            assert ck[i]["global_steps"] == full["global_steps"]


def test_real_fp16_resumes_bit_identically(tmp_path):
    """Saved after the scale has moved (skips at the start, growth later), a run resumed in new
    processes continues bit-identically: DeepSpeed's scaler state and the scale G carries are
    part of the checkpoint."""
    import lifecycle_workers
    case = dict(REAL_DS, steps=None)
    save_at, total = (6, 13, 17, 22), 30
    full = run_ranks(lifecycle_workers.checkpoint_save_run, case=case, save_dir=str(tmp_path), save_at=save_at, total=total)
    resumed = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=case, save_dir=str(tmp_path), save_at=save_at,
                        total=total)
    for rank in (0, 1):
        for i in save_at:
            got = resumed[rank][i]
            assert got["losses"] == full[rank]["losses"][i + 1:], f"losses differ after resuming at {i}"
            assert all(torch.equal(got["final"][n], t) for n, t in full[rank]["final"].items()), i
            assert got["global_steps"] == full[rank]["global_steps"] and got["loss_scale"] == full[rank]["loss_scale"]
