"""accumulation 'shared': fixed mode's global count per phase, shared among the ranks by measured
speed (2 gloo ranks, one slowed by a sleep in its loop), replayed through the float64 reference;
equal to fixed mode bit for bit without heterogeneity; an exact resume; refused where a caller
counts A micro-batches per rank per step."""
import glob
import os
import shutil

import pytest
import torch

from dist import run_ranks
from timeouts import scaled
from fixtures import TinyNet, batch, ds_config, make_optimizer, make_scheduler
from reference import reference_replay
import workers

STEPS, GAS, SAVE_AT = 6, 4, 3
SHARED = {"enabled": True, "mode": "acco", "accumulation": "shared"}
# The sleeps dominate a TinyNet micro-batch (a few ms), so the measured rates are stable on a
# loaded host: equal sleeps stay well inside the dead band; 40 ms vs ~0 puts rank 1 > 5x slower,
# whose shares (3, 1) in mode acco and (7, 1) in dpu no timing noise changes.
EVEN = {"0": 0.02, "1": 0.02}
SLOW1 = {"1": 0.04}
CASES = {
    "fixed": {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "acco": dict(SHARED, accumulation="fixed")},
    "shared-even": {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "acco": SHARED, "sleep": EVEN},
    "shared-slow": {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "acco": SHARED, "sleep": SLOW1},
    "shared-slow-sgd": {"optimizer": "sgd", "acco": SHARED, "sleep": {"0": 0.04}},
    "dpu-shared-slow": {"optimizer": "adamw", "acco": dict(SHARED, mode="dpu"), "sleep": SLOW1},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("shared-ckpt"))
    save_even = str(tmp_path_factory.mktemp("shared-even-ckpt"))
    cases = [dict({"steps": STEPS, "gas": GAS}, **c) for c in CASES.values()]
    cases[list(CASES).index("shared-slow")]["save"] = (save, SAVE_AT)
    cases[list(CASES).index("shared-even")]["save"] = (save_even, SAVE_AT)
    results = run_ranks(workers.train_until_cases, cases=cases, timeout=scaled(200))
    out = {name: (results[0][i], results[1][i]) for i, name in enumerate(CASES)}
    old = str(tmp_path_factory.mktemp("shared-even-old-ckpt"))
    shutil.copytree(save_even, old, dirs_exist_ok=True)
    assert strip_key(old, "shares_aligned") == 2  # one file per rank: as saved before the key existed
    resumed = {"resumed": ("shared-slow", save), "resumed-even": ("shared-even", save_even),
               "resumed-even-old": ("shared-even", old)}
    cases = [dict(CASES[name], steps=STEPS, gas=GAS, resume=(path, SAVE_AT)) for name, path in resumed.values()]
    results = run_ranks(workers.train_until_cases, cases=cases, timeout=scaled(200))
    out.update({name: (results[0][i], results[1][i]) for i, name in enumerate(resumed)})
    return out


def strip_key(folder, key):
    """Remove ``key`` from every dict inside the checkpoint files under ``folder``; files changed."""
    def strip(obj):
        if isinstance(obj, dict):
            found = obj.pop(key, None) is not None
            return sum([strip(v) for v in obj.values()], int(found))
        return sum(strip(v) for v in obj) if isinstance(obj, (list, tuple)) else 0
    changed = 0
    for path in glob.glob(os.path.join(folder, "**", "*.pt"), recursive=True):
        state = torch.load(path, weights_only=False)
        if strip(state):
            torch.save(state, path)
            changed += 1
    return changed


def total_per_phase(mode):
    return 2 * (GAS // 2 if mode == "acco" else GAS)


def changes(shares):
    """The shares as they changed (rank 0 records them after each of its micro-batches, rank 1 of its)."""
    return [s for i, s in enumerate(shares) if i == 0 or s != shares[i - 1]]


def equal(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_without_heterogeneity_it_is_fixed_mode_bit_for_bit(runs):
    for rank in (0, 1):
        fixed, shared = runs["fixed"][rank], runs["shared-even"][rank]
        assert all(s == (GAS // 2, GAS // 2) for s in shared["shares"]), shared["shares"]
        assert shared["losses"] == fixed["losses"]
        assert equal(shared["final"], fixed["final"])
        assert shared["seconds_per_micro_batch"] >= 0.02  # measured (the sleep is compute to it)


@pytest.mark.parametrize("name", ["shared-slow", "shared-slow-sgd", "dpu-shared-slow"])
def test_the_slow_rank_gets_fewer_and_the_global_count_stays_fixed(runs, name):
    r0, r1 = runs[name]
    case = CASES[name]
    mode = case["acco"]["mode"]
    slow = 1 if "1" in case["sleep"] else 0
    total = total_per_phase(mode)
    counts = [[p["micro_batches"] for p in r["phases"]] for r in (r0, r1)]
    assert len(counts[0]) == len(counts[1])  # the same rounds on every rank
    assert all(a + b == total for a, b in zip(*counts)), counts  # every phase: fixed mode's global count
    assert any(c[slow] < c[1 - slow] for c in zip(*counts)), counts  # shared by speed
    assert all(c[slow] <= c[1 - slow] for c in zip(*counts)), counts  # never in the slow rank's favour
    assert {p["reason"] for r in (r0, r1) for p in r["phases"]} == {"shared"}
    assert changes(r0["shares"]) == changes(r1["shares"])  # every rank computed the same shares
    # each step commits exactly stock's global batch (world x A micro-batches)
    assert all(rec["micro_batches_global"] == 2 * GAS for rec in r0["metrics"]), r0["metrics"]
    assert runs[name][1 - slow]["seconds_per_micro_batch"] * 3 < runs[name][slow]["seconds_per_micro_batch"]
    want = reference_replay(TinyNet(seed=0), batch, phases_per_rank=counts, steps=r0["global_steps"], mode=mode,
                            make_optimizer=make_optimizer(case["optimizer"]),
                            make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))
    num = sum(((r0["final"][n].double() - want[n]) ** 2).sum() for n in want)
    err = float(torch.sqrt(num / sum((w ** 2).sum() for w in want.values())))
    print(f"{name}: per-rank phase micro-batches {counts}; relative error {err:.2e}")
    assert err < 1e-5
    assert equal(r0["final"], r1["final"])
    assert r0["global_steps"] == (STEPS if mode == "acco" else STEPS + 1)


def test_resume_from_a_step_boundary_is_exact(runs):
    for rank in (0, 1):
        full, resumed = runs["shared-slow"][rank], runs["resumed"][rank]
        after = len(full["losses"]) - len(resumed["losses"])  # micro-batches fed before the save
        assert after > 0 and full["shares"][after - 1] != (GAS // 2, GAS // 2)  # saved with unequal shares
        assert resumed["shares"] == full["shares"][after:], "the shares (from measured rates) differed"
        assert resumed["losses"] == full["losses"][after:]
        assert equal(resumed["final"], full["final"])
        assert resumed["global_steps"] == full["global_steps"]
        # the ranks' phase ends stay apart: drains keep their agreement protocol after the resume
        assert not any(resumed["aligned"]) and resumed["drains_agree_by_protocol"]


@pytest.mark.parametrize("name", ["shared-slow", "shared-slow-sgd", "dpu-shared-slow"])
def test_fixed_modes_path_is_left_for_good_at_the_first_unequal_shares(runs, name):
    """``aligned`` (fixed mode's path: no drain protocol) holds exactly while every phase so far had
    equal shares, on every rank alike; shares back at equal later do not bring it back."""
    for r in runs[name]:
        equal_so_far = [all(s == r["shares"][0] for s in r["shares"][:i + 1]) for i in range(len(r["shares"]))]
        assert r["shares"][0] == (total_per_phase(CASES[name]["acco"]["mode"]) // 2,) * 2
        assert r["aligned"] == equal_so_far and not r["aligned"][-1], (r["shares"], r["aligned"])
        assert r["drains_agree_by_protocol"]
    assert changes(runs[name][0]["aligned"]) == changes(runs[name][1]["aligned"]) == [True, False]


def test_equal_shares_resume_on_fixed_modes_path_and_older_checkpoints_on_the_protocol(runs):
    for rank in (0, 1):
        full = runs["shared-even"][rank]
        assert all(full["aligned"]) and not full["drains_agree_by_protocol"]
        for name, protocol in (("resumed-even", False), ("resumed-even-old", True)):
            resumed = runs[name][rank]
            after = len(full["losses"]) - len(resumed["losses"])
            assert after > 0 and resumed["losses"] == full["losses"][after:], name
            assert equal(resumed["final"], full["final"]), name
            # a checkpoint without the flag may come from ranks whose shares differed before: protocol
            assert resumed["drains_agree_by_protocol"] is protocol, name
            assert all(a is (not protocol) for a in resumed["aligned"]), (name, resumed["aligned"])


# -- refused where the caller counts A micro-batches per rank per step -------------------------------
def test_refused_at_initialize_under_megatron():
    import ds_acco
    from megatron_workers import IncrementLR

    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    with pytest.raises(ValueError, match="accumulation = 'shared' with a caller that sets the accumulation "
                                         "boundary.*its share by measured speed.*fix: use .accumulation.: "
                                         ".fixed.") as caught:
        ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=IncrementLR(opt),
                           config=ds_config(GAS, SHARED), dist_init_required=False)
    assert caught.value.refusal == "per_rank_phases_caller_boundary"


def test_refused_under_accelerate():
    from ds_acco.install import _refuse_dynamic_under_accelerate

    _refuse_dynamic_under_accelerate({"config": ds_config(GAS, dict(SHARED, accumulation="fixed"))})  # fixed: fine
    with pytest.raises(ValueError, match="accumulation = 'shared' under Accelerate / HF Trainer.*its share by "
                                         "measured speed.*fix: use .accumulation.: .fixed. with HF Trainer") as caught:
        _refuse_dynamic_under_accelerate({"config": ds_config(GAS, SHARED)})
    assert caught.value.refusal == "per_rank_phases_accelerate"


def test_drains_at_equal_micro_batch_counts_agree(tmp_path):
    """Dynamic mode's drain rule (evaluate and save every N micro-batches on every rank) with ranks at
    different phase positions: the drains agree, never raising DrainMismatchError though the ranks
    hold different counts; the phases around them are cut (their totals differ from M, as
    docs/ACCO.md says); drains right after a committing step() cut none (the tests above)."""
    import drain_workers

    case = {"optimizer": "adamw", "acco": dict(SHARED, comm_timeout_s=scaled(20)), "sleep": [0.0, 0.02]}
    r0, r1 = run_ranks(drain_workers.drain_run, case=case, total=60, drain_every=3, save_every=9,
                       save_dir=str(tmp_path), timeout=scaled(150))
    assert [p[:2] for p in r0["points"]] == [p[:2] for p in r1["points"]] and len(r0["points"]) == 20
    for (i, _, w0), (_, _, w1) in zip(r0["points"], r1["points"]):
        assert equal(w0, w1), f"committed weights differ at micro-batch {i}"
    assert equal(r0["final"], r1["final"]) and r0["global_steps"] == r1["global_steps"] > 5
    assert "drain" in r0["reasons"] + r1["reasons"]
    assert r0["warned"] == r1["warned"] == []  # no phase held open past a whole phase of all ranks


def test_a_loop_counting_micro_batches_per_rank_is_warned():
    """Both ranks run 24 micro-batches and drain once at the end, rank 1 >5x slower: rank 0 gets
    there at about step 8 and drains; rank 1, at ~8 micro-batches, holds its phase open for the
    other 16 (4 micro-batches per phase over both ranks). It trains, but that last step pools far
    more than stock's batch: rank 1 says so, naming the fix (loop on engine.global_steps)."""
    import drain_workers

    case = {"optimizer": "adamw", "acco": dict(SHARED, comm_timeout_s=scaled(20)), "sleep": [0.0, 0.02]}
    r0, r1 = run_ranks(drain_workers.drain_run, case=case, total=24, drain_every=24, timeout=scaled(100))
    assert r0["warned"] == [] and len(r1["warned"]) == 1, (r0["warned"], r1["warned"])
    assert "engine.global_steps" in r1["warned"][0] and "rank 1" in r1["warned"][0]
    assert equal(r0["final"], r1["final"])


# -- at equal shares: fixed mode per micro-batch, per round and per drain ----------------------------
# Both ranks sleep alike (the same compute), so the measured rates stay inside the share rule's band.
TRACE = {"gas": GAS, "steps": 6, "sleep": 0.05, "drain_every": 3}


@pytest.fixture(scope="module")
def traced():
    import shared_workers
    cases = [dict(TRACE, acco=dict(SHARED, accumulation="fixed")), dict(TRACE, acco=SHARED)]
    return run_ranks(shared_workers.trace_runs, cases=cases, timeout=scaled(200))  # [rank][fixed, shared]


def first_difference(a, b):
    """Where two traces part, for the message: (index, a's entry, b's entry)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    return min(len(a), len(b)), a[len(b):][:1], b[len(a):][:1]


def test_with_equal_shares_it_does_what_fixed_does_per_micro_batch_round_and_drain(traced):
    """The schedule's trace (tests/deepspeed/shared_workers.py: every collective, host read of a tensor value,
    lane submit and wait, device event, phase-end decision and phase end, on the thread that did it;
    the compute thread's cut at each micro-batch and drain, the lane's at each round) is fixed mode's,
    entry for entry: no extra collective (a drain probe), no extra host read (the counts table read
    before the reduce), no extra wait (for an estimate round at an evaluation), and the round in
    flight collected where fixed mode collects it (at the phase end, not at the decision)."""
    for rank, (fixed, shared) in enumerate(traced):
        assert all(s == (GAS // 2,) * 2 for s in shared["shares"]), f"timing noise moved the shares: {shared['shares']}"
        # the trace sees what it must: rounds with their collectives, and drains with each kind in flight
        rounds = [name for name, _ in fixed["lane"] if not name.startswith("before")]
        assert len(rounds) == 2 * TRACE["steps"] and all(
            any(kind == "collective" for kind, _ in entries) for name, entries in fixed["lane"] if name in rounds)
        drains = [entries for mark, entries in fixed["compute"] if mark.startswith("drained")]
        assert [] in drains and any(("lane wait", f"commit {k}") in d for d in drains for k in range(TRACE["steps"]))
        where = first_difference(fixed["compute"], shared["compute"])
        assert fixed["compute"] == shared["compute"], f"rank {rank}, compute thread, after mark {where}"
        where = first_difference(fixed["lane"], shared["lane"])
        assert fixed["lane"] == shared["lane"], f"rank {rank}, lane, round {where}"
        assert equal(fixed["final"], shared["final"])
