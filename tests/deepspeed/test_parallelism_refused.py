"""Tensor / pipeline model parallelism and MoE experts are refused at initialize with the setting
and the fix named (single process: the check runs before anything distributed)."""
import pytest
import torch

import ds_acco
from fixtures import TinyNet, ds_config, make_optimizer

ACCO = {"enabled": True, "mode": "acco"}


class FakeMPU:
    def __init__(self, tp=1, pp=1):
        self.tp, self.pp = tp, pp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_pipeline_model_parallel_world_size(self):
        return self.pp


@pytest.mark.parametrize("tp,pp,name", [(2, 1, "get_model_parallel_world_size"),
                                        (1, 2, "get_pipeline_model_parallel_world_size")])
def test_model_parallelism_is_refused(tp, pp, name):
    model = TinyNet(seed=0)
    with pytest.raises(ValueError) as err:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=ds_config(4, ACCO),
                           mpu=FakeMPU(tp, pp))
    assert f"mpu.{name}() = 2" in str(err.value) and "fix:" in str(err.value)


def test_moe_experts_are_refused():
    model = TinyNet(seed=0)
    model.fc2.weight.allreduce = False  # how DeepSpeed marks expert parameters
    with pytest.raises(ValueError) as err:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=ds_config(4, ACCO))
    assert "MoE expert parameters" in str(err.value) and "'fc2.weight'" in str(err.value)


def test_data_parallel_mpu_passes_the_check():
    from ds_acco.deepspeed.engine import _refuse_model_parallelism
    _refuse_model_parallelism(TinyNet(seed=0), FakeMPU(1, 1))  # no error: handed on to DeepSpeed
    assert torch.is_tensor(next(TinyNet(seed=0).parameters()))
