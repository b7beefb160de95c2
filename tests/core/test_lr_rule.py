"""Dynamic accumulation's learning-rate rule: the factor a round applies, and how it is undone
(the end-to-end schedule is replayed against the reference in tests/deepspeed/test_dynamic.py)."""
import pytest
import torch

from ds_acco.core.rounds import RoundContext, RoundKind, _scaled_lr


def _ctx(power):
    return RoundContext(groups=[], shard_optimizer=None, process_group=None, rank=0, world=2, gas_scale=0.25,
                        clip_grad=0.0, nonfinite="skip", reduce_scatter=False, track_drift=False, chunk_elems=1024,
                        lr_power=power, nominal_phase_micro_batches=4, commit_phases=2)


def test_factor_compares_each_round_with_what_fixed_accumulation_gives_it():
    sqrt, linear = _ctx(0.5), _ctx(1.0)
    assert linear.lr_factor(RoundKind.ESTIMATE, 4) == 1.0  # one phase of 2 ranks x 2
    assert linear.lr_factor(RoundKind.COMMIT, 8) == 1.0  # a commit sums both phases
    assert linear.lr_factor(RoundKind.COMMIT, 24) == 3.0
    assert sqrt.lr_factor(RoundKind.ESTIMATE, 16) == 2.0
    assert _ctx(0.0).lr_factor(RoundKind.COMMIT, 24) == 1.0


def test_scaled_lr_is_undone_exactly_and_leaves_a_concurrent_schedulers_value():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [], "lr": 0.3}])
    with _scaled_lr(opt, 3.0):
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.3), pytest.approx(0.9)]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]  # exactly the saved values
    with _scaled_lr(opt, 3.0):
        opt.param_groups[0]["lr"] = 0.05  # e.g. Megatron's scheduler, on the caller's thread
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.3]
    with pytest.raises(RuntimeError):
        with _scaled_lr(opt, 2.0):
            raise RuntimeError("a failed step")
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.3]
