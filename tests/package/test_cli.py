"""``python -m ds_acco``: ``check`` prints the resolved "acco" block or the errors (exit 2);
``ab`` / ``advise`` / ``cluster-test`` are forwarded to ``ds_acco.bench``."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_acco import cli
from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def run_check(tmp_path, config) -> tuple[int, str, str]:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    rc = cli.check(str(path), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_check_prints_every_key_with_defaults(tmp_path):
    rc, out, err = run_check(tmp_path, {**BASE, "acco": {"enabled": True, "mode": "dpu"}})
    assert rc == 0, err
    block = json.loads(out)["acco"]
    assert block["enabled"] is True and block["mode"] == "dpu"
    assert block["accumulation"] == "fixed" and block["synchronous"] is False
    assert block["comm_timeout_s"] == 1800.0 and "metrics" in block and "weighting" in block


def test_check_resolves_dynamic_bounds(tmp_path):
    rc, out, err = run_check(tmp_path, {**BASE, "acco": {"enabled": True, "accumulation": "dynamic"}})
    assert rc == 0, err
    dynamic = json.loads(out)["acco"]["dynamic"]
    assert dynamic["max_micro_batches"] == 8  # 4 x the fixed phase length A/2 = 2


def test_check_without_block_says_stock(tmp_path):
    rc, out, err = run_check(tmp_path, BASE)
    assert rc == 0 and json.loads(out)["acco"]["enabled"] is False
    assert "stock" in err


@pytest.mark.parametrize("config, needle", [
    ({**BASE, "acco": {"enabled": True, "mod": "acco"}}, "acco.mod"),
    ({**BASE, "acco": {"enabled": True, "mode": "fast"}}, "acco.mode"),
    ({**BASE, "gradient_accumulation_steps": 3, "acco": {"enabled": True}}, "gradient_accumulation_steps = 3"),
    ({**BASE, "zero_optimization": {"stage": 2}, "acco": {"enabled": True}}, "zero_optimization.stage = 2"),
    ("{not json", "error"),
])
def test_check_errors_exit_2(tmp_path, config, needle):
    rc, out, err = run_check(tmp_path, config)
    assert rc == 2 and out == ""
    assert needle in err


def test_check_missing_file(tmp_path):
    err = io.StringIO()
    assert cli.check(str(tmp_path / "nope.json"), out=io.StringIO(), err=err) == 2
    assert "nope.json" in err.getvalue()


def test_check_with_hf_auto_values_skips_deepspeed_checks(tmp_path):
    rc, out, err = run_check(tmp_path, {**BASE, "gradient_accumulation_steps": "auto", "acco": {"enabled": True}})
    assert rc == 0 and "auto" in err


def test_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ds_acco", "check", str(REPO / "ds_configs" / "acco.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(40))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["acco"]["enabled"] is True


def test_bench_commands_are_forwarded(monkeypatch):
    calls = []
    fake = type(sys)("fake_bench_main")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, cli.BENCH_MODULE, fake)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    assert cli.main(["ab", "--steps", "3"]) == 0
    assert cli.main(["advise", "--help-me"]) == 0
    assert calls == [["ab", "--steps", "3"], ["advise", "--help-me"]]


def test_missing_bench_gives_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["advise"]) == 2
    assert "ds_acco.bench" in capsys.readouterr().err
