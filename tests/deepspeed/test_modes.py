"""A/B switch, synchronous debug mode, committed_weights, real asynchrony and memory, on 2 gloo ranks."""
import pytest
import torch

from dist import run_ranks
from fixtures import TinyNet, batch, make_optimizer, make_scheduler
from reference import reference_run
from timeouts import scaled
import workers

GAS, STEPS = 4, 4
ACCO = {"enabled": True, "mode": "acco"}
DPU = {"enabled": True, "mode": "dpu"}
BASE = {"optimizer": "adamw", "schedule": "inv", "gas": GAS, "steps": STEPS, "clip": 0.5}
# ds_acco.initialize runs, by name.
ACCO_CASES = {
    "disabled": dict(BASE, acco={"enabled": False, "mode": "acco"}),
    "absent": dict(BASE, acco=None),
    "acco": dict(BASE, acco=ACCO),
    "acco-sync": dict(BASE, acco=dict(ACCO, synchronous=True)),
    "dpu": dict(BASE, acco=DPU),
    "dpu-sync": dict(BASE, acco=dict(DPU, synchronous=True)),
    # committed_weights at: mid bootstrap, a phase end (E launched), mid phase E, an E→C swap, mid phase C,
    # a C→E swap, and the last micro-batch.
    "acco-probed": dict(BASE, acco=ACCO, probe_at=(0, 1, 2, 3, 4, 5, 8, 15)),
    "dpu-probed": dict(BASE, acco=DPU, probe_at=(1, 3, 5, 7, 10, 15)),
    # gated lanes (last: a failing gate must not disturb the other cases); the value is the gate
    # timeout: short, so a lane that never overlaps fails in seconds, not minutes
    "acco-gated": dict(BASE, acco=ACCO, gated=scaled(5)),
    "dpu-gated": dict(BASE, acco=DPU, gated=scaled(5)),
}


@pytest.fixture(scope="module")
def runs():
    names = list(ACCO_CASES)
    acco_runs = run_ranks(workers.train_cases, cases=[ACCO_CASES[n] for n in names])
    stock = run_ranks(workers.train_cases, cases=[dict(BASE, acco=None)], use_ds_acco=False)
    out = {n: acco_runs[0][i] for i, n in enumerate(names)}
    out["deepspeed"] = stock[0][0]
    return out


def assert_same(a, b):
    assert a["losses"] == b["losses"]
    for n in a["final"]:
        assert torch.equal(a["final"][n], b["final"][n]), n


@pytest.mark.parametrize("name", ["disabled", "absent"])
def test_disabled_is_stock_deepspeed_bit_for_bit(runs, name):
    assert runs[name]["optimizer"] == runs["deepspeed"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert_same(runs[name], runs["deepspeed"])
    assert runs[name]["global_steps"] == runs["deepspeed"]["global_steps"] == STEPS


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_synchronous_debug_mode_is_bit_identical(runs, mode):
    assert runs[mode]["optimizer"] == "AccoZeroOptimizer"
    assert_same(runs[mode], runs[f"{mode}-sync"])
    assert runs[mode]["losses"] != runs["deepspeed"]["losses"]  # it is not secretly stock ZeRO-1


def test_boundaries_report_phase_ends(runs):
    h = GAS // 2
    assert runs["acco"]["boundaries"] == [(i + 1) % h == 0 for i in range(GAS * STEPS)]
    assert runs["dpu"]["boundaries"] == [(i + 1) % GAS == 0 for i in range(GAS * STEPS)]
    assert runs["deepspeed"]["boundaries"] == [(i + 1) % GAS == 0 for i in range(GAS * STEPS)]


def test_lr_advances_once_per_commit(runs):
    # LambdaLR(1 / (1 + 0.5 s)) from 0.02, read after each micro-batch: it advances right after the
    # step() that launched a commit (every GAS micro-batches), where stock advances it -- not a phase
    # later, when the commit is collected (the rounds captured their learning rate at launch).
    lrs = runs["acco"]["lrs"]
    launched_after = [(i + 1) // GAS for i in range(GAS * STEPS)]
    assert lrs == pytest.approx([0.02 / (1 + 0.5 * c) for c in launched_after])


@pytest.mark.parametrize("mode,probes", [("acco", "acco-probed"), ("dpu", "dpu-probed")])
def test_committed_weights_is_theta_and_does_not_perturb(runs, mode, probes):
    run = runs[probes]
    assert_same(run, runs[mode])  # the trajectory is untouched by the probes
    seen_steps = set()
    for i, (k, theta) in run["probes"].items():
        want = reference_run(TinyNet(seed=0), batch, world=2, gas=GAS, steps=k, mode=mode,
                             make_optimizer=make_optimizer("adamw"), make_scheduler=make_scheduler("inv"), clip=0.5)
        err = max(float((theta[n].double() - want[n]).abs().max()) for n in want)
        assert err < 1e-5, f"probe after micro-batch {i}: committed weights are not θ_{k}"
        seen_steps.add(k)
    assert len(seen_steps) >= 3  # probes saw several distinct committed steps


@pytest.mark.parametrize("name", ["acco-gated", "dpu-gated"])
def test_compute_lane_runs_while_round_in_flight(runs, name):
    """Every round but the last is overlapped by at least one whole micro-batch that started after
    the round was submitted and ended before the round's gate opened (the round cannot end
    before that). The micro-batch whose backward/step submitted the round does not count, so a
    compute lane that waits for the round in flight at its next backward (or step, or forward)
    fails here, on the gate's short timeout."""
    run = runs[name]
    events = run["lane_log"]
    assert run["lane_error"] is None, (
        f"{name}: {run['lane_error']}\nlast events: {events[-12:]}")
    assert_same(run, runs[name.split("-")[0]])  # gating changes timing only
    rounds = sorted(e[1] for e in events if e[0] == "round submit")
    expected_rounds = STEPS * 2 if name.startswith("acco") else STEPS
    assert len(rounds) == expected_rounds
    at = {e: n for n, e in enumerate(events) if e[0] in ("mb start", "mb end", "round submit", "round end")}
    opened = {e[1]: (n, e[2]) for n, e in enumerate(events) if e[0] == "gate open"}
    last_start = max(n for e, n in at.items() if e[0] == "mb start")
    for k in rounds:
        submit, end = at[("round submit", k)], at[("round end", k)]
        gate_at, opener = opened[k]
        assert submit < gate_at < end
        if submit > last_start:  # submitted by the last micro-batch: nothing left to overlap it
            assert opener == "end of data" and k == rounds[-1], (k, opener)
            continue
        overlapped = [i for (kind, i), n in at.items()
                      if kind == "mb start" and n > submit and at[("mb end", i)] < gate_at]
        assert overlapped, (f"round {k}: no micro-batch started after its submit and finished before its gate "
                            f"opened: {events[submit:end + 1]}")
        assert opener == min(overlapped)  # opened by the first such micro-batch, while the round waited


def test_memory_one_extra_buffer_no_stock_buckets(runs):
    mem = runs["acco"]["memory"]
    assert mem["grad_hooks"] == 0 and mem["ipg_buffers"] == 0 and mem["averaged_gradients"] == 0
    assert mem["comm_bytes"] == mem["buffer_bytes"]  # exactly one full-size communication buffer
    assert mem["grads_are_views"]  # gradients accumulate in place, in the flat accumulator
