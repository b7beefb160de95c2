"""Parallel layouts ACCO refuses at initialize, with the setting and the fix named (single process:
the check of what the caller passed runs before anything distributed; tests/deepspeed/test_autotp.py
checks what an engine built): pipeline, DeepSpeed-Ulysses sequence parallelism (from an mpu, the
config or a mesh), Megatron's sequence parallelism, MoE experts, and per-rank phase lengths under
AutoTP. Tensor parallelism passes the check (tests/deepspeed/test_tensor_parallel.py and
test_autotp.py train it)."""
import pytest

import ds_acco
from ds_acco.config import AccoConfig, requested_layout
from ds_acco.core.checks.refusals import LAYOUT_REFUSALS, check_layout
from fixtures import TinyNet, ds_config, make_optimizer

ACCO = {"enabled": True, "mode": "acco"}


class FakeMPU:
    def __init__(self, tp=1, pp=1, sp=1):
        self.tp, self.pp, self.sp = tp, pp, sp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_pipeline_model_parallel_world_size(self):
        return self.pp

    def get_sequence_parallel_world_size(self):
        return self.sp


def _refusal(key, model=None, acco=ACCO, mpu=None, **kwargs):
    """The message of the refusal ``ds_acco.initialize`` raises; ``key``: its row in core/checks/refusals.py."""
    model = model or TinyNet(seed=0)
    config = kwargs.pop("config", ds_config(4, acco))
    with pytest.raises(ValueError) as err:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=config, mpu=mpu, **kwargs)
    assert "fix:" in str(err.value) and err.value.refusal == key
    return str(err.value)


@pytest.mark.parametrize("tp,pp,sp,name,key", [(1, 2, 1, "get_pipeline_model_parallel_world_size", "pipeline_parallel"),
                                               (2, 2, 1, "get_pipeline_model_parallel_world_size", "pipeline_parallel"),
                                               (1, 1, 2, "get_sequence_parallel_world_size", "ulysses")])
def test_model_parallelism_is_refused(tp, pp, sp, name, key):
    assert f"mpu.{name}() = 2" in _refusal(key, mpu=FakeMPU(tp, pp, sp))


@pytest.mark.parametrize("how,kwargs", [
    ("sequence_parallel_size = 2", {"config": ds_config(4, ACCO, sequence_parallel_size=2, data_parallel_size=1)}),
    ("mesh_param[1] (the sequence-parallel size of the mesh) = 2", {"mesh_param": (1, 2)})])
def test_ulysses_from_the_config_or_a_mesh_is_refused(how, kwargs):
    msg = _refusal("ulysses", **kwargs)
    assert f"acco.enabled = true with sequence parallelism: {how}" in msg and "--ds-sequence-parallel-size 1" in msg


def _megatron_model(sequence_parallel):
    """TinyNet with the attributes Megatron sets: ``sequence_parallel`` on every layer norm weight and
    bias and on row-parallel biases, True under --sequence-parallel and False otherwise."""
    model = TinyNet(seed=0)
    for p in (model.fc1.bias, model.fc2.bias):
        p.sequence_parallel = sequence_parallel
    return model


def test_megatron_sequence_parallelism_is_refused():
    msg = _refusal("megatron_sequence_parallel", _megatron_model(True), mpu=FakeMPU(tp=2))
    assert "Megatron's sequence parallelism: 2 parameters marked sequence_parallel = True (e.g. 'fc1.bias')" in msg
    assert "mpu.get_model_parallel_world_size() = 2" in msg  # what it read the tensor-parallel size from
    assert "summed over the tensor-parallel group" in msg and "fix: run without --sequence-parallel" in msg


@pytest.mark.parametrize("sequence_parallel,tp", [(False, 2), (True, 1)])
def test_megatron_without_sequence_parallelism_passes_the_check(sequence_parallel, tp):
    """Megatron marks its layer norms sequence_parallel = False without the flag, and turns the flag
    off itself at tensor-parallel size 1 (every rank then sees the whole sequence)."""
    model = _megatron_model(sequence_parallel)
    check_layout(AccoConfig(enabled=True), requested_layout({}, FakeMPU(tp=tp), model))


def test_moe_experts_are_refused():
    model = TinyNet(seed=0)
    model.fc2.weight.allreduce = False  # how DeepSpeed marks expert parameters
    msg = _refusal("moe_experts", model)
    assert "MoE expert parameters" in msg and "'fc2.weight'" in msg


AUTOTP = {"autotp_size": 2}


@pytest.mark.parametrize("accumulation", ["dynamic", "shared"])
def test_per_rank_phase_lengths_under_autotp_are_refused_before_any_engine(accumulation):
    """No mpu: the tensor-parallel size is read from the config (and again from the engine's groups,
    tests/deepspeed/test_autotp.py)."""
    msg = _refusal("per_rank_phases_tensor_parallel",
                   config=ds_config(4, dict(ACCO, accumulation=accumulation), tensor_parallel=AUTOTP))
    assert (f"acco.accumulation = '{accumulation}' with tensor parallelism (AutoTP: "
            "tensor_parallel.autotp_size = 2") in msg and 'fix: set "accumulation": "fixed"' in msg


@pytest.mark.parametrize("tp", [1, 2])
def test_data_and_tensor_parallel_pass_the_check(tp):
    check_layout(AccoConfig(enabled=True), requested_layout({}, FakeMPU(tp, 1), TinyNet(seed=0)))
    check_layout(AccoConfig(enabled=True), requested_layout({"tensor_parallel": {"autotp_size": tp}},
                                                            model=TinyNet(seed=0)))  # AutoTP, fixed accumulation


def test_every_refusal_names_what_why_and_fix():
    """The table the refusals come from: each row says what it refuses, why, and the fix."""
    assert len({r.what for r in LAYOUT_REFUSALS}) == len(LAYOUT_REFUSALS)
    assert all(r.what and len(r.why) > 20 and len(r.fix) > 10 for r in LAYOUT_REFUSALS)
