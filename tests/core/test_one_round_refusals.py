"""Mode 'one_round''s config shape and refusals (docs/configuration.md): each refusal asserted by its
row's key, fed plain values and real torch optimizers; the engine's own wiring is exercised by
tests/deepspeed/test_one_round.py."""
import pytest
import torch

from ds_acco.config import AccoConfig
from ds_acco.core.checks.built import Built, check_built
from ds_acco.core.checks.layout import ParallelLayout
from ds_acco.core.checks.refusals import check_layout
from ds_acco.core.step.predict import PREDICTORS, scratch_offset
from ds_acco.core.step.shard_optimizer import ShardOptimizer

ONE = {"enabled": True, "mode": "one_round"}


def _shard(make):
    p = torch.nn.Parameter(torch.zeros(4))
    return ShardOptimizer(make([p]), [p])


@pytest.mark.parametrize("predictor, name, coef", [
    (None, "ef", 0.5), ("nag", "nag", 1.0), ("ext", "ext", 1.0), ({"name": "ext", "coef": 2}, "ext", 2.0),
    ({"coef": 0.25}, "ef", 0.25)])
def test_the_predictor_and_its_defaults(predictor, name, coef):
    block = dict(ONE, **({} if predictor is None else {"predictor": predictor}))
    p = AccoConfig.from_block(block).predictor_setting()
    assert (p.name, p.value) == (name, coef)
    if not isinstance(predictor, dict):  # the config's defaults are the predictors' own
        assert PREDICTORS[p.name] == coef


@pytest.mark.parametrize("block, key", [
    ({"enabled": True, "predictor": "ef"}, "acco_no_effect"),
    ({"enabled": True, "mode": "dpu", "predictor": "ef"}, "acco_no_effect"),
    (dict(ONE, estimate="paper"), "acco_no_effect"),
    ({"enabled": True, "mode": "dpu", "sync_warmup_steps": 2}, "acco_no_effect"),  # one_round takes it (auto)
    (dict(ONE, predictor={"name": "ef", "coef": 1.0}), "acco_invalid_value"),
    (dict(ONE, predictor="heavy"), "acco_invalid_value"),
    (dict(ONE, predictor={"name": "ef", "gamma": 0.5}), "acco_unknown_key"),
    (dict(ONE, accumulation="dynamic"), "one_round_accumulation"),
    (dict(ONE, accumulation="shared"), "one_round_accumulation"),
])
def test_the_block_refuses(block, key):
    with pytest.raises(ValueError) as caught:
        AccoConfig.from_block(block)
    assert caught.value.refusal == key and "fix:" in str(caught.value)


def test_nag_needs_torch_adam():
    acco = AccoConfig.from_block(dict(ONE, predictor="nag"))
    check_built(acco, Built(shard_optimizer=_shard(lambda ps: torch.optim.AdamW(ps, lr=0.1))))
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.RMSprop(ps, lr=0.1)):
        with pytest.raises(ValueError) as caught:
            check_built(acco, Built(shard_optimizer=_shard(make)))
        assert caught.value.refusal == "one_round_predictor_optimizer"
        assert "acco.predictor.name = 'nag'" in str(caught.value) and "fix:" in str(caught.value)
    check_built(AccoConfig.from_block(ONE), Built(shard_optimizer=_shard(lambda ps: torch.optim.SGD(ps, lr=0.1))))


@pytest.mark.parametrize("world, comm, live, fits", [
    (2, torch.float32, torch.float32, True), (2, torch.float32, torch.bfloat16, False),
    (2, torch.bfloat16, torch.bfloat16, False), (4, torch.float32, torch.bfloat16, True), (1, torch.float32,
                                                                                          torch.float32, False)])
def test_ext_needs_room_in_b(world, comm, live, fits):
    acco = AccoConfig.from_block(dict(ONE, predictor="ext"))
    built = Built(comm_dtype=comm, live_dtype=live, rounds_world=world)
    if fits:
        check_built(acco, built)
        check_built(AccoConfig.from_block(ONE), built)
        return
    with pytest.raises(ValueError) as caught:
        check_built(acco, built)
    assert caught.value.refusal == "one_round_ext_room"
    check_built(AccoConfig.from_block(ONE), built)  # ef keeps its own buffer


def test_scratch_clear_of_this_ranks_segments():
    seg = 1000
    for world in (2, 3, 4):
        for rank in range(world):
            off = scratch_offset(rank, world, seg, 4, 4, True)
            assert off is not None and off % 4 == 0 and off + 4 * seg <= world * seg * 4
            assert off + 4 * seg <= 4 * rank * seg or off >= 4 * (rank + 1) * seg


def test_fsdp_and_tensor_parallelism_are_refused():
    acco = AccoConfig.from_block(ONE)
    with pytest.raises(ValueError) as caught:
        check_built(acco, Built(fsdp=dict(one_mesh=True)))
    assert caught.value.refusal == "one_round_fsdp"
    layout = ParallelLayout(tensor_parallel=2, tensor_parallel_from="AutoTP's model-parallel group size")
    with pytest.raises(ValueError) as caught:
        check_layout(acco, layout)
    assert caught.value.refusal == "one_round_tensor_parallel" and "AutoTP's" in str(caught.value)
    check_layout(AccoConfig.from_block({"enabled": True, "mode": "dpu"}), layout)
