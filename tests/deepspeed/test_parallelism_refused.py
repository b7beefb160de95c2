"""Pipeline and sequence parallelism and MoE experts are refused at initialize with the setting and
the fix named (single process: the check runs before anything distributed); tensor parallelism
passes the check (tests/deepspeed/test_tensor_parallel.py trains it)."""
import pytest
import torch

import ds_acco
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


@pytest.mark.parametrize("tp,pp,sp,name", [(1, 2, 1, "get_pipeline_model_parallel_world_size"),
                                           (2, 2, 1, "get_pipeline_model_parallel_world_size"),
                                           (1, 1, 2, "get_sequence_parallel_world_size")])
def test_model_parallelism_is_refused(tp, pp, sp, name):
    model = TinyNet(seed=0)
    with pytest.raises(ValueError) as err:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=ds_config(4, ACCO),
                           mpu=FakeMPU(tp, pp, sp))
    assert f"mpu.{name}() = 2" in str(err.value) and "fix:" in str(err.value)


def test_moe_experts_are_refused():
    model = TinyNet(seed=0)
    model.fc2.weight.allreduce = False  # how DeepSpeed marks expert parameters
    with pytest.raises(ValueError) as err:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=ds_config(4, ACCO))
    assert "MoE expert parameters" in str(err.value) and "'fc2.weight'" in str(err.value)


@pytest.mark.parametrize("tp", [1, 2])
def test_data_and_tensor_parallel_mpu_pass_the_check(tp):
    from ds_acco.deepspeed.engine import _refuse_model_parallelism
    _refuse_model_parallelism(TinyNet(seed=0), FakeMPU(tp, 1))  # no error: handed on to DeepSpeed
    assert torch.is_tensor(next(TinyNet(seed=0).parameters()))
