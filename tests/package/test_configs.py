"""Every ready config in ds_configs/ loads and validates: its "acco" block through ds_acco's model,
and, where ACCO is enabled, the DeepSpeed settings ACCO depends on through DeepSpeed's own parser."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from ds_acco.config import ACCO_KEY, acco_config_of
from ds_acco.config_keys import check_deepspeed_compat

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "ds_configs").glob("*.json"))
EXPECTED = {"zero1.json", "acco.json", "dpu.json", "acco_dynamic.json", "acco_shared.json", "acco_bf16.json",
            "acco_fp16.json"}


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_the_ready_configs_are_there():
    assert EXPECTED <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    raw = load(path)
    acco = acco_config_of(raw)  # raises ValueError naming the key on any bad value
    ds = DeepSpeedConfig(raw)  # DeepSpeed's own validation (batch sizes, zero block, optimizer...)
    assert ds.zero_enabled and ds.zero_config.stage == 1
    if acco.enabled:
        check_deepspeed_compat(acco, ds)
    else:
        assert ACCO_KEY not in raw, f"{path.name}: a disabled block belongs in no ready config; drop it"


def test_stock_baseline_has_no_acco_block():
    assert ACCO_KEY not in load(CONFIGS[0].parent / "zero1.json")


def test_acco_configs_differ_from_the_baseline_only_where_they_must():
    base = load(CONFIGS[0].parent / "zero1.json")
    allowed = {ACCO_KEY, "bf16", "fp16", "communication_data_type"}
    for name in EXPECTED - {"zero1.json"}:
        raw = load(CONFIGS[0].parent / name)
        assert acco_config_of(raw).enabled, name
        changed = {k for k in raw.keys() | base.keys() if raw.get(k) != base.get(k)}
        assert changed <= allowed, f"{name} changes {changed - allowed} as well: the A/B would compare more than ACCO"


def test_specific_settings():
    d = acco_config_of(load(CONFIGS[0].parent / "acco_dynamic.json"))
    assert d.accumulation == "dynamic" and d.mode == "acco"
    s = acco_config_of(load(CONFIGS[0].parent / "acco_shared.json"))
    assert s.accumulation == "shared" and s.mode == "acco" and s.dynamic is None
    raw = load(CONFIGS[0].parent / "acco_bf16.json")
    ds = DeepSpeedConfig(raw)
    assert ds.bfloat16_config.enabled and "data_types" not in raw  # bf16 accumulation: ZeRO-1, not BF16_Optimizer
    assert str(ds.communication_data_type) == "torch.bfloat16"
    ds = DeepSpeedConfig(load(CONFIGS[0].parent / "acco_fp16.json"))
    assert ds.float16_config.enabled and ds.float16_config.loss_scale == 0  # dynamic loss scaling
