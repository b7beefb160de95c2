"""Every per-step figure DeepSpeed emits on an ACCO engine is stock's for the same run of optimizer steps.

DeepSpeed's ``step()`` emits, once per optimizer step: the throughput timer's global step (and its
samples/sec line, logged every ``steps_per_print`` steps), the monitor's ``Train/Samples/lr`` (and
``Train/Samples/loss_scale`` with fp16), the ``step=..., skipped=..., lr=...`` progress line and,
with ``wall_clock_breakdown``, the global timers' line and the ``Train/Samples/elapsed_time_ms_*``
events. ACCO ends a phase twice per optimizer step; each figure must still count optimizer steps.
Stock and ACCO engines run the same config (csv_monitor on, ``steps_per_print`` 1) for the same
number of optimizer steps, under both ways of calling ``step()`` (after every backward; once per A
micro-batches with the caller setting the boundary, Megatron's), with fp16 and a skipped step
(a NaN in one rank's micro-batch), and are compared after ``destroy()``:

* the throughput timer's counters after every ``step()`` (global and micro step counts, the batch
  size its samples/sec is computed from) and every line it logged (its samples/sec values are wall
  time, so each line is compared up to them);
* every monitor event DeepSpeed writes: the same names, and for each the same x axis (global
  samples), the same count and, for the learning rate and the loss scale, the same values (the
  timings' values are wall time);
* the progress lines and the wall-clock timer lines (which timers each logs), in order, except the
  ZeRO optimizer's own ``optimizer_*`` timers line: ACCO's optimizer step runs in its rounds.

The user's own events written through ``engine.monitor`` (after every micro-batch, its own x axis)
reach the monitor at once and unchanged, as under stock, in every phase: only DeepSpeed's own
per-step events wait for their commit's booking.
"""
import pytest

from dist import run_ranks
from timeouts import scaled
import step_figures_workers

GAS, STEPS = 4, 5
NAN_AT = [(1, 6)]  # step 1, second half: stock's step 1 overflows, ACCO's commit 1 is skipped
RUNS = {}
for protocol in ("per_mb", "megatron"):
    for mode in ("stock", "acco", "dpu"):
        RUNS[(mode, protocol, "fp32")] = {"mode": mode, "protocol": protocol, "wall_clock": True}
        RUNS[(mode, protocol, "fp16-skip")] = {"mode": mode, "protocol": protocol, "fp16": True, "nan_at": NAN_AT}
TIMED = "Train/Samples/elapsed_time_ms_"  # values are wall time
OPTIMIZER_TIMERS = ("optimizer_allgather", "optimizer_gradients", "optimizer_step")  # stock's ZeRO step only


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    keys = list(RUNS)
    cases = [dict(RUNS[k], name="-".join(k), gas=GAS, steps=STEPS) for k in keys]
    out = run_ranks(step_figures_workers.step_figures_cases, cases=cases,
                    monitor_dir=str(tmp_path_factory.mktemp("monitor")), timeout=scaled(120))
    return [{k: per_rank[i] for i, k in enumerate(keys)} for per_rank in out]


@pytest.mark.parametrize("precision", ["fp32", "fp16-skip"])
@pytest.mark.parametrize("protocol", ["per_mb", "megatron"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_throughput_timer_counts_optimizer_steps(runs, mode, protocol, precision):
    for rank_runs in runs:
        stock, acco = rank_runs[("stock", protocol, precision)], rank_runs[(mode, protocol, precision)]
        assert stock["timer"][-1]["global_step_count"] == STEPS  # the harness: stock counts its steps
        assert acco["timer"] == stock["timer"]  # after every step(): global and micro steps, batch size
        assert acco["lines"]["tput"] == stock["lines"]["tput"]  # epoch / micro_step / global_step of each line
        assert (acco["global_steps"], acco["skipped_steps"], acco["global_samples"], acco["micro_steps"]) == (
            stock["global_steps"], stock["skipped_steps"], stock["global_samples"], stock["micro_steps"])
    if precision == "fp16-skip":
        assert runs[0][("stock", protocol, precision)]["skipped_steps"] == 1


@pytest.mark.parametrize("precision", ["fp32", "fp16-skip"])
@pytest.mark.parametrize("protocol", ["per_mb", "megatron"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_monitor_events_are_stocks(runs, mode, protocol, precision):
    stock, acco = runs[0][("stock", protocol, precision)]["events"], runs[0][(mode, protocol, precision)]["events"]
    want = {"Train/Samples/lr"} | ({"Train/Samples/loss_scale"} if precision == "fp16-skip" else
                                   {TIMED + t for t in ("forward", "backward", "backward_inner", "backward_allreduce",
                                                        "step")})
    assert set(stock) == {n.replace("/", "_") for n in want}  # the harness: the events stock writes
    assert set(acco) == set(stock)  # ACCO's own (ACCO/...) are off in these runs: metrics.monitor = false
    for name, series in stock.items():
        got = acco[name]
        assert [x for x, _ in got] == [x for x, _ in series] == [32 * (t + 1) for t in range(STEPS)], name
        if not name.startswith(TIMED.replace("/", "_")):
            assert got == series, name  # learning rate, loss scale: the values too
    lrs = [v for _, v in stock["Train_Samples_lr"]]
    assert len(set(lrs)) == (STEPS - 1 if precision == "fp16-skip" else STEPS)  # the schedule moves: a lag would show


@pytest.mark.parametrize("protocol", ["per_mb", "megatron"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_progress_and_wall_clock_lines_are_stocks(runs, mode, protocol):
    for precision in ("fp32", "fp16-skip"):
        stock, acco = runs[0][("stock", protocol, precision)], runs[0][(mode, protocol, precision)]
        assert len(stock["lines"]["progress"]) == STEPS
        assert acco["lines"]["progress"] == stock["lines"]["progress"]  # step=, skipped=, lr=, mom=
        engine_timers = [t for t in stock["lines"]["timers"] if t != OPTIMIZER_TIMERS]
        assert acco["lines"]["timers"] == engine_timers


@pytest.mark.parametrize("protocol", ["per_mb", "megatron"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_user_events_pass_through_unchanged_and_at_once(runs, mode, protocol):
    for precision in ("fp32", "fp16-skip"):
        stock, acco = runs[0][("stock", protocol, precision)], runs[0][(mode, protocol, precision)]
        want = [(i, str(10 * i)) for i in range(GAS * STEPS)]
        assert stock["user_events"] == want  # the harness: stock writes the user's events as given
        assert acco["user_events"] == want  # the user's x axis and values, none collapsed, in order
        assert [rows for _, rows in acco["user_writes"]] == list(range(1, GAS * STEPS + 1))  # each at once
        # the harness: written with a commit in flight (acco's COMMIT phases, dpu's after the first) and without
        assert {flight for flight, _ in acco["user_writes"]} == {True, False}
