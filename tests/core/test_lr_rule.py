"""Dynamic accumulation's learning-rate rule: the factor a round applies and how a step uses it
(the end-to-end schedule is replayed against the reference in tests/deepspeed/test_dynamic.py)."""
import copy

import pytest
import torch

from ds_acco.core.rounds import RoundContext, RoundKind
from ds_acco.core.shard_optimizer import ShardOptimizer, scaled_lr


def _ctx(power):
    return RoundContext(groups=[], shard_optimizer=None, process_group=None, rank=0, world=2, gas_scale=0.25,
                        clip_grad=0.0, nonfinite="skip", reduce_scatter=False, drift_every=0, chunk_elems=1024,
                        lr_power=power, nominal_phase_micro_batches=4, commit_phases=2)


def test_factor_compares_each_round_with_what_fixed_accumulation_gives_it():
    sqrt, linear = _ctx(0.5), _ctx(1.0)
    assert linear.lr_factor(RoundKind.ESTIMATE, 4) == 1.0  # one phase of 2 ranks x 2
    assert linear.lr_factor(RoundKind.COMMIT, 8) == 1.0  # a commit sums both phases
    assert linear.lr_factor(RoundKind.COMMIT, 24) == 3.0
    assert sqrt.lr_factor(RoundKind.ESTIMATE, 16) == 2.0
    assert _ctx(0.0).lr_factor(RoundKind.COMMIT, 24) == 1.0


def _shards(kind, lr):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(77))]
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.1) if kind == "adamw"
           else torch.optim.SGD(params, lr=lr, momentum=0.9) if kind == "sgd" else torch.optim.RMSprop(params, lr=lr))
    return params, opt


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_a_scaled_step_is_the_step_at_the_scaled_rate_and_leaves_the_groups_rate(kind):
    """Functional steps (AdamW, SGD) read lr × scale without writing the group; RMSprop (no
    functional step) takes its real step with the group's rate scaled for its duration. Both are
    bit-identical to a step of an optimizer built with the scaled rate."""
    grads = [torch.randn(300), torch.randn(77)]
    params, opt = _shards(kind, 0.01)
    ref_params, ref_opt = _shards(kind, 0.04)  # 0.01 x 4, exactly
    shard, ref = ShardOptimizer(opt, params, chunk_elems=64), ShardOptimizer(ref_opt, ref_params, chunk_elems=64)
    for _ in range(2):  # the second commit has optimizer state
        outs, ref_outs = [torch.empty(300), torch.empty(77)], [torch.empty(300), torch.empty(77)]
        shard.estimate_into(grads, outs, lr_scale=4.0)
        ref.estimate_into(grads, ref_outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
        lr_object = opt.param_groups[0]["lr"]
        shard.commit([g.clone() for g in grads], lr_scale=4.0)
        ref.commit([g.clone() for g in grads])
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
        assert opt.param_groups[0]["lr"] == 0.01
        if kind != "rmsprop":
            assert opt.param_groups[0]["lr"] is lr_object  # never written: a scheduler may write it meanwhile


def test_scaled_lr_is_undone_exactly_and_keeps_a_value_written_meanwhile():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [], "lr": 0.3}])
    with scaled_lr(opt, 3.0):
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.3), pytest.approx(0.9)]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]  # exactly the saved values
    with scaled_lr(opt, 3.0):
        opt.param_groups[0]["lr"] = 0.05  # e.g. Megatron's scheduler, on the caller's thread
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.3]
    with pytest.raises(RuntimeError):
        with scaled_lr(opt, 2.0):
            raise RuntimeError("a failed step")
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.3]
    # a float copy of the scaled value (what a snapshot/restore puts back) is still ours
    with scaled_lr(opt, 2.0):
        opt.param_groups[0]["lr"] = copy.deepcopy(opt.param_groups[0]["lr"]) + 0.0
    assert opt.param_groups[0]["lr"] == 0.05


def test_a_tensor_learning_rate_without_a_functional_step_is_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.RMSprop([p], lr=torch.tensor(0.1))
    with pytest.raises(ValueError, match="lr_scaling.*tensor learning rate.*fix"):
        with scaled_lr(opt, 2.0):
            pass
    with scaled_lr(opt, 1.0):  # the rule off: nothing to undo
        pass
