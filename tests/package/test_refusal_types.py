"""Errors by type (issue 41): every refusal of the table reaches its caller as an ``AccoRefusal`` -- a
``ValueError`` carrying its row (``.row``) and the row's key (``.refusal``) -- raised through the entry
point that meets it (``ds_acco.initialize``'s check of what the caller passed, DeepSpeed's parse of the
config, the config model's own validation, the checks an adapter runs on what it built). A warning is
not a row of the table and is never raised. Single process, no engine built: each trigger is refused
before anything distributed exists."""
import ast
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ds_acco
from ds_acco.config import AccoConfig
from ds_acco.config_deepspeed import deepspeed_config_at
from ds_acco.config_keys import check_deepspeed_compat
from ds_acco.core.checks import built, refusals
from ds_acco.core.checks.refusals import REFUSALS, AccoRefusal
from ds_acco.core.checks.warning_rows import WARNINGS, one_queue_serialisation
from ds_acco.core.driver import AccoDriver, check_weight
from ds_acco.fsdp import AccoFSDP
from fixtures import TinyNet, ds_config, make_optimizer
from timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]
ON = {"enabled": True}


class FakeMPU:  # a Megatron-style mpu: its sizes only (nothing distributed is asked of it)
    def __init__(self, tp=1, pp=1):
        self.tp, self.pp = tp, pp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_pipeline_model_parallel_world_size(self):
        return self.pp


def _moe_model():
    model = TinyNet(seed=0)
    model.fc1.weight.allreduce = False  # DeepSpeed's is_moe_param: an expert parameter
    return model


def _initialize(acco=ON, model=None, mpu=None, **extra):
    """``ds_acco.initialize`` on a config with this block: it refuses before any process group."""
    def call():
        net = model() if model else TinyNet(seed=0)
        ds_acco.initialize(model=net, optimizer=make_optimizer("sgd")(net), config=ds_config(4, acco, **extra),
                           mpu=mpu)
    return call


def _deepspeed(acco=ON, gas=4, **extra):
    """The check ``initialize`` runs on DeepSpeed's own parse of the config (``python -m ds_acco check``
    runs the same), at one data-parallel rank."""
    return lambda: check_deepspeed_compat(AccoConfig.from_block(acco),
                                          deepspeed_config_at(ds_config(gas, acco, **extra), 1))


DYN = {"enabled": True, "accumulation": "dynamic"}
TRIGGERS = {
    # the "acco" block itself: the config model's errors, at initialize's one parse
    "acco_not_object": _initialize(acco="yes"),
    "acco_unknown_key": _initialize(acco={"enabled": True, "acumulation": "dynamic"}),
    "acco_invalid_value": _initialize(acco={"enabled": True, "comm_timeout_s": -1.0}),
    "acco_no_effect": _initialize(acco={"enabled": True, "dynamic": {"min_micro_batches": 2}}),
    "acco_sigterm_checkpoint_dir": _initialize(acco={"enabled": True, "sigterm": "checkpoint"}),
    "acco_sync_warmup_not_fixed": _initialize(acco={**DYN, "sync_warmup_steps": 2}),
    "acco_lr_warmup_unknown": _initialize(acco={"enabled": True, "sync_warmup_steps": "lr_warmup"}),
    "acco_dynamic_bounds": _initialize(acco={**DYN, "dynamic": {"min_micro_batches": 4, "max_micro_batches": 2}}),
    # the layout the caller asks for (check point 1, before any process group)
    "pipeline_parallel": _initialize(mpu=FakeMPU(pp=2)),
    "ulysses": _initialize(sequence_parallel_size=2, data_parallel_size=1),
    "moe_experts": _initialize(model=_moe_model),
    "per_rank_phases_tensor_parallel": _initialize(acco=DYN, mpu=FakeMPU(tp=2)),
    "per_rank_phases_caller_boundary": _initialize(acco=DYN, mpu=FakeMPU()),
    # DeepSpeed's parse of the same config (check point 1, before the engine)
    "odd_accumulation": _deepspeed(gas=3),
    "zero_stage": _deepspeed(zero_optimization={"stage": 2}),
    "fp16_master_weights": _deepspeed(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
    "raise_on_overflow": _deepspeed(acco={"enabled": True, "nonfinite": "raise"}, fp16={"enabled": True}),
    "fp16_estimate_round": _deepspeed(acco={"enabled": True, "estimate_comm_dtype": "fp16"}, fp16={"enabled": True}),
    "unmanaged_accumulation": _deepspeed(managed_gradient_accumulation=False),
    "bf16_master_weights": _deepspeed(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
    "sum_not_fixed": _deepspeed(acco=DYN, gradient_allreduce_op="sum"),
    "hybrid_engine": _deepspeed(hybrid_engine={"enabled": True}),
    # what an adapter built (check point 2), fed to the checks it calls
    "lockstep": lambda: refusals.check_lockstep(AccoConfig(**DYN), "FSDP's all-gathers"),
    "fsdp_mesh": lambda: built.check_fsdp_model(
        one_mesh=False, reduce_dtypes=[torch.float32], param_dtypes=[torch.float32], loss_scaling=False,
        estimate_comm_dtype=None, estimate_dtype=None),
    "estimate_dtype_deepspeed": lambda: built.check_estimate_dtype(
        "estimate_dtype_deepspeed", "fp32", torch.float32, torch.bfloat16),
    # calls whose arguments or setting ACCO does not run
    "weight_unweighted": lambda: check_weight("micro_batch", 3.0, "backward"),
    "weighting_needs_weight": lambda: check_weight("sample", None, "backward"),
    "sigterm_main_thread": lambda: _off_the_main_thread(
        lambda: AccoDriver.install_sigterm(SimpleNamespace(config=AccoConfig(enabled=True, sigterm="stop")), None)),
    "fsdp_disabled": lambda: AccoFSDP(torch.nn.Linear(2, 2), None, {"acco": {"enabled": False}}),
}


def _off_the_main_thread(call):
    errors = []
    thread = threading.Thread(target=lambda: _catch(call, errors))
    thread.start()
    thread.join()
    raise errors[0]


def _catch(call, errors):
    try:
        call()
    except Exception as error:  # handed to the main thread
        errors.append(error)


def test_every_trigger_names_a_row():
    assert set(TRIGGERS) <= set(REFUSALS)


@pytest.mark.parametrize("key", sorted(TRIGGERS))
def test_a_refusal_raised_through_its_entry_point_is_an_acco_refusal_with_its_row(key):
    with pytest.raises(ValueError) as caught:  # existing `except ValueError` keeps working
        TRIGGERS[key]()
    error = caught.value
    assert type(error) is AccoRefusal, (type(error), str(error))
    assert error.refusal == key and error.row is REFUSALS[key], (error.refusal, str(error))
    assert "fix:" in str(error)


def test_the_config_models_own_errors_are_refusals_naming_key_value_and_fix():
    """pydantic's errors on the block (a bad type, an unknown key, a value out of range) are converted
    at the one parse point: an AccoRefusal with a row, not a pydantic ValidationError."""
    from pydantic import ValidationError
    for block, key, names in [({"enabled": "yes"}, "acco_invalid_value", "acco.enabled = 'yes'"),
                              ({"metrics": {"log_evry": 1}}, "acco_unknown_key", "acco.metrics.log_evry = 1"),
                              ({"chunk_elements": 7}, "acco_invalid_value", "acco.chunk_elements = 7")]:
        with pytest.raises(AccoRefusal) as caught:
            AccoConfig.from_block(block)
        assert not isinstance(caught.value, ValidationError)
        assert caught.value.row is REFUSALS[key] and names in str(caught.value) and "fix:" in str(caught.value)
    assert ds_acco.AccoRefusal is AccoRefusal


def test_a_warning_is_not_a_refusal_and_is_not_raised(monkeypatch):
    assert not set(WARNINGS) & set(REFUSALS)
    with pytest.raises(KeyError):
        refusals.refuse("one_hardware_queue")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    text = one_queue_serialisation(torch.device("cuda", 0), synchronous=False)  # a device object: nothing runs
    assert isinstance(text, str) and text.endswith("; fix: " + WARNINGS["one_hardware_queue"].fix)


@pytest.mark.slow  # a fresh interpreter (~1 s)
def test_the_config_imports_without_the_core():
    code = ("import sys, ds_acco.config\n"
            "print(sorted(m for m in sys.modules if m.startswith('ds_acco.core')))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled(100))
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


# -- structural: no refusal outside the table -----------------------------------------------------------------
# A ``raise ValueError(...)`` in ds_acco/ whose message says "fix:" is a refusal that bypasses the table,
# unless it checks plain input (a wrong type or value for an argument, how torch.distributed was set up, a
# checkpoint this version cannot read) or sits in a room below the table (tests/package/test_layering.py).
# (file, the message's first words) -> why it stays a ValueError.
PLAIN_INPUT = {
    ("ds_acco/cli.py", " = "): "the command line contradicts the config it is given (--gas with the key set)",
    ("ds_acco/config_deepspeed.py", "--world-size "): "the check command's --world-size argument",
    ("ds_acco/config_deepspeed.py", "train_batch_size = "): "the check command's --world-size against the config's "
                                                           "batch (DeepSpeed refuses the batch itself at initialize)",
    ("ds_acco/config_routing.py", " = : unknown value"): "an environment variable's unknown value",
    ("ds_acco/comm/groups.py", "ACCO: the data-parallel group"): "how the default process group was initialised; "
                                                                 "comm imports no core (layering)",
    ("ds_acco/core/round/report.py", "a table of "): "a checkpoint or peer table this version cannot read",
    ("ds_acco/core/round/report.py", "ACCO in-flight state"): "a checkpoint this version cannot read",
    ("ds_acco/core/step/chunking.py", "chunk_elements = "): "a function argument out of range",
    ("ds_acco/core/step/functional_step.py", "'s param group "): "the lane's backstop (step room, below the table); "
                                                                 "check point 2 refuses it first: "
                                                                 "estimate_lr_scale_without_lr",
    ("ds_acco/core/step/shard_optimizer.py", ""): "the step room lies below the table (layering); found by probing "
                                                  "the optimizer at its first own-settings round",
    ("ds_acco/fsdp/adapter.py", "AccoFSDP needs a model sharded"): "a wrong type for the model argument",
    ("ds_acco/fsdp/adapter.py", "torch.distributed is not initialized"): "torch.distributed not initialised",
    ("ds_acco/fsdp/adapter.py", "the model has no trainable FSDP"): "a model with nothing to train",
    ("ds_acco/fsdp/adapter.py", "the optimizer must own exactly"): "an optimizer built over other parameters",
}


def _strings(node) -> str:
    return "".join(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))


def _value_errors_with_a_fix():
    """(file, line, message text) of each ``raise ValueError(...)`` whose message (its literals, and those of
    a helper of the same module it calls to build the message) says "fix:"."""
    for path in sorted((ROOT / "ds_acco").rglob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {f.name: _strings(f) for f in tree.body if isinstance(f, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "ValueError":
                called = [helpers.get(getattr(c.func, "id", None), "") for c in ast.walk(node.exc)
                          if isinstance(c, ast.Call) and c is not node.exc]
                text = _strings(node.exc) + "".join(called)
                if "fix:" in text:
                    yield str(path.relative_to(ROOT)), node.lineno, text


def test_no_refusal_is_a_bare_value_error():
    """Every "fix:" a ValueError gives is a row of the table raised through ``refuse()`` (an AccoRefusal),
    except the plain-input checks named in PLAIN_INPUT with the reason they stay."""
    found = list(_value_errors_with_a_fix())
    bare = [f"{p}:{line}: {text[:80]!r}" for p, line, text in found
            if not any(p == f and text.startswith(start) for f, start in PLAIN_INPUT)]
    assert not bare, "refusals outside the table (make them rows raised via refuse()):\n" + "\n".join(bare)
    used = {(f, start) for f, start in PLAIN_INPUT for p, _, text in found if p == f and text.startswith(start)}
    assert used == set(PLAIN_INPUT), f"stale PLAIN_INPUT entries: {set(PLAIN_INPUT) - used}"


def test_lr_warmup_is_refused_when_a_client_scheduler_replaces_the_configs(monkeypatch):
    """DeepSpeed runs a client ``lr_scheduler`` and ignores the config's "scheduler" block: the block's
    warm-up is not this run's, so ``"lr_warmup"`` is refused (naming the client scheduler), not read from it."""
    from ds_acco.deepspeed import engine

    def no_process_group(*a, **k):  # check point 1 must refuse before the ranks' agreement binds a port
        raise AssertionError("the process group was started before the refusal")
    monkeypatch.setattr(engine, "check_ranks_agree", no_process_group)
    net = TinyNet(seed=0)
    opt = make_optimizer("sgd")(net)
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}
    cfg = ds_config(4, {"enabled": True, "sync_warmup_steps": "lr_warmup"}, scheduler=warmup)
    with pytest.raises(AccoRefusal, match="client lr_scheduler passed to initialize") as err:
        ds_acco.initialize(model=net, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                           config=cfg)
    assert err.value.refusal == "acco_lr_warmup_unknown"
