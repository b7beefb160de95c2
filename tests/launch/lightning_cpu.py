"""Lift the checks by which Lightning's ``DeepSpeedStrategy`` refuses a CPU job (test-only).

Lightning 2.6 runs DeepSpeed on CUDA GPUs only; DeepSpeed itself runs on CPU (``DS_ACCELERATOR=cpu``,
gloo), and so does ds_acco. Each patch below lets through exactly what Lightning refuses for a CPU
accelerator and runs Lightning's own code otherwise. Imported by the ``sitecustomize`` that
tests/integration/test_lightning_example.py puts on the ranks' PYTHONPATH (never by the library).
"""
import argparse
import types

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import deepspeed as strategy_module
from lightning.pytorch.strategies.ddp import DDPStrategy

Strategy = strategy_module.DeepSpeedStrategy
_setup_environment = Strategy.setup_environment
_validate = strategy_module._validate_device_index_selection


def setup_environment(self):
    """Refused: 'The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used.'"""
    if isinstance(self.accelerator, CPUAccelerator):
        return DDPStrategy.setup_environment(self)  # the parent's, as after Lightning's check
    return _setup_environment(self)


def _validate_device_index_selection(devices):
    """Refused: 'The selected device indices [None, None] don't match the local rank values' (CPU devices
    have no index)."""
    if all(d.type == "cpu" for d in devices):
        return
    return _validate(devices)


def _namespace(**kwargs):
    """Failed: DeepSpeed compares ``args.device_rank >= 0``, and the strategy passes the CPU device's index,
    None; without the attribute DeepSpeed takes the local rank, as for any launch without it."""
    if kwargs.get("device_rank", 0) is None:
        del kwargs["device_rank"]
    return argparse.Namespace(**kwargs)


Strategy.setup_environment = setup_environment
strategy_module._validate_device_index_selection = _validate_device_index_selection
strategy_module.argparse = types.SimpleNamespace(Namespace=_namespace)  # the module's only use of argparse
