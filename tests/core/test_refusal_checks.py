"""The checks of core/checks/refusals.py that the adapters call with what they built, fed plain values:
FSDP2's parameters (dtypes, meshes), the estimate variants against a real torch optimizer, an estimate
round wider than the rounds' dtype. Each refusal is asserted by its row's key; the adapters' own
wiring is exercised by tests/fsdp and tests/deepspeed."""
import pytest
import torch

from ds_acco.config import AccoConfig
from ds_acco.core.checks.built import check_estimate_dtype, check_estimate_variant, check_fsdp_model
from ds_acco.core.step.shard_optimizer import ShardOptimizer

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
FINE = dict(one_mesh=True, reduce_dtypes=[F32, F32], param_dtypes=[BF16, BF16], loss_scaling=False,
            estimate_comm_dtype=None, estimate_dtype=None, post_forward_mesh=False)


@pytest.mark.parametrize("change, key", [
    (dict(one_mesh=False), "fsdp_mesh"),
    (dict(param_dtypes=[BF16, F32]), "fsdp_mixed_precision"),
    (dict(reduce_dtypes=[F32, BF16]), "fsdp_mixed_precision"),
    (dict(loss_scaling=True), "fsdp_fp16_dtypes"),  # bf16 compute
    (dict(loss_scaling=True, param_dtypes=[F16, F16], reduce_dtypes=[F16, F16]), "fsdp_fp16_dtypes"),
    (dict(param_dtypes=[F16, F16]), "fsdp_fp16_unscaled"),
    (dict(reduce_dtypes=[BF16, BF16], estimate_comm_dtype="fp32", estimate_dtype=F32), "estimate_dtype_fsdp"),
    (dict(post_forward_mesh=True), "fsdp_post_forward_mesh"),
])
def test_what_accofsdp_took_over_is_refused_by_its_row(change, key):
    with pytest.raises(ValueError) as caught:
        check_fsdp_model(**{**FINE, **change})
    assert caught.value.refusal == key and "fix:" in str(caught.value)


@pytest.mark.parametrize("change", [
    {}, dict(loss_scaling=True, param_dtypes=[F16, F16]), dict(estimate_comm_dtype="bf16", estimate_dtype=BF16),
    dict(reduce_dtypes=[BF16, BF16], estimate_comm_dtype="fp16", estimate_dtype=F16)])
def test_what_accofsdp_supports_passes(change):
    check_fsdp_model(**{**FINE, **change})


def _shard_optimizer(make):
    p = torch.nn.Parameter(torch.zeros(4))
    return ShardOptimizer(make([p]), [p])


@pytest.mark.parametrize("estimate", [{"second_moment": "committed"}, {"delay_compensation": 0.5}])
def test_estimates_reading_the_committed_second_moment_need_torch_adam(estimate):
    config = AccoConfig(enabled=True, estimate=estimate)
    check_estimate_variant(config.estimate, _shard_optimizer(lambda ps: torch.optim.AdamW(ps, lr=0.1)))
    with pytest.raises(ValueError) as caught:
        check_estimate_variant(config.estimate, _shard_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1)))
    assert caught.value.refusal == "estimate_variant_optimizer" and "which SGD (with these settings)" in str(
        caught.value)
    check_estimate_variant(AccoConfig(enabled=True).estimate, _shard_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1)))


def test_an_estimate_round_wider_than_the_rounds_is_refused():
    check_estimate_dtype("estimate_dtype_deepspeed", "bf16", BF16, BF16)
    check_estimate_dtype("estimate_dtype_deepspeed", None, None, BF16)
    with pytest.raises(ValueError) as caught:
        check_estimate_dtype("estimate_dtype_deepspeed", "fp32", F32, BF16)
    assert caught.value.refusal == "estimate_dtype_deepspeed"
    assert str(caught.value).startswith("acco.estimate_comm_dtype = 'fp32' is wider than the communication dtype "
                                        "torch.bfloat16; fix:")


def test_a_scaled_estimate_needs_a_rate_in_every_group():
    """HF's Adafactor with relative_step=True computes its own rate (lr None): the default look-ahead
    (lr_scale 2) cannot scale it, refused naming the key; the paper's estimate and mode dpu need none."""
    from transformers.optimization import Adafactor
    make = lambda ps: Adafactor(ps, lr=None, relative_step=True)  # noqa: E731
    with pytest.raises(ValueError) as caught:
        check_estimate_variant(AccoConfig(enabled=True).estimate, _shard_optimizer(make))
    assert caught.value.refusal == "estimate_lr_scale_without_lr"
    assert str(caught.value).startswith("acco.estimate.lr_scale = 2.0 scales") and "lr = None" in str(caught.value)
    assert "Adafactor's param group 0" in str(caught.value) and "fix: set \"estimate\": \"paper\"" in str(caught.value)
    check_estimate_variant(AccoConfig(enabled=True, estimate="paper").estimate, _shard_optimizer(make))
    check_estimate_variant(AccoConfig(enabled=True).estimate, _shard_optimizer(make), rounds=False)
    check_estimate_variant(AccoConfig(enabled=True).estimate,
                           _shard_optimizer(lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.1))))


RATES = [None, torch.tensor(1), torch.tensor(1, dtype=torch.int32), True, 1, 0.1, torch.tensor(0.1),
         torch.tensor(0.1, dtype=torch.bfloat16)]


@pytest.mark.parametrize("lr", RATES, ids=repr)
def test_initialize_refuses_exactly_the_rates_a_rounds_step_cannot_scale(lr):
    """``estimate.lr_scale`` ≠ 1 and dynamic ``lr_scaling``: refused at initialize (check_estimate_variant, and
    check point 2's check_built for both) exactly where the lane's scaled step (step_groups) would refuse at the
    first round."""
    from ds_acco.config import DynamicConfig
    from ds_acco.core.checks.built import Built, check_built
    from ds_acco.core.step.functional_step import step_groups
    so = _shard_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    so.optimizer.param_groups[0]["lr"] = lr
    try:
        step_groups(so.optimizer, lr_scale=2.0)
        lane_refuses = False
    except ValueError:
        lane_refuses = True
    # the paper's estimate scales no rate: only the dynamic lr_scaling is checked
    dynamic = AccoConfig(enabled=True, accumulation="dynamic", estimate="paper",
                         dynamic=DynamicConfig(lr_scaling="sqrt"))
    for check in (lambda: check_estimate_variant(AccoConfig(enabled=True).estimate, so),
                  lambda: check_built(AccoConfig(enabled=True), Built(shard_optimizer=so)),
                  lambda: check_built(dynamic, Built(shard_optimizer=so))):
        if lane_refuses:
            with pytest.raises(ValueError) as caught:
                check()
            assert caught.value.refusal == "estimate_lr_scale_without_lr" and f"lr = {lr!r}" in str(caught.value)
        else:
            check()
