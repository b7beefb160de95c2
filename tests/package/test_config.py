"""Bad "acco" blocks and incompatible DeepSpeed settings raise ValueErrors naming key, value and fix."""
import json
import re

import pytest

import ds_acco
from ds_acco.config import AccoConfig, acco_config_of, load_ds_config
from ds_acco.config_keys import check_deepspeed_compat
from ds_acco.core.checks.refusals import REFUSALS
from fixtures import ds_config
from dist import run_ranks
from timeouts import scaled
import lifecycle_workers
import workers


def test_dynamic_defaults_resolve_against_the_phase_length():
    cfg = AccoConfig.from_block({"enabled": True, "accumulation": "dynamic"})
    d = cfg.dynamic_bounds(8)
    assert (d.min_micro_batches, d.max_micro_batches, d.check_every) == (1, 16, 1)
    assert AccoConfig.from_block({"mode": "dpu", "accumulation": "dynamic"}).dynamic_bounds(8).max_micro_batches == 32


def test_defaults_and_absent_block():
    assert acco_config_of({}) == AccoConfig()
    assert not AccoConfig().enabled
    cfg = AccoConfig.from_block({"enabled": True, "mode": "dpu", "comm_timeout_s": 60})
    assert cfg.mode == "dpu" and cfg.comm_timeout_s == 60.0


@pytest.mark.parametrize("block,key,value", [
    ({"enabled": "yes"}, "enabled", "'yes'"),
    ({"enabled": 1}, "enabled", "1"),
    ({"mode": "ACCO"}, "mode", "'ACCO'"),
    ({"mode": "zero1"}, "mode", "'zero1'"),
    ({"accumulation": "fixd"}, "accumulation", "'fixd'"),
    ({"enable": True}, "enable", "True"),  # misspelt key
    ({"enabled": True, "overlap": True}, "overlap", "True"),
    ({"synchronous": "false"}, "synchronous", "'false'"),
    ({"comm_timeout_s": 0}, "comm_timeout_s", "0"),
    ({"comm_timeout_s": -5.0}, "comm_timeout_s", "-5.0"),
    ({"comm_timeout_s": "10"}, "comm_timeout_s", "'10'"),
    ({"weighting": "tokens"}, "weighting", "'tokens'"),
    ({"accumulation": "dynamic", "dynamic": {"min_micro_batches": 0}}, "dynamic.min_micro_batches", "0"),
    ({"accumulation": "dynamic", "dynamic": {"max_micro_batches": 1.5}}, "dynamic.max_micro_batches", "1.5"),
    ({"accumulation": "dynamic", "dynamic": {"check_every": 0}}, "dynamic.check_every", "0"),
    ({"accumulation": "dynamic", "dynamic": {"min": 2}}, "dynamic.min", "2"),
    ({"accumulation": "dynamic", "dynamic": {"min_micro_batches": 5, "max_micro_batches": 2}},
     "dynamic.max_micro_batches", "2"),
    ({"accumulation": "fixed", "dynamic": {"min_micro_batches": 2}}, "dynamic", "{'min_micro_batches': 2}"),
    ({"dynamic": []}, "dynamic", "[]"),
    ({"metrics": {"log_every": -1}}, "metrics.log_every", "-1"),
    ({"metrics": {"drift": True}}, "metrics.drift", "True"),
])
def test_bad_block_names_key_value_and_fix(block, key, value):
    with pytest.raises(ValueError) as info:
        AccoConfig.from_block(block)
    msg = str(info.value)
    assert f"acco.{key}" in msg and value in msg and "fix" in msg, msg


@pytest.mark.parametrize("block", [[], "acco", 3, True])
def test_block_must_be_an_object(block):
    with pytest.raises(ValueError, match="'acco' must be a JSON object.*fix"):
        AccoConfig.from_block(block)


def test_config_sources(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"acco": {"enabled": True}}))
    assert acco_config_of(load_ds_config(str(path))).enabled

    class Args:
        deepspeed_config = str(path)
    assert acco_config_of(load_ds_config(None, Args())).enabled
    assert acco_config_of(load_ds_config({"acco": {"enabled": False}})) == AccoConfig()


def test_bad_block_fails_before_any_distributed_work():
    with pytest.raises(ValueError, match="acco.mode"):
        ds_acco.initialize(model=object(), config={"acco": {"enabled": True, "mode": "x"}})


INIT_CASES = [  # (config overrides, model kind, words the message must hold, its row in core/checks/refusals.py)
    ({"gradient_accumulation_steps": 3}, "model", ["gradient_accumulation_steps", "3", "fix"], "odd_accumulation"),
    ({"gradient_accumulation_steps": 1}, "model", ["gradient_accumulation_steps", "1", "fix"], "odd_accumulation"),
    ({"zero_optimization": {"stage": 2}}, "model", ["zero_optimization.stage", "2", "fix"], "zero_stage"),
    ({"zero_optimization": {"stage": 3}}, "model", ["zero_optimization.stage", "3", "fix"], "zero_stage"),
    ({"zero_optimization": None}, "model", ["zero_optimization.stage", "0", "fix"], "zero_stage"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "model",
     ["offload_optimizer.device", "cpu", "fix"], "optimizer_offload"),
    ({"bf16": {"enabled": True}, "acco": {"enabled": True, "estimate_comm_dtype": "fp32"}}, "model",
     ["estimate_comm_dtype", "fp32", "wider", "fix"], "estimate_dtype_deepspeed"),
    ({"fp16": {"enabled": True}, "acco": {"enabled": True, "nonfinite": "raise"}}, "model",
     ["acco.nonfinite", "raise", "fp16.loss_scale", "fix"], "raise_on_overflow"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "model",
     ["fp16_master_weights_and_grads", "fix"], "fp16_master_weights"),
    ({"fp16": {"enabled": True}, "acco": {"enabled": True, "estimate_comm_dtype": "fp16"}}, "model",
     ["acco.estimate_comm_dtype", "fp16", "bf16", "fix"], "fp16_estimate_round"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, "model", ["torch_autocast", "fp16", "fix"],
     "fp16_autocast"),
    ({"torch_autocast": {"enabled": True}}, "model", ["torch_autocast", "unset", "fix"], "fp16_autocast"),
    ({}, "pipeline", ["PipelineModule", "fix"], "pipeline_module"),
    ({"managed_gradient_accumulation": False}, "model", ["managed_gradient_accumulation = false", "fix"],
     "unmanaged_accumulation"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "model",
     ["bf16.bf16_master_weights_and_grads = true", "fix"], "bf16_master_weights"),
    ({"compile": {"deepcompile": True}}, "model", ["compile.deepcompile = true", "fix"], "deepcompile"),
    ({"expert_parallel": {"enabled": True}}, "model", ["expert_parallel.enabled = true", "fix"], "moe_experts"),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 64}}}},
     "model", ["dynamic_batching.enabled = true", "fix"], "dynamic_batching"),
]


@pytest.fixture(scope="module")
def init_errors():
    return run_ranks(workers.init_errors, world=1, cases=[(o, k) for o, k, _, _ in INIT_CASES])[0]


@pytest.mark.parametrize("i", range(len(INIT_CASES)), ids=[str(c[0]) or c[1] for c in INIT_CASES])
def test_incompatible_deepspeed_settings(init_errors, i):
    msg = init_errors[i]
    assert msg.startswith("ValueError"), msg
    for part in INIT_CASES[i][2]:
        assert part in msg, msg
    # the row's reason and fix, as the table words them (its fields filled from the message)
    row = REFUSALS[INIT_CASES[i][3]]
    assert _words(row.why) in msg and _words(row.fix) in msg, msg


def _words(text: str) -> str:
    """The longest stretch of ``text`` without a {field}."""
    return max(re.split(r"\{[a-z_]+\}", text), key=len)


@pytest.mark.parametrize("block, key", [
    ({"zero_optimization": {"stage": 1, "zenflow": {}}}, "zenflow"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine"),
])
def test_deepspeed_settings_refused_as_deepspeed_parses_them(block, key):
    from deepspeed.runtime.config import DeepSpeedConfig
    raw = {**ds_config(4, {"enabled": True}), **block}
    with pytest.raises(ValueError) as caught:
        check_deepspeed_compat(acco_config_of(raw), DeepSpeedConfig(raw))
    assert caught.value.refusal == key


@pytest.mark.parametrize("blocks", [
    [{"enabled": True}, None],  # ACCO on one rank only
    [{"enabled": True, "mode": "acco"}, {"enabled": True, "mode": "dpu"}],
    [{"enabled": True, "accumulation": "fixed"}, {"enabled": True, "accumulation": "dynamic"}],
], ids=["enabled-on-one-rank", "modes-differ", "accumulation-differs"])
def test_ranks_disagreeing_is_refused_at_initialisation(blocks):
    errors = run_ranks(lifecycle_workers.mismatched_init, per_rank_acco=blocks, timeout=scaled(40))
    for key, msg in errors:
        assert key == "ranks_differ", msg
        assert "differs between ranks" in msg and "rank 0" in msg and "rank 1" in msg and "fix" in msg, msg


# -- the config sources deepspeed.initialize accepts ---------------------------------------------------
def test_configs_are_read_from_every_source_deepspeed_reads(tmp_path):
    """A dict, a JSON or HJSON file, base64-encoded JSON (DeepSpeed's autotuner passes those) and
    args.deepspeed_config: what DeepSpeed's own reader makes of them."""
    import argparse
    import base64

    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config as deepspeed_reads

    block = {"train_micro_batch_size_per_gpu": 2, "acco": {"enabled": True, "mode": "dpu"}}
    (tmp_path / "c.json").write_text(json.dumps(block))
    (tmp_path / "c.hjson").write_text("{\n  # a comment\n  train_micro_batch_size_per_gpu: 2\n"
                                      "  acco: {\n    enabled: true\n    mode: dpu\n  }\n}\n")
    encoded = base64.urlsafe_b64encode(json.dumps(block).encode()).decode()
    for source in (block, str(tmp_path / "c.json"), tmp_path / "c.json", str(tmp_path / "c.hjson"), encoded):
        got = load_ds_config(source)
        assert got == block == json.loads(json.dumps(deepspeed_reads(str(source) if not isinstance(source, dict)
                                                                     else source))), source
        assert acco_config_of(got).mode == "dpu"
    assert load_ds_config(args=argparse.Namespace(deepspeed_config=encoded)) == block


@pytest.mark.parametrize("source", ["missing.json", "bm90IGpzb24"])  # a path that is not there; base64 of "not json"
def test_an_unreadable_config_is_an_os_error(tmp_path, source):
    with pytest.raises(FileNotFoundError, match="no such DeepSpeed config file.*nor is it base64-encoded JSON"):
        load_ds_config(str(tmp_path / source) if source.endswith(".json") else source)


def test_the_opt_out_reads_off_only():
    from ds_acco.config import opted_out
    assert opted_out({"DS_ACCO": "off"}) and opted_out({"DS_ACCO": " OFF "})
    assert not opted_out({}) and not opted_out({"DS_ACCO": ""})
    for value in ("on", "1", "stock"):
        with pytest.raises(ValueError, match=f"DS_ACCO = '{value}': unknown value; fix: DS_ACCO=off"):
            opted_out({"DS_ACCO": value})


def test_a_block_with_an_unknown_key_and_an_invalid_value_is_refused_as_the_unknown_key():
    """The row is chosen by a rule, not by pydantic's first error: an unknown key first (the likelier
    typo); the message still names both."""
    from ds_acco.core.checks.refusals import REFUSALS, AccoRefusal
    for block in ({"enabled": "yes", "zzz": 1}, {"zzz": 1, "enabled": "yes"},
                  {"metrics": {"log_evry": 1}, "chunk_elements": 7}):
        with pytest.raises(AccoRefusal) as caught:
            AccoConfig.from_block(block)
        assert caught.value.refusal == "acco_unknown_key" and caught.value.row is REFUSALS["acco_unknown_key"]
        assert "unknown key" in str(caught.value) and "fix: set a valid value" in str(caught.value)


def test_the_lr_warm_up_is_read_from_deepspeeds_warm_up_schedulers_only():
    """What ``"sync_warmup_steps": "lr_warmup"`` and the normalised family's default read: DeepSpeed's
    warmup_num_steps (its default 1000, at least 2 as its schedulers make it); nothing for another or no
    scheduler, nor for a value the HF Trainer has not filled yet."""
    from ds_acco.config_deepspeed import lr_warmup_steps
    assert lr_warmup_steps("WarmupCosineLR", {"warmup_num_steps": 15, "total_num_steps": 300}) == 15
    assert lr_warmup_steps("WarmupDecayLR", {"warmup_num_steps": 1}) == 2
    assert lr_warmup_steps("WarmupLR", {}) == 1000 and lr_warmup_steps("WarmupLR", None) == 1000
    assert lr_warmup_steps("WarmupLR", {"warmup_num_steps": "auto"}) is None
    assert lr_warmup_steps("OneCycle", {"cycle_first_step_size": 10}) is None and lr_warmup_steps(None, None) is None


def test_sync_warmup_steps_takes_a_count_or_lr_warmup_and_names_both_when_refused():
    assert AccoConfig.from_block({"enabled": True, "sync_warmup_steps": "lr_warmup"}).sync_warmup_steps == "lr_warmup"
    for bad in ("lr", -1, 1.5, True):
        with pytest.raises(ValueError, match=r'acco.sync_warmup_steps = .*an integer, 0 or more\) or "lr_warmup"'):
            AccoConfig.from_block({"enabled": True, "sync_warmup_steps": bad})
