"""One answer on every caller protocol: a real ``accelerate.Accelerator`` (DeepSpeed plugin) and a
real ``transformers.Trainer`` drive ACCO, and asynchronous == synchronous == the float64 reference
of ACCO.md, bit-identical run to run (and across a Trainer resume).

Both callers step their own LR scheduler on the compute thread right after each optimizer step
(Accelerate's ``AcceleratedScheduler``), while ACCO's commit of that step is still in flight on
the lane. A round must use the learning rate of its own step (ACCO.md): the one in place when it
was launched, not when it happens to run. The gated Accelerate run holds every round until the
compute lane has finished a later micro-batch, so it runs after the caller's scheduler step: the
worst timing, deterministically (tests/integration/hf_workers.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer
from reference import nearest_own_reference, reference_run, rel_distance
from timeouts import scaled

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
import hf_workers  # noqa: E402

GAS, STEPS = 4, 4
ACC_CASES = {
    "stock": {"acco": None},
    "sync": {"acco": {"synchronous": True}},
    "async": {"acco": {}},
    "async-again": {"acco": {}},
    "async-gated": {"acco": {}, "gated": True},
    "dpu-gated": {"acco": {}, "mode": "dpu", "gated": True},
    "dynamic": {"acco": {"accumulation": "dynamic"}, "expect_error": True},
}


@pytest.fixture(scope="module")
def accelerate_runs():
    keys = list(ACC_CASES)
    cases = [{"gas": GAS, "steps": STEPS, **ACC_CASES[k]} for k in keys]
    out = run_ranks(hf_workers.accelerate_cases, cases=cases, timeout=scaled(150))
    return [dict(zip(keys, per_rank)) for per_rank in out]


def _acc_reference(mode, per_step):
    """``per_step``: scheduler steps per optimizer step -- Accelerate's ``AcceleratedScheduler``
    steps a scheduler once per process (``num_processes`` times) per optimizer step."""
    return reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=STEPS, mode=mode,
                         make_optimizer=make_optimizer("adamw"),
                         make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                             opt, lambda s: 1.0 / (1.0 + hf_workers.LR_LAMBDA_DECAY * per_step * s)))


def _equal(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_accelerate_stock_matches_reference(accelerate_runs):
    """The harness itself: stock ZeRO-1 under this loop is the reference's 'sync' (the caller's
    scheduler steps once per optimizer step, the data is what each rank fed)."""
    run = accelerate_runs[0]["stock"]
    assert run["engine"] == "DeepSpeedEngine" and run["num_processes"] == 2
    refs = {m: _acc_reference(m, run["num_processes"]) for m in ("sync", "acco", "dpu")}
    dist = nearest_own_reference(run["final"], refs, "sync", margin=0.01, label="accelerate stock")
    assert dist["sync"] < 1e-5, dist


@pytest.mark.parametrize("name,mode", [("sync", "acco"), ("async", "acco"), ("async-gated", "acco"),
                                       ("dpu-gated", "dpu")])
def test_accelerate_acco_matches_reference(accelerate_runs, name, mode):
    for rank_runs in accelerate_runs:
        run = rank_runs[name]
        assert run["engine"] == "AccoEngine"
        refs = {m: _acc_reference(m, run["num_processes"]) for m in ("sync", "acco", "dpu")}
        # The nearest wrong answers (stock, DPU, a commit at the next step's rate) are >= 1e-3 away.
        dist = nearest_own_reference(run["final"], refs, mode, margin=0.01, label=f"accelerate {name}")
        assert dist[mode] < 1e-5, dist


def test_accelerate_async_equals_sync_bit_for_bit(accelerate_runs):
    for rank_runs in accelerate_runs:
        sync = rank_runs["sync"]
        for name in ("async", "async-again", "async-gated"):
            assert _equal(rank_runs[name]["final"], sync["final"]), name
            assert rank_runs[name]["losses"] == sync["losses"], name
    # ... and the two ranks agree
    assert _equal(accelerate_runs[0]["async"]["final"], accelerate_runs[1]["async"]["final"])


def test_accelerate_lr_read_after_each_step_is_stocks(accelerate_runs):
    for rank_runs in accelerate_runs:
        assert rank_runs["async"]["lrs"] == rank_runs["stock"]["lrs"]


def test_accelerate_no_scheduler_order_warning(accelerate_runs):
    """torch warns "lr_scheduler.step() before optimizer.step()" when the optimizer's step() was
    never called before the scheduler's first step: stock calls it; ACCO's functional commit never
    does, and runs after the caller's scheduler step -- ACCO records the step at the commit's launch."""
    for rank_runs in accelerate_runs:
        for name in ("stock", "sync", "async", "dpu-gated"):
            assert rank_runs[name]["order_warnings"] == [], name


def test_accelerate_refuses_dynamic_at_prepare(accelerate_runs):
    """Refused inside deepspeed.initialize (the router), before an engine or its banner exists --
    not at the first backward."""
    for rank_runs in accelerate_runs:
        run = rank_runs["dynamic"]
        assert run["error"] and "'dynamic' under Accelerate / HF Trainer" in run["error"] and "fix:" in run["error"]
        assert run["acco_optimizers_built"] == 0


# -- HF Trainer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    cases = {
        "stock": {"acco": None},
        "sync": {"acco": {"synchronous": True}},
        "async": {"acco": {}, "save_steps": 2},
        "async-again": {"acco": {}},
        "async-resumed": {"acco": {}, "resume": str(root / "async" / "checkpoint-2")},
    }
    keys = list(cases)
    spec = [{"gas": GAS, "steps": STEPS, "out_dir": str(root / k), **cases[k]} for k in keys]
    out = run_ranks(hf_workers.trainer_cases, cases=spec, timeout=scaled(300))
    return [dict(zip(keys, per_rank)) for per_rank in out]


class _LossOf(torch.nn.Module):
    """The Trainer's model as the reference calls it: ``forward(token rows) -> mean LM loss``."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        ids = ids.long()  # the reference casts batches to float64
        return self.m(input_ids=ids, labels=ids).loss


def _trainer_reference(mode, seen):
    model = _LossOf(hf_workers.build_model())
    ref = reference_run(model, lambda r, i: (seen[r][i],), world=2, gas=GAS, steps=STEPS, mode=mode,
                        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.99),
                                                                   eps=1e-8, weight_decay=0.0),
                        make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                            opt, lambda s: max(0.0, (STEPS - s) / STEPS)))
    return {n[len("m."):]: v for n, v in ref.items()}


@pytest.mark.slow  # five Trainer runs (~25 s); the Accelerate cases above stay in the quick loop
def test_trainer_matches_reference(trainer_runs):
    seen = [trainer_runs[r]["stock"]["seen"] for r in range(2)]
    assert len(seen[0]) == GAS * STEPS
    assert not torch.equal(seen[0][0], seen[1][0])  # each rank its own data
    for name in ("sync", "async", "async-again"):  # the same data as stock, micro-batch by micro-batch
        for r in range(2):
            assert all(torch.equal(a, b) for a, b in zip(trainer_runs[r][name]["seen"], seen[r])), name
    refs = {m: _trainer_reference(m, seen) for m in ("sync", "acco", "dpu")}
    stock = nearest_own_reference(trainer_runs[0]["stock"]["final"], refs, "sync", margin=0.05,
                                  label="trainer stock")
    assert stock["sync"] < 5e-5, stock  # fp32 against fp64: ~1e-5; the nearest wrong schedule ~1e-2
    for name in ("sync", "async"):
        dist = nearest_own_reference(trainer_runs[0][name]["final"], refs, "acco", margin=0.05,
                                     label=f"trainer {name}")
        assert dist["acco"] < 5e-5, dist


@pytest.mark.slow
def test_trainer_async_equals_sync_and_is_reproducible(trainer_runs):
    for rank_runs in trainer_runs:
        sync = rank_runs["sync"]["final"]
        assert _equal(rank_runs["async"]["final"], sync)
        assert _equal(rank_runs["async-again"]["final"], sync)
        assert rank_runs["async"]["losses"] == rank_runs["sync"]["losses"] == rank_runs["async-again"]["losses"]
        assert rank_runs["async"]["lrs"] == rank_runs["stock"]["lrs"]


@pytest.mark.slow
def test_trainer_logs_each_steps_own_grad_norm(trainer_runs):
    """The Trainer reads ``grad_norm`` right after the ``step()`` that launched the step's commit;
    on the steps it logs, ACCO first waits for that commit, so the logged norm is the step's own,
    as stock logs it -- not the previous step's, and not None at step 1 (no commit collected yet).
    Step 1's gradient is stock's own (both halves computed at θ_0): its norm equals stock's to
    float32 precision."""
    for rank_runs in trainer_runs:
        stock = rank_runs["stock"]
        assert len(stock["grad_norms"]) == STEPS and None not in stock["grad_norms"]
        for name in ("sync", "async", "async-again"):
            run = rank_runs[name]
            assert run["grad_norms"] == run["commit_grad_norms"], name  # each step its own commit's
            assert run["grad_norms"][0] == pytest.approx(stock["grad_norms"][0], rel=1e-5, abs=0), name
            assert run["grad_norms"][1] != pytest.approx(run["grad_norms"][0], rel=1e-3)  # the steps differ


@pytest.mark.slow
def test_trainer_resume_is_bit_identical(trainer_runs):
    for rank_runs in trainer_runs:
        resumed, whole = rank_runs["async-resumed"], rank_runs["async"]
        assert resumed["global_step"] == whole["global_step"] == STEPS
        assert _equal(resumed["final"], whole["final"])
        # log_history comes back from the checkpoint: the whole list must match, steps 3-4 included
        assert resumed["losses"] == whole["losses"]
        # each logged step's own norm, the first step after the resume included
        assert resumed["grad_norms"] == whole["grad_norms"], (resumed["grad_norms"], whole["grad_norms"])
    assert rel_distance(trainer_runs[0]["async"]["final"], trainer_runs[0]["stock"]["final"]) > 1e-4
