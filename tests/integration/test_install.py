"""``ds_acco.install()``: routing of ``deepspeed.initialize``, idempotence, reversibility, and the
Accelerate / HF Trainer adapters (single process; the real 2-rank run is tests/test_hf_trainer.py)."""
from __future__ import annotations

import json
import threading

import deepspeed
import pytest

import importlib

install_mod = importlib.import_module("ds_acco.install")  # the module: ds_acco.install is also the function
from ds_acco.install import install, installed, uninstall
from dist import port_busy, solo_world

ACCO_ON = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 1}, "acco": {"enabled": True}}


class FakeInitialize:
    """Stands in for the original ``deepspeed.initialize``: records its calls and what
    ``deepspeed.DeepSpeedEngine`` was while it ran (ds_acco substitutes AccoEngine there)."""

    def __init__(self):
        self.calls = []
        self.result = ("engine", "optimizer", "loader", "scheduler")

    def __call__(self, args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                 lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
                 config=None, mesh_param=None, config_params=None):
        self.calls.append({"args": args, "model": model, "optimizer": optimizer, "config": config,
                           "config_params": config_params, "engine_class": deepspeed.DeepSpeedEngine})
        return self.result


@pytest.fixture
def fake():
    """A fake original installed under deepspeed.initialize; everything restored afterwards. An
    enabled block runs ds_acco's ranks' agreement for real (a one-rank group, on a store of
    :func:`dist.solo_world`, not DeepSpeed's default port 29500)."""
    uninstall()
    real = deepspeed.initialize
    f = FakeInitialize()
    deepspeed.initialize = f
    try:
        with port_busy(29500), solo_world():  # DeepSpeed's default port busy, as when another job holds it
            yield f
    finally:
        uninstall()
        deepspeed.initialize = real


@pytest.mark.parametrize("config", [
    None,
    {"train_micro_batch_size_per_gpu": 1},  # no block
    {"train_micro_batch_size_per_gpu": 1, "acco": {"enabled": False, "mode": "dpu"}},
    {"train_micro_batch_size_per_gpu": 1, "acco": {}},
])
def test_disabled_or_absent_block_is_the_original_call(fake, config):
    install()
    model, opt = object(), object()
    out = deepspeed.initialize(None, model, opt, config=config)
    assert out is fake.result
    assert fake.calls == [{"args": None, "model": model, "optimizer": opt, "config": config, "config_params": None,
                           "engine_class": deepspeed.DeepSpeedEngine}]


def test_unreadable_config_is_left_to_deepspeed(fake, tmp_path):
    install()
    missing = str(tmp_path / "missing.json")
    deepspeed.initialize(model=None, config=missing)
    assert fake.calls[0]["config"] == missing  # DeepSpeed reports the missing file in its own words


def test_enabled_block_routes_to_ds_acco_without_recursion(fake, tmp_path):
    from ds_acco.deepspeed.engine import AccoEngine

    install()
    path = tmp_path / "acco.json"
    path.write_text(json.dumps(ACCO_ON))
    for kwargs in ({"config": dict(ACCO_ON)}, {"config_params": dict(ACCO_ON)}, {"config": str(path)}):
        fake.calls.clear()
        deepspeed.initialize(model="m", **kwargs)
        assert len(fake.calls) == 1  # the router ran the original exactly once
        built = fake.calls[0]["engine_class"]
        assert built is not AccoEngine and built.__qualname__.startswith("initialize.")  # ds_acco's factory
    assert deepspeed.DeepSpeedEngine.__name__ == "DeepSpeedEngine"  # substitution undone


def test_args_deepspeed_config_is_honoured(fake, tmp_path):
    import argparse

    install()
    path = tmp_path / "acco.json"
    path.write_text(json.dumps(ACCO_ON))
    deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model="m")
    assert fake.calls[0]["engine_class"].__qualname__.startswith("initialize.")


def test_invalid_block_raises_ds_acco_error(fake):
    install()
    with pytest.raises(ValueError, match="acco.enable"):
        deepspeed.initialize(model="m", config={"acco": {"enable": True}})
    assert fake.calls == []


def test_install_is_idempotent_and_uninstall_restores(fake):
    assert not installed()
    install()
    router = deepspeed.initialize
    assert router is not fake and getattr(router, "__ds_acco_router__", False)
    install()
    install()
    assert deepspeed.initialize is router  # no router around a router
    assert sum(1 for o, n, _, _ in install_mod._patches if n == "initialize") == 1
    uninstall()
    assert deepspeed.initialize is fake and not installed()
    uninstall()  # idempotent too
    assert deepspeed.initialize is fake


def test_uninstall_leaves_a_later_patch_alone(fake):
    install()
    later = FakeInitialize()
    deepspeed.initialize = later  # someone patched after us
    uninstall()
    assert deepspeed.initialize is later


def test_concurrent_installs_patch_once(fake):
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        install()

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for o, n, _, _ in install_mod._patches if n == "initialize") == 1
    assert deepspeed.initialize(model=None, config={}) is fake.result


def test_framework_adapters_patch_and_restore(fake):
    accelerate_ds = pytest.importorskip("accelerate.utils.deepspeed")
    from accelerate.scheduler import AcceleratedScheduler
    from transformers.trainer import Trainer

    names = [(accelerate_ds.DeepSpeedEngineWrapper, "backward"), (AcceleratedScheduler, "step"),
             (Trainer, "evaluation_loop"), (Trainer, "save_model"), (Trainer, "_maybe_log_save_evaluate")]

    def current():
        return tuple(owner.__dict__[name] for owner, name in names)

    originals = current()
    install()  # both modules are imported: patched now
    patched = current()
    assert all(p is not o and p.__wrapped__ is o for p, o in zip(patched, originals))
    install()
    assert current() == patched
    uninstall()
    assert current() == originals


class _Engine:
    """Records what Accelerate's wrapper does to it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.log = []

    def gradient_accumulation_steps(self):
        return 4

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.log.append(("boundary", is_boundary))

    def backward(self, loss, **kwargs):
        self.log.append(("backward", loss, kwargs))

    def step(self):
        self.log.append(("step",))


def test_accelerate_wrapper_drives_acco_engines_per_micro_batch(fake):
    accelerate_ds = pytest.importorskip("accelerate.utils.deepspeed")
    from ds_acco.deepspeed.optimizer import AccoZeroOptimizer

    install()
    stock = _Engine(optimizer=object())
    accelerate_ds.DeepSpeedEngineWrapper(stock).backward(1.0, sync_gradients=False, scale_wrt_gas=False)
    assert stock.log == [("boundary", False), ("backward", 1.0, {"scale_wrt_gas": False})]  # Accelerate's own code

    acco = _Engine(optimizer=AccoZeroOptimizer.__new__(AccoZeroOptimizer))
    wrapper = accelerate_ds.DeepSpeedEngineWrapper(acco)
    wrapper.backward(0.25, sync_gradients=False, scale_wrt_gas=False)  # HF Trainer: loss already / A
    wrapper.backward(0.5, sync_gradients=True)
    assert acco.log == [("backward", 1.0, {}), ("step",), ("backward", 0.5, {}), ("step",)]

    # Dynamic accumulation and the Trainer's step counting do not mix: refused, naming the fix.
    from ds_acco.config import AccoConfig
    dynamic = _Engine(optimizer=AccoZeroOptimizer.__new__(AccoZeroOptimizer))
    dynamic._acco_config = AccoConfig.from_block({"enabled": True, "accumulation": "dynamic"})
    with pytest.raises(ValueError, match="accumulation = 'dynamic' under Accelerate / HF Trainer.*fix:"):
        accelerate_ds.DeepSpeedEngineWrapper(dynamic).backward(0.25, sync_gradients=False, scale_wrt_gas=False)
    assert dynamic.log == []
