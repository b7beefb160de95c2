"""AccoFSDP(sharded_params=True) on 2 gloo ranks: parameters stay sharded between micro-batches
(FSDP gathers them per layer), rounds only reduce and step, and the phase-end swap points FSDP's
all-gather at the committed shards or at the estimate's shard. Same float operations as the
resident layout: the same weights bit for bit, and the float64 reference."""
import pytest
import torch

from ds_acco.core.checks.refusals import REFUSALS
from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import reference_run
from timeouts import scaled
import fsdp_workers

STEPS, GAS = 3, 4
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 1,
        "min_loss_scale": 1}
BASE = {
    "acco-sgd": {"optimizer": "sgd", "acco": {"enabled": True, "mode": "acco"}},
    "acco-adamw-clip": {"optimizer": "adamw", "schedule": "inv", "clip": 0.05, "acco": {"enabled": True, "mode": "acco"}},
    "dpu-adamw": {"optimizer": "adamw", "schedule": "inv", "acco": {"enabled": True, "mode": "dpu"}},
    # fc2 kept unsharded after a forward, and evaluations on the committed weights mid-phase (a commit
    # in flight at 5 is an estimate, at 7 a commit): the next training forward must gather from the new source
    "acco-adamw-eval": {"optimizer": "adamw", "keep_fc2": True, "eval_at": (5, 7),
                        "acco": {"enabled": True, "mode": "acco"}},
    "acco-adamw-bf16": {"optimizer": "adamw-fast", "mp": True, "acco": {"enabled": True, "mode": "acco"}},
    # the estimate round in bf16: E (param_dtype) is written from a bf16-communicated estimate
    "acco-adamw-est-bf16": {"optimizer": "adamw", "schedule": "inv", "clip": 0.05,
                            "acco": {"enabled": True, "mode": "acco", "estimate_comm_dtype": "bf16"}},
    # fp16 compute with DeepSpeed's dynamic loss scaler from 2^18: the first rounds overflow and skip,
    # so E and the masters must stay put on a skipped round in both layouts
    "acco-sgd-fp16": {"optimizer": "sgd", "mp": "fp16", "extra": {"fp16": FP16},
                      "acco": {"enabled": True, "mode": "acco"}},
}
CASES = [dict(c, name=f"{n}-{layout}", sharded=layout == "sharded", steps=STEPS, gas=GAS)
         for n, c in BASE.items() for layout in ("resident", "sharded")]
CKPT_CASE = {"optimizer": "adamw", "schedule": "inv", "gas": GAS, "sharded": True, "keep_fc2": True,
             "acco": {"enabled": True, "mode": "acco"}}
SAVE_AT, TOTAL = [4, 9, 11], 16  # mid-phase; right after phase ends inside committed_weights (9: commit in flight)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("sharded_ckpt"))
    r0, r1 = run_ranks(fsdp_workers.sharded_params, timeout=scaled(300), cases=CASES, ckpt_case=CKPT_CASE,
                       ckpt_dir=ckpt_dir, save_at=SAVE_AT, total=TOTAL)
    return {"runs": {c["name"]: (r0["runs"][i], r1["runs"][i]) for i, c in enumerate(CASES)},
            "ckpt": (r0["ckpt"], r1["ckpt"]), "edges": r0["edges"]}


def rel_error(got, want):
    num = sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want)
    return float(torch.sqrt(num / sum((want[n].double() ** 2).sum() for n in want)))


@pytest.mark.parametrize("name", list(BASE))
def test_sharded_equals_resident_bit_for_bit(runs, name):
    sharded, resident = runs["runs"][f"{name}-sharded"], runs["runs"][f"{name}-resident"]
    for rank in range(2):
        s, r = sharded[rank], resident[rank]
        for n in r["final"]:  # the committed fp32 masters; in fp32 also what the forward computes with
            assert torch.equal(s["final_fp32"][n], r["final_fp32"][n]), (name, rank, n)
            if not BASE[name].get("mp"):  # (bf16: the resident layout's unsharded parameters are bf16)
                assert torch.equal(s["final"][n], r["final"][n]), (name, rank, n)
        assert s["losses"] == r["losses"], name
        assert s["global_steps"] == r["global_steps"] == STEPS
        assert s["skipped_steps"] == r["skipped_steps"]
        # nothing unsharded resident between micro-batches (FSDP's own resharding), unlike the resident layout
        assert all(s["sharded_between"]) and not any(r["sharded_between"])
        assert all(torch.equal(s["after_close"][n], s["final"][n]) for n in s["final"])
    # B carries gradients only: exactly G's bytes (plus FSDP's dim-0 padding); the resident layout's B
    # is as wide as the wider of the gradient and model dtypes
    s0 = sharded[0]
    assert s0["g_bytes"] <= s0["b_bytes"] < s0["g_bytes"] + 2 * 4 * 16


@pytest.mark.parametrize("name", ["acco-sgd", "acco-adamw-clip", "dpu-adamw"])
def test_sharded_matches_reference(runs, name):
    case = BASE[name]
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode=case["acco"]["mode"],
                         make_optimizer=make_optimizer(case["optimizer"]),
                         make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))
    got = runs["runs"][f"{name}-sharded"][0]["final"]
    err = rel_error(got, want)
    print(f"{name} sharded: reference rel error {err:.2e}")
    assert err < 1e-5


def test_sharded_fp16_skips_overflowing_rounds(runs):
    """The fp16 case really skips (else its bit-for-bit check above proves nothing about skips)."""
    s = runs["runs"]["acco-sgd-fp16-sharded"][0]
    assert s["skipped_steps"] >= 1, s["skipped_steps"]


def test_sharded_checkpoint_resume_is_exact(runs):
    fsdp_workers.assert_resumes_exactly(runs["ckpt"], SAVE_AT, TOTAL, GAS)
    assert runs["ckpt"][0]["swapped_saves"]


def test_sharded_params_at_the_edges(runs):
    e = runs["edges"]
    assert "RMSprop" in e["rmsprop"] and "functional step" in e["rmsprop"] and "fix:" in e["rmsprop"]
    assert e["rmsprop"].endswith(REFUSALS["fsdp_sharded_params_optimizer"].fix)
    for accumulation in ("dynamic", "shared"):
        msg = e[accumulation]
        assert f"acco.accumulation = '{accumulation}'" in msg and "sharded_params=True" in msg, msg
        assert '"accumulation": "fixed"' in msg
        assert msg.endswith(f"{REFUSALS['lockstep'].why}; fix: {REFUSALS['lockstep'].fix}"), msg
    assert e["on_estimate_mid_commit"] is True
    assert "model.to()" in e["to"] and "fix:" in e["to"]
    loaded = e["after_fallback_load"]
    assert loaded["on_estimate"] is False and loaded["global_steps"] == 1  # the resident run had committed step 1
    assert loaded["steps_later"] == 2  # 8 micro-batches: bootstrap, E, C (step 2 collected), E (commit 3 in flight)
