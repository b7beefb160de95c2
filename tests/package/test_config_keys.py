"""Every key DeepSpeed's config parser reads is classified for ACCO (ds_acco/config_keys.py), and every
refused value is refused, by the engine's check and by ``python -m ds_acco check`` alike.

The keys come from DeepSpeed's own code, not a hand list: ``DeepSpeedConfig`` parses a config whose
dicts record every key looked up in them (top level, and the blocks read with ``.get`` / ``[]``); a
block handed to one of DeepSpeed's pydantic models is found by a probe key it receives, and that
model's fields are walked (nested models included); ``deepspeed.initialize`` reads a few keys of
the raw dict itself, found in its source. Keys DeepSpeed itself rejects (removed features) are left out.
"""
from __future__ import annotations

import inspect
import io
import json
import os
import re
import typing

import pytest

from ds_acco import cli
from ds_acco.config_keys import KEYS, KINDS, classify, replaced_keys
from ds_acco.core.checks.refusals import REFUSALS

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = "__acco_probe__"


class _Recording(dict):
    """A config dict that records each key DeepSpeed looks up (``path`` + key); a block read with a
    dict default comes back recording too."""

    def __init__(self, path, seen, *args):
        super().__init__(*args)
        self.path, self.seen = path, seen

    def _saw(self, key):
        if isinstance(key, str) and key != PROBE:
            self.seen.add(self.path + key)

    def __getitem__(self, key):
        self._saw(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._saw(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self._saw(key)
        if not dict.__contains__(self, key) and isinstance(default, dict):
            return _Recording(f"{self.path}{key}.", self.seen, default)
        return super().get(key, default)

    def keys(self):
        outer = self

        class Keys:  # ``key in d.keys()``
            def __contains__(self, key):
                return outer.__contains__(key)

            def __iter__(self):
                return iter(dict.keys(outer))

        return Keys()

    def __copy__(self):
        return _Recording(self.path, self.seen, dict(self))


def _model_fields(model, prefix):
    from pydantic import BaseModel
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        yield key
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _model_fields(t, key + ".")
            else:
                stack.extend(typing.get_args(t))


def deepspeed_keys() -> set:
    """Every dotted key this DeepSpeed's config parser (and ``deepspeed.initialize``) reads."""
    import deepspeed
    from deepspeed.runtime import config as ds_config_module
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    base = {"train_micro_batch_size_per_gpu": 1}
    seen: set = set()
    ds_config_module.DeepSpeedConfig(_Recording("", seen, base))
    top = sorted(k for k in seen if "." not in k)
    built = {}  # top-level key -> the pydantic models its block was handed to
    original = DeepSpeedConfigModel.__init__

    def noting(self, strict=False, **data):
        if data.pop(PROBE, None) is not None:
            built.setdefault(current, set()).add(type(self))
        original(self, strict=strict, **data)

    DeepSpeedConfigModel.__init__ = noting
    try:
        for current in top:
            try:
                ds_config_module.DeepSpeedConfig({**base, current: _Recording(current + ".", seen, {PROBE: 1})})
            except Exception:  # a block that is not a dict, a removed key: what was read is recorded
                pass
    finally:
        DeepSpeedConfigModel.__init__ = original
    for key, models in built.items():
        for model in models:
            seen.update(_model_fields(model, key + "."))
    source = inspect.getsource(deepspeed.initialize)
    seen.update(re.findall(r"config(?:\.get\(|\[)\s*[\"'](\w+)[\"']", source))
    seen.update(re.findall(r"[\"'](\w+)[\"']\s+in\s+config\b", source))
    removed = set(getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    removed |= {"zero_optimization." + k for k in getattr(ds_config_module, "_REMOVED_ZERO_CONFIG_KEYS", {})}
    return {k for k in seen if k not in removed}


@pytest.fixture(scope="module")
def ds_keys():
    return deepspeed_keys()


def test_the_walk_finds_deepspeeds_keys(ds_keys):
    """The walk reaches every kind of key (so an empty or shallow walk cannot pass the next test)."""
    for key in ("gradient_allreduce_op", "managed_gradient_accumulation", "zero_optimization.overlap_comm",
                "zero_optimization.offload_optimizer.device", "fp16.loss_scale_window", "bf16.enabled",
                "checkpoint.parallel_write.pipeline_stage", "data_types.grad_accum_dtype", "optimizer.type",
                "sequence_parallel_size", "torch_autocast.dtype"):
        assert key in ds_keys, key
    assert len(ds_keys) > 200


def test_every_deepspeed_key_is_classified(ds_keys):
    blocks = {k.rsplit(".", 1)[0] for k in ds_keys if "." in k}  # a block is classified by its keys
    unclassified = sorted(k for k in ds_keys - blocks if classify(k) is None)
    assert not unclassified, ("DeepSpeed reads keys ds_acco/config_keys.py does not classify (honour and test "
                              f"them, refuse them, or say why they are irrelevant): {unclassified}")


def test_every_entry_is_a_deepspeed_key(ds_keys):
    """No stale entry: each classifies at least one key this DeepSpeed reads."""
    stale = [p for p in KEYS if not any(classify(k) is KEYS[p] and _covers(p, k) for k in ds_keys)]
    assert not stale, stale


def _covers(pattern, key):
    import fnmatch
    return key == pattern or (pattern.endswith(".*") and (key + ".").startswith(pattern[:-1])) or (
        fnmatch.fnmatchcase(key, pattern))


def test_every_note_is_real():
    """An honoured key names a test that exists; a refused key names a row of the refusal table."""
    for path, (kind, note) in KEYS.items():
        assert kind in KINDS, path
        if kind == "honoured":
            file, name = note.split("::")
            with open(os.path.join(ROOT, file)) as f:
                assert f"def {name}(" in f.read(), (path, note)
        elif kind == "refused":
            assert note in REFUSALS, (path, note)
        else:
            assert note, path


BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "acco": {"enabled": True}}
# One refused value per refused entry: (config changes, the setting the error names).
REFUSED = {
    "managed_gradient_accumulation": ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation = false"),
    "fp16.fp16_master_weights_and_grads": ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
                                           "fp16_master_weights_and_grads"),
    "bf16.bf16_master_weights_and_grads": ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
                                           "bf16.bf16_master_weights_and_grads = true"),
    "bfloat16.bf16_master_weights_and_grads": ({"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True}},
                                               "bf16.bf16_master_weights_and_grads = true"),
    "torch_autocast.enabled": ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled = true"),
    "torch_autocast.dtype": ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, "with dtype torch.float16"),
    "zero_optimization.stage": ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage = 2"),
    "zero_optimization.offload_optimizer.*": ({"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "cpu"}}}, "offload_optimizer.device = 'cpu'"),
    "zero_optimization.cpu_offload": ({"zero_optimization": {"stage": 1, "cpu_offload": True}},
                                      "offload_optimizer.device = 'cpu'"),
    "zero_optimization.zenflow.*": ({"zero_optimization": {"stage": 1, "zenflow": {}}}, "zenflow is set"),
    "hybrid_engine.enabled": ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled = true"),
    "compile.deepcompile": ({"compile": {"deepcompile": True}}, "compile.deepcompile = true"),
    "expert_parallel.enabled": ({"expert_parallel": {"enabled": True}}, "expert_parallel.enabled = true"),
    "sequence_parallel_size": ({"sequence_parallel_size": 2}, "sequence_parallel_size = 2"),
    "data_efficiency.data_sampling.dynamic_batching.enabled": (
        {"data_efficiency": {"enabled": True, "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 64}}}},
        "dynamic_batching.enabled = true"),
}
# Values of refused keys that are honoured: the check passes.
ALLOWED = [{"managed_gradient_accumulation": True}, {"gradient_allreduce_op": "sum"},
           {"torch_autocast": {"enabled": True, "dtype": "bf16"}}, {"bf16": {"enabled": True}},
           {"compile": {"deepcompile": False}}, {"expert_parallel": {"enabled": False}}]


def _check(tmp_path, changes):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, **changes}))
    out, err = io.StringIO(), io.StringIO()
    return cli.check(str(path), out=out, err=err, world_size=1), err.getvalue()


def test_every_refused_entry_has_an_example():
    assert sorted(p for p, k in KEYS.items() if k.kind == "refused") == sorted(REFUSED)


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_refused_values_are_refused_by_python_m_ds_acco_check(tmp_path, path):
    """``python -m ds_acco check`` reports the refusal the engine raises: the setting, the row's fix."""
    changes, found = REFUSED[path]
    rc, err = _check(tmp_path, changes)
    assert rc == cli.EXIT_ERROR, err
    row = REFUSALS[KEYS[path].note]
    assert found in err and "fix: " in err, err
    assert max(re.split(r"\{[a-z_]+\}", row.fix), key=len) in err, err


@pytest.mark.parametrize("changes", ALLOWED, ids=[json.dumps(c) for c in ALLOWED])
def test_honoured_values_pass_the_check(tmp_path, changes):
    rc, err = _check(tmp_path, changes)
    assert rc == cli.EXIT_OK, err


def test_replaced_keys_are_the_ones_set():
    raw = {**BASE, "prescale_gradients": True, "zero_optimization": {"stage": 1, "overlap_comm": True,
                                                                     "reduce_bucket_size": 10}}
    assert sorted(replaced_keys(raw)) == ["prescale_gradients", "zero_optimization.overlap_comm",
                                  "zero_optimization.reduce_bucket_size"]


def test_keys_set_to_deepspeeds_default_are_not_warned_about():
    """Megatron's templates spell out ``"prescale_gradients": false`` and the bucket sizes: no warning
    for what changes nothing, one for each value that would change stock's communication."""
    raw = {**BASE, "prescale_gradients": False, "gradient_predivide_factor": 1.0, "bf16": {"check_grad_overflow": True},
           "zero_optimization": {"stage": 1, "overlap_comm": False, "reduce_bucket_size": 500_000_000,
                                 "contiguous_gradients": True, "allgather_partitions": False}}
    assert replaced_keys(raw) == ["zero_optimization.allgather_partitions"]


@pytest.mark.parametrize("acco", [{"accumulation": "dynamic"}, {"accumulation": "shared"}, {"weighting": "sample"},
                                  {"weighting": "token"}])
def test_a_sum_over_uneven_micro_batches_is_refused(tmp_path, acco):
    """Stock's "sum" is a sum of equal rank means; with uneven counts or weights ACCO's one global mean
    times the ranks is another number, so the combination is refused, not run."""
    rc, err = _check(tmp_path, {"gradient_allreduce_op": "sum", "acco": {"enabled": True, **acco}})
    assert rc == cli.EXIT_ERROR and 'gradient_allreduce_op = "sum" with accumulation' in err, err
    assert "fix: drop gradient_allreduce_op" in err, err
    from ds_acco.config import AccoConfig
    from ds_acco.config_deepspeed import deepspeed_config_at
    from ds_acco.config_keys import check_deepspeed_compat
    with pytest.raises(ValueError) as caught:
        check_deepspeed_compat(AccoConfig(enabled=True, **acco), deepspeed_config_at({**BASE, "gradient_allreduce_op": "sum"}, 2))
    assert caught.value.refusal == "sum_not_fixed"
