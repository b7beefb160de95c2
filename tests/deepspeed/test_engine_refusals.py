"""Refusals the DeepSpeed engine raises on a call, not at construction (core/checks/refusals.py rows)."""
import pytest
import torch

from ds_acco.deepspeed.engine import AccoEngine
from ds_acco.deepspeed.optimizer import AccoZeroOptimizer


class _Driver:
    def finalised(self):  # what AccoEngine.__del__ asks of it
        pass


def test_backward_without_the_accumulation_scaling_is_refused():
    """``scale_wrt_gas=False`` is refused before DeepSpeed's backward runs (nothing else of the
    engine is needed to reach it: an engine shell whose optimizer has a driver)."""
    engine = AccoEngine.__new__(AccoEngine)
    optimizer = AccoZeroOptimizer.__new__(AccoZeroOptimizer)
    optimizer.driver = _Driver()
    engine.__dict__["optimizer"] = optimizer
    with pytest.raises(ValueError) as caught:
        engine.backward(torch.ones(()), scale_wrt_gas=False)
    assert caught.value.refusal == "unscaled_backward"
    assert str(caught.value).startswith("engine.backward(..., scale_wrt_gas=False) with ACCO: ")
