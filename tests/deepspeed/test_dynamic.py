"""Dynamic accumulation, weighting and per-step metrics, replayed through the float64 reference."""
import math

import pytest
import torch

from dist import run_ranks
from timeouts import scaled
from fixtures import TinyNet, TokenNet, batch, make_optimizer, make_scheduler, token_batch
from reference import reference_replay
import workers

STEPS, GAS = 4, 4
DYN = {"min_micro_batches": 1, "max_micro_batches": 6, "check_every": 1}
CASES = {
    # rank 1 sleeps in its loop: a slow worker
    "acco-dyn-sgd": {"optimizer": "sgd", "acco": {"enabled": True, "mode": "acco", "accumulation": "dynamic",
                                                 "dynamic": DYN}, "sleep": {"1": 0.03}},
    "acco-dyn-adamw": {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "sleep": {"1": 0.03},
                       "acco": {"enabled": True, "mode": "acco", "accumulation": "dynamic", "dynamic": DYN}},
    # the learning-rate rule: each round's LR × (its micro-batches / the fixed-mode count) ** p
    "acco-dyn-adamw-sqrt": {"optimizer": "adamw", "schedule": "inv", "sleep": {"1": 0.03},
                            "acco": {"enabled": True, "mode": "acco", "accumulation": "dynamic",
                                     "dynamic": dict(DYN, lr_scaling="sqrt")}},
    "dpu-dyn-sgd-linear": {"optimizer": "sgd", "sleep": {"0": 0.03},
                           "acco": {"enabled": True, "mode": "dpu", "accumulation": "dynamic",
                                    "dynamic": dict(DYN, lr_scaling="linear")}},
    "dpu-dyn-adamw": {"optimizer": "adamw", "sleep": {"1": 0.03},
                      "acco": {"enabled": True, "mode": "dpu", "accumulation": "dynamic", "dynamic": DYN}},
    "acco-token": {"optimizer": "adamw", "tokens": True,
                   "acco": {"enabled": True, "mode": "acco", "weighting": "token"}},
    "acco-dyn-token": {"optimizer": "sgd", "tokens": True, "sleep": {"0": 0.03},
                       "acco": {"enabled": True, "mode": "acco", "weighting": "token", "accumulation": "dynamic",
                                "dynamic": DYN}},
    # metrics: a lane whose rounds take 0.15 s; the loop either lets them finish first or not
    "hidden": {"optimizer": "sgd", "slow_lane": 0.15, "finish_rounds_first": True, "steps": 3,
               "acco": {"enabled": True, "mode": "acco", "metrics": {"log_every": 1, "estimate_drift_every": 1}}},
    "exposed": {"optimizer": "sgd", "slow_lane": 0.15, "steps": 3,
                "acco": {"enabled": True, "mode": "acco", "metrics": {"log_every": 1, "estimate_drift_every": 1}}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    monitor_dir = tmp_path_factory.mktemp("monitor")
    cases = []
    for name, c in CASES.items():
        c = dict({"steps": STEPS, "gas": GAS}, **c)
        if name == "hidden":
            c["extra"] = {"csv_monitor": {"enabled": True, "output_path": str(monitor_dir), "job_name": "acco"}}
        cases.append(c)
    results = run_ranks(workers.train_until_cases, cases=cases, timeout=scaled(200))
    out = {name: (results[0][i], results[1][i]) for i, name in enumerate(CASES)}
    out["monitor_dir"] = monitor_dir
    return out


def rel_error(got, want):
    num = sum(((got[n].double() - want[n]) ** 2).sum() for n in want)
    return float(torch.sqrt(num / sum((w ** 2).sum() for w in want.values())))


LR_POWER = {"sqrt": 0.5, "linear": 1.0}


@pytest.mark.parametrize("name", ["acco-dyn-sgd", "acco-dyn-adamw", "dpu-dyn-adamw", "acco-token", "acco-dyn-token",
                                  "acco-dyn-adamw-sqrt", "dpu-dyn-sgd-linear"])
def test_replay_with_recorded_counts(runs, name):
    r0, r1 = runs[name]
    case = CASES[name]
    mode = case["acco"]["mode"]
    counts = [[p["micro_batches"] for p in r["phases"]] for r in (r0, r1)]
    tokens = case.get("tokens", False)
    want = reference_replay(TokenNet(seed=0) if tokens else TinyNet(seed=0), token_batch if tokens else batch,
                            phases_per_rank=counts, steps=r0["global_steps"], mode=mode,
                            make_optimizer=make_optimizer(case["optimizer"]),
                            make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0),
                            weight=(lambda b: float(b[2].sum())) if tokens else None,
                            lr_power=LR_POWER.get(case["acco"].get("dynamic", {}).get("lr_scaling"), 0.0),
                            nominal_phase=GAS // 2 if mode == "acco" else GAS)
    err = rel_error(r0["final"], want)
    print(f"{name}: per-rank phase micro-batches {counts}; relative error {err:.2e}")
    assert err < 1e-5
    if name in ("acco-dyn-adamw-sqrt", "dpu-dyn-sgd-linear"):
        # the rule moved the weights: without it the replay is far from the run
        plain = reference_replay(TinyNet(seed=0), batch, phases_per_rank=counts, steps=r0["global_steps"], mode=mode,
                                 make_optimizer=make_optimizer(case["optimizer"]),
                                 make_scheduler=make_scheduler(case.get("schedule")))
        assert rel_error(r0["final"], plain) > 100 * max(err, 1e-7)
        factors = [rec.get("lr_factor", 1.0) for rec in r0["metrics"]]
        assert any(f != 1.0 for f in factors), factors
    assert all(torch.equal(r0["final"][n], r1["final"][n]) for n in want)
    # the loop stops at STEPS commits; the final drain of DPU's round in flight commits one more
    assert r0["global_steps"] == (STEPS if mode == "acco" else STEPS + 1)


@pytest.mark.parametrize("name", ["acco-dyn-sgd", "acco-dyn-adamw", "dpu-dyn-adamw"])
def test_fast_rank_contributes_more_and_waits_only_at_the_maximum(runs, name):
    fast, slow = runs[name]
    n_fast = sum(p["micro_batches"] for p in fast["phases"])
    n_slow = sum(p["micro_batches"] for p in slow["phases"])
    assert n_fast > n_slow, (n_fast, n_slow)
    assert len(fast["phases"]) == len(slow["phases"])  # same rounds on every rank
    for p in fast["phases"]:
        # 'round_done': the phase ended because its round had finished (the lane's done() said so),
        # so collecting it was no network wait. Not asserted as a time: a busy machine stretches any
        # wait (the old bound of 20 ms failed beside a CPU hog).
        assert p["reason"] in ("round_done", "max")
        assert p["micro_batches"] <= fast["max_micro_batches"]
    # per-rank counts per step in the metrics agree with the phases actually run
    for rec in fast["metrics"]:
        assert rec["micro_batches_global"] == sum(rec["micro_batches_per_rank"])


def test_dynamic_ranks_really_differ(runs):
    fast, slow = runs["acco-dyn-sgd"]
    assert {p["micro_batches"] for p in fast["phases"]} != {p["micro_batches"] for p in slow["phases"]}


def test_token_weighting_counts_tokens(runs):
    r0, r1 = runs["acco-token"]
    rec = r0["metrics"][-1]
    assert rec["weight_global"] == sum(p["weight"] for r in (r0, r1) for p in r["phases"]
                                       if p["data_step"] == STEPS - 1)
    assert rec["micro_batches_global"] == 2 * GAS


def test_metrics_exposed_vs_hidden_communication(runs):
    hidden = runs["hidden"][0]["metrics"]
    exposed = runs["exposed"][0]["metrics"]
    assert len(hidden) == len(exposed) == 3
    for rec in hidden:
        assert rec["comm_s"] >= 0.3  # two rounds of >= 0.15 s
        assert rec["overlap"] > 0.9 and rec["exposed_comm_s"] < 0.05 * rec["comm_s"] + 0.01
        assert math.isfinite(rec["grad_norm"])
    # measured in each commit, read with the next round's host read: from the second record on
    assert all(0 <= rec["prev_step_estimate_drift"] < 10 for rec in hidden[1:])
    assert "prev_step_estimate_drift" not in hidden[0]
    for rec in exposed:
        assert rec["exposed_comm_s"] > 0.2 and rec["overlap"] < 0.5
    later = hidden[1:]
    assert all(len(r["prev_step_exposed_comm_s_per_rank"]) == 2 for r in later)


def test_metrics_reach_deepspeed_monitor(runs):
    files = [p.name for p in runs["monitor_dir"].rglob("*") if p.is_file()]
    assert any("overlap" in f for f in files), files
    assert any("estimate_drift" in f for f in files), files
