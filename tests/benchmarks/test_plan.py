"""The A/B runner's plan (``--dry-run``): every variant's config resolved and checked, every rank's
command built, nothing launched; a config a variant cannot run is refused before any rank starts."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import runner
from ds_acco import configs


def test_dry_run_plan_resolves_everything_and_launches_nothing(tmp_path):
    spec = runner.ABSpec(network="loopback", variants=("stock", "fixed", "fsdp_dpu"), base_config="zero1.json")
    plan = runner.plan(spec, str(tmp_path / "out" / "x.raw.json"))
    assert plan["base_config"] == configs.path("zero1.json")
    assert plan["variants"]["fixed"]["acco"]["enabled"] is True and "acco" not in plan["variants"]["stock"]
    assert [r["env"]["RANK"] for r in plan["ranks"]] == ["0", "1"]
    for r in plan["ranks"]:
        assert r["command"][:3] == [sys.executable, "-m", "benchmarks.worker"]
        assert "PYTHONPATH" not in r["env"] and "TORCH_EXTENSIONS_DIR" not in r["env"]
    assert not (tmp_path / "out").exists()


def test_dry_run_refuses_a_config_a_variant_cannot_run(tmp_path):
    bad = tmp_path / "stage2.json"
    bad.write_text(json.dumps({**json.load(open(configs.path("zero1.json"))), "zero_optimization": {"stage": 2}}))
    spec = runner.ABSpec(network="loopback", variants=("stock", "fixed"), base_config=str(bad))
    with pytest.raises(ValueError, match="variant fixed: zero_optimization.stage = 2"):
        runner.plan(spec, str(tmp_path / "x.raw.json"))
