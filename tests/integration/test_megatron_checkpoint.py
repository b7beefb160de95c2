"""A checkpoint loaded under Megatron's protocol between the ``backward()`` that launched a commit and its ``step()``.

Megatron-DeepSpeed sets the accumulation boundary itself and calls ``step(lr_kwargs)`` once per A
micro-batches (tests/integration/megatron_workers.py). ACCO launches an iteration's commit inside its
last ``backward()`` and owes the LR scheduler step for it until the caller's ``step()``, where stock
takes it. A ``load_checkpoint()`` in between replaces the scheduler and the optimizer's param groups:
the owed step must then be taken once, by that ``step()``, on the loaded scheduler -- not inside the
load (where the loaded param groups overwrite the learning rate it set, leaving the scheduler a step
ahead of the rate that the next optimizer step uses), and not before it (lost with the old scheduler).

Stock and ACCO (modes acco and dpu) run the same sequence -- save after iteration 0's ``step()``,
load in iteration 3 between its last ``backward()`` and its ``step()`` -- with a torch scheduler and
Megatron's own (whose ``load_state_dict()`` adds the loaded count to the current one), and must agree on
the learning rate and every param-group setting read after every ``step()``, the scheduler's state,
and the learning rate each optimizer step after the load used.
"""
import pytest

from dist import run_ranks
from timeouts import scaled
import megatron_workers

GAS, ITERS, SAVE_AT, LOAD_AT = 4, 7, 0, 3
RUNS = {(mode, sched): {"mode": mode, "scheduler": sched}
        for sched in ("increment", "megatron-like") for mode in ("stock", "acco", "dpu")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    keys = list(RUNS)
    cases = [dict(RUNS[k], name="-".join(k), gas=GAS, iters=ITERS, save_at=SAVE_AT, load_at=LOAD_AT) for k in keys]
    out = run_ranks(megatron_workers.megatron_load_cases, cases=cases, save_dir=str(tmp_path_factory.mktemp("ckpt")),
                    timeout=scaled(120))
    return [{k: per_rank[i] for i, k in enumerate(keys)} for per_rank in out]


@pytest.mark.parametrize("sched", ["increment", "megatron-like"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_lr_after_a_load_between_backward_and_step_is_stocks(runs, mode, sched):
    for rank_runs in runs:
        stock, acco = rank_runs[("stock", sched)], rank_runs[(mode, sched)]
        lrs = [s["lr"] for s in stock["after_step"]]
        assert lrs[LOAD_AT] != lrs[LOAD_AT - 1] and lrs[LOAD_AT] != lrs[SAVE_AT]  # the load and its step show
        for it, (want, got) in enumerate(zip(stock["after_step"], acco["after_step"])):
            assert got == want, it  # lr, every param-group setting, the scheduler's state, was_step_applied
        later = slice(LOAD_AT + 1, ITERS)  # the load iteration's commit was launched before the load
        assert acco["step_lrs"][later] == stock["step_lrs"][later]
        assert None not in stock["step_lrs"][later]
