"""The FSDP2 variant (ds_acco.fsdp) on 2 gloo ranks: the float64 reference of ACCO.md, the
DeepSpeed variant on the same model / data / config, synchronous mode, bf16 mixed precision,
exact checkpoint resume and config errors. Everything distributed runs in one spawn."""
import math

import pytest
import torch

from dist import run_ranks
from fixtures import MICRO, TinyNet, batch, make_optimizer, make_scheduler
from reference import mode_references, nearest_own_reference, reference_replay, reference_run
from timeouts import scaled
import fsdp_workers

STEPS, GAS = 3, 4
DYN = {"min_micro_batches": 1, "max_micro_batches": 6, "check_every": 1}
FIXED = {  # name -> (mode, optimizer, schedule, clip); each also runs on DeepSpeed
    "acco-sgd": ("acco", "sgd", None, 0.0),
    "acco-adamw": ("acco", "adamw", "inv", 0.05),
    "dpu-sgd": ("dpu", "sgd", None, 0.0),
    "dpu-adamw": ("dpu", "adamw", "inv", 0.0),
}
FSDP_CASES = {name: {"optimizer": o, "schedule": s, "clip": c, "steps": STEPS, "gas": GAS,
                     "acco": {"enabled": True, "mode": m}} for name, (m, o, s, c) in FIXED.items()}
FSDP_CASES.update({
    "acco-adamw-sync": dict(FSDP_CASES["acco-adamw"], acco={"enabled": True, "mode": "acco", "synchronous": True}),
    "acco-dyn-sgd": {"optimizer": "sgd", "until": 4, "sleep": {"1": 0.03},
                     "acco": {"enabled": True, "mode": "acco", "accumulation": "dynamic", "dynamic": DYN}},
    # adamw-fast (fixtures.py): the schedules end far enough apart to tell them apart in bf16
    "acco-adamw-bf16": {"optimizer": "adamw-fast", "steps": 6, "gas": GAS, "mp": True,
                        "acco": {"enabled": True, "mode": "acco"}},
    "acco-adamw-est-bf16": dict(FSDP_CASES["acco-adamw"], acco={"enabled": True, "mode": "acco",
                                                                "estimate_comm_dtype": "bf16"}),
})
# The estimate variants with a state of their own in the shared core (docs/estimate.md): name -> (acco keys,
# reference_run keys); each also runs on DeepSpeed. Delay compensation also with sharded parameters (its
# θ̃ is then the estimate's shard E that FSDP gathers from).
VARIANTS = {
    "acco-adamw-dc": ({"estimate": {"delay_compensation": 1e3}}, {"delay_compensation": 1e3}),
    "acco-adamw-warmup": ({"sync_warmup_steps": 2}, {"sync_warmup_steps": 2}),
}
for _name, (_keys, _) in VARIANTS.items():
    FSDP_CASES[_name] = dict(FSDP_CASES["acco-adamw"], acco={"enabled": True, "mode": "acco", **_keys})
FSDP_CASES["acco-adamw-dc-sharded"] = dict(FSDP_CASES["acco-adamw-dc"], sharded=True)
CKPT_CASE = {"optimizer": "adamw", "schedule": "inv", "gas": GAS, "acco": {"enabled": True, "mode": "acco"}}
SAVE_AT, TOTAL = [4, 9, 11], 16  # after micro-batch 4: mid-phase; after 9 and 11: right after phase ends, saved inside committed_weights (one with a commit in flight: the export swaps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ds_cases = [{"optimizer": o, "schedule": s, "clip": c, "steps": STEPS, "gas": GAS,
                 "acco": {"enabled": True, "mode": m}} for m, o, s, c in FIXED.values()]
    ds_cases += [FSDP_CASES[name] for name in VARIANTS]
    ckpt_dir = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    r0, r1 = run_ranks(fsdp_workers.everything, timeout=scaled(300), ds_cases=ds_cases, fsdp_cases=list(FSDP_CASES.values()),
                       ckpt_case=CKPT_CASE, ckpt_dir=ckpt_dir, save_at=SAVE_AT, total=TOTAL)
    print(f"DeepSpeed cases {r0['ds_s']:.1f}s, FSDP cases {r0['fsdp_s']:.1f}s")
    out = {name: (r0["fsdp"][i], r1["fsdp"][i]) for i, name in enumerate(FSDP_CASES)}
    out["ds"] = {name: r0["ds"][i] for i, name in enumerate(list(FIXED) + list(VARIANTS))}
    out["ckpt"] = (r0["ckpt"], r1["ckpt"])
    out["errors"] = r0["errors"]
    return out


def rel_error(got, want):
    num = sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want)
    return float(torch.sqrt(num / sum((want[n].double() ** 2).sum() for n in want)))


def _references(name):
    """θ_T of every schedule (acco, acco without estimate, dpu, stock) for case ``name``'s problem."""
    case = FSDP_CASES[name]
    return mode_references(TinyNet(seed=0), batch, world=2, gas=GAS, steps=case.get("steps", STEPS),
                           make_optimizer=make_optimizer(case["optimizer"]),
                           make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))


def _reference(name):
    case = FSDP_CASES[name]
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=case.get("steps", STEPS),
                         mode=case["acco"]["mode"], make_optimizer=make_optimizer(case["optimizer"]),
                         make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_matches_reference_and_deepspeed(runs, name):
    r0, r1 = runs[name]
    want = _reference(name)
    err = rel_error(r0["final"], want)
    ds = runs["ds"][name]["final"]
    ds_diff = rel_error(r0["final"], ds)
    ds_max = max(float((r0["final"][n] - ds[n]).abs().max()) for n in ds)
    same_losses = r0["losses"] == runs["ds"][name]["losses"]
    print(f"{name}: reference rel error {err:.2e}; DeepSpeed vs FSDP rel diff {ds_diff:.2e} (max abs {ds_max:.1e}); "
          f"losses identical: {same_losses}")
    assert err < 1e-5
    # README: "the FSDP and DeepSpeed variants end on bit-identical weights (acco and dpu, SGD+momentum
    # and AdamW)" -- these four cases.
    for n in ds:
        assert torch.equal(r0["final"][n], ds[n]), f"{name}: {n} differs between FSDP and DeepSpeed " \
                                                   f"(max abs {float((r0['final'][n] - ds[n]).abs().max()):.1e})"
    assert rel_error(runs["ds"][name]["final"], want) < 1e-5
    assert all(torch.equal(r0["final"][n], r1["final"][n]) for n in want)
    assert r0["global_steps"] == STEPS
    assert same_losses  # measured: identical too (the same float operations in the same order)
    # close() leaves plain FSDP at the committed θ: the next forward gathers exactly it
    assert all(torch.equal(r0["after_close"][n], r0["final"][n]) for n in want)
    assert len(r0["metrics"]) == STEPS and r0["metrics"][-1]["step"] == STEPS


@pytest.mark.parametrize("name", list(VARIANTS))
def test_estimate_variants_match_reference_and_deepspeed(runs, name):
    """The shared core's delay compensation and synchronous warm-up under FSDP2: the variant's float64
    recurrence (and not the paper's), DeepSpeed's weights bit for bit, and with sharded parameters the
    resident layout's bit for bit."""
    r0, r1 = runs[name]
    case = FSDP_CASES[name]
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode="acco",
                         make_optimizer=make_optimizer(case["optimizer"]), make_scheduler=make_scheduler(case["schedule"]),
                         clip=case["clip"], **VARIANTS[name][1])
    err, apart = rel_error(r0["final"], want), rel_error(_reference(name), want)
    print(f"{name}: reference rel error {err:.2e}; the paper's schedule is {apart:.2e} away")
    assert err < 1e-5 and apart > 100 * max(err, 1e-7)
    ds = runs["ds"][name]
    assert all(torch.equal(r0["final"][n], ds["final"][n]) for n in want) and r0["losses"] == ds["losses"]
    assert all(torch.equal(r0["final"][n], r1["final"][n]) for n in want)
    assert r0["global_steps"] == STEPS
    if name == "acco-adamw-dc":
        sharded = runs["acco-adamw-dc-sharded"][0]
        assert all(torch.equal(sharded["final"][n], r0["final"][n]) for n in want)


def test_synchronous_is_bit_identical(runs):
    a, s = runs["acco-adamw"][0], runs["acco-adamw-sync"][0]
    assert all(torch.equal(a["final"][n], s["final"][n]) for n in a["final"])
    assert a["losses"] == s["losses"]


def test_dynamic_replay(runs):
    r0, r1 = runs["acco-dyn-sgd"]
    counts = [r0["phases"], r1["phases"]]
    want = reference_replay(TinyNet(seed=0), batch, phases_per_rank=counts, steps=r0["global_steps"], mode="acco",
                            make_optimizer=make_optimizer("sgd"))
    err = rel_error(r0["final"], want)
    print(f"acco-dyn-sgd: per-rank phase micro-batches {counts}; reference rel error {err:.2e}")
    assert err < 1e-5
    assert r0["global_steps"] == 4
    assert sum(counts[0]) > sum(counts[1]), "the fast rank should contribute more micro-batches"


@pytest.mark.parametrize("name", list(FIXED) + ["acco-dyn-sgd"])
def test_global_samples_count_samples_as_deepspeed_does(runs, name):
    """The host's global_samples (the x axis of monitor events) is all ranks' samples in the committed
    steps, as DeepSpeed's engine counts them (train_batch_size per fixed step), not the step count."""
    from fixtures import MICRO
    r0, r1 = runs[name]
    want = sum(m["micro_batches_global"] for m in r0["metrics"]) * MICRO  # dynamic phases: as many as there were
    assert r0["global_samples"] == r1["global_samples"] == want
    if name in FIXED:
        assert want == STEPS * GAS * 2 * MICRO


def _train_loss(params):
    model = TinyNet(seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
        return sum(float(model(*batch(r, i))) for r in range(2) for i in range(6 * GAS)) / (12 * GAS)


def test_bf16_mixed_precision_trains(runs):
    r0, r1 = runs["acco-adamw-bf16"]
    want = _reference("acco-adamw-bf16")
    err = rel_error(r0["final"], want)
    theta0 = {n: p.detach() for n, p in TinyNet(seed=0).named_parameters()}
    before, after = _train_loss(theta0), _train_loss(r0["final"])
    print(f"bf16: reference rel error {err:.2e}; train loss {before:.4f} -> {after:.4f}")
    # 3e-2 alone would pass stock or DPU too: the committed fp32 shards must be clearly nearest to ACCO's θ_T
    nearest_own_reference(r0["final_fp32"], _references("acco-adamw-bf16"), "acco", label="FSDP bf16")
    assert after < before - 0.05
    assert err < 3e-2  # bf16 weights in the forward; fp32 shards, G and B
    assert all(torch.equal(r0["final"][n], r1["final"][n]) for n in want)


def test_narrow_estimate_round(runs):
    r0, _ = runs["acco-adamw-est-bf16"]
    err = rel_error(r0["final"], _reference("acco-adamw"))
    print(f"estimate round in bf16: reference rel error {err:.2e}")
    # 1e-2 alone would pass stock or DPU too: the run must be clearly nearest to ACCO's θ_T
    nearest_own_reference(r0["final"], _references("acco-adamw-est-bf16"), "acco", label="FSDP bf16 estimate round")
    assert math.isfinite(err) and err < 1e-2


def test_checkpoint_resume_is_exact(runs):
    fsdp_workers.assert_resumes_exactly(runs["ckpt"], SAVE_AT, TOTAL, GAS)
    assert runs["ckpt"][0]["files"] == sorted(f"mb{i}" for i in SAVE_AT)  # no scratch dirs left
    assert runs["ckpt"][0]["swapped_saves"]  # a save exported the swapped state (commit in flight)



def test_a_checkpoint_without_global_samples_loads_the_samples_fixed_accumulation_committed(runs):
    """A checkpoint written before global_samples was saved loads global_steps x micro-batch samples x
    gradient_accumulation_steps x data-parallel size (not 0): the same count the saved one holds."""
    for rank_out in runs["ckpt"]:
        saved, old = rank_out[SAVE_AT[-1]], rank_out["old_format"]
        assert old["loaded_steps"] == saved["loaded_steps"] > 0
        assert old["loaded_samples"] == saved["loaded_samples"] == saved["loaded_steps"] * MICRO * GAS * 2

def test_config_errors(runs):
    e = runs["errors"]
    assert "gradient_accumulation_steps = 3" in e["odd_gas"] and "even" in e["odd_gas"]
    assert "acco.mdoe" in e["unknown_key"] and "unknown key" in e["unknown_key"]
    assert "acco.mode = 'zero'" in e["bad_mode"]
    assert "acco.enabled = False" in e["disabled"]
    assert "fp16.enabled" in e["fp16"]
    assert "optimizer must" in e["wrong_optimizer"] and "fix:" in e["wrong_optimizer"]
    assert "acco.weighting = 'micro_batch'" in e["weight"]
    assert "re-gather" in e["regather"] and "fix:" in e["regather"]


@pytest.mark.parametrize("config, want", [
    ({}, 1), ({"train_micro_batch_size_per_gpu": 3}, 3), ({"train_batch_size": 48}, 3),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 3}, 3),
    ({"train_batch_size": 50}, "train_batch_size = 50 is not a multiple"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu = 0"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu = True"),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2}, r"train_batch_size = 48 != .* = 2 x 8 x 2 = 32")])
def test_the_micro_batch_size_is_read_as_deepspeed_reads_it(config, want):
    # gradient_accumulation_steps 8 x 2 ranks: train_batch_size 48 is 3 samples per micro-batch
    from ds_acco.core.checks.refusals import REFUSALS, AccoRefusal
    from ds_acco.fsdp.host import micro_batch_size
    if isinstance(want, int):
        assert micro_batch_size(config, 8, 2) == want
    else:
        with pytest.raises(AccoRefusal, match=want) as caught:
            micro_batch_size(config, 8, 2)
        assert caught.value.refusal == "fsdp_batch_size" and caught.value.row is REFUSALS["fsdp_batch_size"]
        assert "fix: set train_micro_batch_size_per_gpu" in str(caught.value)
