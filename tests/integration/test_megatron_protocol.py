"""Megatron-DeepSpeed drives an ACCO engine unmodified (see tests/integration/megatron_workers.py for the calls).

The caller sets the accumulation boundary itself and calls ``step(lr_kwargs)`` once per A
micro-batches: ACCO counts micro-batches in ``backward`` and must give exactly the schedule of the
per-micro-batch ``step()`` loop (bit-identical committed weights), match the float64 reference,
answer ``was_step_applied()`` as Megatron needs it, and evaluate on committed weights.
"""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer
from reference import reference_run, rel_distance
from timeouts import scaled
import megatron_workers
from megatron_workers import INCREMENT, make_increment_lr

GAS, ITERS = 4, 4
NAN = {"acco": [(1, 6)], "dpu": [(0, 5)]}  # step 1's data: its commit is skipped (see test_nonfinite.py)
CASES = {}
for mode in ("acco", "dpu"):
    for protocol in ("megatron", "per_mb"):
        CASES[(mode, protocol, False)] = {"mode": mode, "gas": GAS, "iters": ITERS, "protocol": protocol,
                                          "evaluate": protocol == "megatron" and mode == "acco"}
        CASES[(mode, protocol, True)] = {"mode": mode, "gas": GAS, "iters": ITERS, "protocol": protocol,
                                         "nan_at": NAN[mode]}
CASES[("stock", "megatron", False)] = {"mode": "stock", "gas": GAS, "iters": ITERS, "protocol": "megatron"}
WARMUP = 2  # acco.sync_warmup_steps: iterations 0 and 1 are stock's steps, then ACCO
for protocol in ("megatron", "per_mb"):
    for nan in (False, True):  # True: the first warm-up step is skipped (a NaN in its micro-batch 1)
        CASES[("acco", protocol, f"warmup{'-nan' if nan else ''}")] = {
            "mode": "acco", "gas": GAS, "iters": ITERS, "protocol": protocol,
            "acco_extra": {"sync_warmup_steps": WARMUP}, "nan_at": [(1, 1)] if nan else []}
for mode in ("acco", "dpu"):  # Megatron's own scheduler, whose load_state_dict() does not restore a live one
    CASES[(mode, "megatron", "megatron-like")] = {"mode": mode, "gas": GAS, "iters": ITERS, "protocol": "megatron",
                                                  "nan_at": NAN[mode], "scheduler": "megatron-like"}


@pytest.fixture(scope="module")
def runs():
    keys = list(CASES)
    out = run_ranks(megatron_workers.megatron_cases, cases=[CASES[k] for k in keys], timeout=scaled(80))
    return [{k: per_rank[i] for i, k in enumerate(keys)} for per_rank in out]


@pytest.mark.parametrize("mode", ["acco", "dpu"])
@pytest.mark.parametrize("nan", [False, True])
def test_megatron_sequence_equals_per_micro_batch_loop(runs, mode, nan):
    for rank_runs in runs:
        meg, per = rank_runs[(mode, "megatron", nan)], rank_runs[(mode, "per_mb", nan)]
        for n in per["final"]:
            assert torch.equal(meg["final"][n], per["final"][n]), n
        assert meg["global_steps"] == per["global_steps"]
        assert meg["skipped_steps"] == per["skipped_steps"]
        assert meg["lrs"] == per["lrs"]
        assert (meg["sched_calls"], meg["sched_consumed"]) == (per["sched_calls"], per["sched_consumed"])


@pytest.mark.parametrize("mode", ["acco", "dpu"])
@pytest.mark.parametrize("nan", [False, True])
def test_megatron_matches_reference(runs, mode, nan):
    run = runs[0][(mode, "megatron", nan)]
    skip = (1,) if nan else ()
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=ITERS, mode=mode,
                         make_optimizer=make_optimizer("adamw"), make_scheduler=make_increment_lr,
                         skip_commit=skip)
    for n, w in want.items():
        got = run["final"][n].double()
        assert float((got - w).abs().max()) <= 1e-5 * max(1.0, float(w.abs().max())), n


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_was_step_applied_and_counters(runs, mode):
    for rank_runs in runs:
        run = rank_runs[(mode, "megatron", False)]
        assert run["applied"] == [True] * ITERS  # bootstrap iterations included: no false skips
        # commits collected so far (the last one is collected by the final drain)
        assert run["global_steps"] == [0, 1, 2, 3]
        assert run["sched_calls"] == ITERS and run["sched_consumed"] == ITERS * INCREMENT
        bad = rank_runs[(mode, "megatron", True)]
        newly_skipped = [i for i in range(ITERS) if bad["skipped_steps"][i] > (bad["skipped_steps"][i - 1] if i else 0)]
        assert len(newly_skipped) == 1 and bad["skipped_steps"][-1] == 1
        # False in exactly the iteration whose collected commit was skipped
        assert bad["applied"] == [i not in newly_skipped for i in range(ITERS)]
        assert bad["sched_calls"] == ITERS - 1  # no LR advance for the skipped commit


def test_evaluate_runs_on_committed_weights(runs):
    for rank_runs in runs:
        evals = rank_runs[("acco", "megatron", False)]["evals"]
        for e in evals:
            assert all(s == e["committed"] for s in e["seen"])
            assert e["live_after"] == e["live"]  # train() put the live (estimate) weights back
        # once estimates exist the live weights differ from the committed ones
        assert any(e["live"] != e["committed"] for e in evals)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_lr_megatron_logs_after_step_is_stocks(runs, mode):
    """Megatron logs ``optimizer.param_groups[0]['lr']`` right after ``step()``: ACCO steps the
    scheduler where stock does (when the commit is launched), not a phase later when it is
    collected, so every iteration reads stock's value (iteration 1 included: not the initial one)."""
    for rank_runs in runs:
        stock = rank_runs[("stock", "megatron", False)]["logged_lrs"]
        assert len(set(stock)) == ITERS  # the schedule moves every iteration: a lag would show
        assert rank_runs[(mode, "megatron", False)]["logged_lrs"] == stock
        assert rank_runs[(mode, "per_mb", False)]["logged_lrs"] == stock


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_megatrons_scheduler_is_undone_by_its_inverse_step(runs, mode):
    """Megatron's OptimizerParamScheduler re-applies a loaded step count on top of its current one,
    so a skipped commit's step is undone by step(increment=-n): every applied commit uses the lr and
    weight decay of a fresh scheduler stepped once per applied iteration (stock's rule), and what
    Megatron logs after step() is that too, but in the iteration whose commit is still in flight."""
    from schedulers import MegatronLikeScheduler, settings
    ref_opt = make_optimizer("adamw")(TinyNet(seed=0))
    ref = MegatronLikeScheduler(ref_opt)
    want, logged = [], []
    for t in range(ITERS):
        if t != 1:  # iteration 1's commit is skipped
            want.append(settings(ref_opt))
            ref.step(increment=INCREMENT)
        logged.append(settings(ref_opt))
    for rank_runs in runs:
        run = rank_runs[(mode, "megatron", "megatron-like")]
        commits = [u for u in run["used"] if u["kind"] == "commit"]
        assert [c["step"] for c in commits if c["skipped"]] == [1]
        assert [c["settings"] for c in commits if not c["skipped"]] == want
        assert run["sched_state"] == ref.state_dict()
        assert [i for i in range(ITERS) if run["logged"][i] != logged[i]] == [1]


@pytest.mark.parametrize("nan", [False, True])
def test_sync_warmup_under_megatrons_protocol(runs, nan):
    """acco.sync_warmup_steps under Megatron's calls: the same run as the per-micro-batch loop, the
    float64 reference's warm-up, each warm-up iteration's commit booked in that iteration (stock's
    global_steps and was_step_applied()), the LR logged after step() stock's, and a skipped warm-up
    step (non-finite gradient) neither applied nor followed by a scheduler step, as in stock."""
    key = "warmup-nan" if nan else "warmup"
    for rank_runs in runs:
        meg, per = rank_runs[("acco", "megatron", key)], rank_runs[("acco", "per_mb", key)]
        for n in per["final"]:
            assert torch.equal(meg["final"][n], per["final"][n]), n
        assert (meg["global_steps"], meg["skipped_steps"], meg["lrs"]) == (per["global_steps"], per["skipped_steps"],
                                                                           per["lrs"])
        # warm-up iterations commit inside their step(); ACCO's first commit is booked an iteration later
        assert meg["global_steps"] == [1, 2, 2, 3]
        if not nan:
            assert meg["applied"] == [True] * ITERS and meg["skipped_steps"] == [0] * ITERS
            assert meg["logged_lrs"] == rank_runs[("stock", "megatron", False)]["logged_lrs"]
            assert meg["sched_calls"] == ITERS
        else:
            assert meg["applied"] == [False, True, True, True] and meg["skipped_steps"] == [1] * ITERS
            assert meg["sched_calls"] == ITERS - 1 == per["sched_calls"]
    want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=ITERS, mode="acco",
                         make_optimizer=make_optimizer("adamw"), make_scheduler=make_increment_lr,
                         sync_warmup_steps=WARMUP, skip_commit=(0,) if nan else ())
    paper = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=ITERS, mode="acco",
                          make_optimizer=make_optimizer("adamw"), make_scheduler=make_increment_lr,
                          skip_commit=(0,) if nan else ())
    got = runs[0][("acco", "megatron", key)]["final"]
    assert rel_distance(got, want) < 1e-5 < 100 * 1e-5 < rel_distance(paper, want)


def test_dynamic_refused_at_initialize_under_megatron():
    """Dynamic phases with Megatron's scheduler (step(increment=...)) or its mpu: refused before any
    engine exists, naming the fix."""
    import ds_acco
    from fixtures import ds_config
    from megatron_workers import IncrementLR

    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    with pytest.raises(ValueError, match="accumulation.*dynamic.*fix: use .accumulation.: .fixed."):
        ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=IncrementLR(opt),
                           config=ds_config(GAS, {"enabled": True, "accumulation": "dynamic"}),
                           dist_init_required=False)
