"""``python -m ds_acco``: ``check`` prints the resolved "acco" block or the errors (exit 2), at the
data-parallel size given (``--world-size``) or implied by the batch keys, with the accumulation
from the config or from the trainer (``--gas``);
``ab`` / ``advise`` / ``cluster-test`` moved to ``python -m benchmarks`` and say so (exit 2)."""
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


LIGHTNING = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "acco": {"enabled": True}}
# Megatron-DeepSpeed's templates set all three batch keys: 32 = 4 x 4 x 2 data-parallel ranks.
MEGATRON = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
            "steps_per_print": 10, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
            "prescale_gradients": False, "bf16": {"enabled": True}, "wall_clock_breakdown": False,
            "acco": {"enabled": True}}


def run_check(tmp_path, config, world_size=None) -> tuple[int, str, str]:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    rc = cli.check(str(path), out=out, err=err, world_size=world_size)
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


@pytest.mark.parametrize("world_size, how", [(None, "train_batch_size / ("), (2, "--world-size")])
def test_check_multi_rank_config_at_its_data_parallel_size(tmp_path, world_size, how):
    rc, out, err = run_check(tmp_path, MEGATRON, world_size)
    assert rc == 0, err
    assert json.loads(out)["acco"]["enabled"] is True
    assert f"checked at data-parallel size 2 ({how}" in err


def test_check_size_that_contradicts_the_batch_keys_fails_clearly(tmp_path):
    rc, out, err = run_check(tmp_path, MEGATRON, world_size=3)
    assert rc == 2 and out == ""
    assert ("train_batch_size = 32 does not match --world-size 3: train_micro_batch_size_per_gpu x "
            "gradient_accumulation_steps = 4 x 4 = 16 samples per data-parallel rank, times 3 ranks is 48; fix: set "
            "train_batch_size to 48 for 3 data-parallel ranks, or check at --world-size 2") in err


def test_check_batch_keys_that_fit_no_size_fail_clearly(tmp_path):
    rc, out, err = run_check(tmp_path, {**MEGATRON, "train_batch_size": 30})
    assert rc == 2 and out == ""
    assert "train_batch_size = 30 is not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps" \
        in err and "fix: set train_batch_size to a multiple of it" in err


def test_check_world_size_reaches_deepspeeds_own_batch_checks(tmp_path):
    """Two of the three keys: DeepSpeed derives the third at the given size (here gas = 32 / (4 x 2) = 4,
    even, as mode acco needs; at size 4 it would be 2, at 8 it is 1 and refused)."""
    two = {k: v for k, v in MEGATRON.items() if k != "gradient_accumulation_steps"}
    assert run_check(tmp_path, two, world_size=2)[0] == 0
    rc, _, err = run_check(tmp_path, two, world_size=8)
    assert rc == 2 and "gradient_accumulation_steps = 1" in err


def test_check_world_size_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "megatron.json"
    path.write_text(json.dumps(MEGATRON))
    assert cli.main(["check", str(path), "--world-size", "2"]) == 0
    assert cli.main(["check", str(path), "--world-size", "3"]) == 2
    assert "does not match --world-size 3" in capsys.readouterr().err
    assert cli.main(["check", str(path), "--world-size", "0"]) == 2
    assert "--world-size 0: the data-parallel size must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("accumulation,rc", [("fixed", 0), ("dynamic", 2), ("shared", 2)])
def test_check_refuses_the_layouts_the_config_asks_for(tmp_path, accumulation, rc):
    """AutoTP from the config: fixed passes, per-rank phase lengths are refused, as at initialize."""
    config = {**BASE, "tensor_parallel": {"autotp_size": 2}, "acco": {"enabled": True, "accumulation": accumulation}}
    got, _, err = run_check(tmp_path, config, world_size=2)
    assert got == rc, err
    if rc:
        assert (f"acco.accumulation = '{accumulation}' with tensor parallelism (AutoTP: "
                "tensor_parallel.autotp_size = 2") in err and 'fix: set "accumulation": "fixed"' in err


LIGHTNING_CONFIG = REPO / "examples" / "lightning_ds_config.json"  # Lightning refuses gradient_accumulation_steps


def test_check_takes_the_accumulation_from_the_trainer(capsys):
    """Lightning's config has no gradient_accumulation_steps (the Trainer's accumulate_grad_batches fills it):
    without --gas DeepSpeed's default 1 fails ACCO and the error names --gas; with --gas 4 it passes at the
    trainer's value, with --gas 3 it fails and points at the trainer."""
    assert "gradient_accumulation_steps" not in json.loads(LIGHTNING_CONFIG.read_text())
    assert cli.main(["check", str(LIGHTNING_CONFIG)]) == 2
    err = capsys.readouterr().err
    assert "gradient_accumulation_steps = 1" in err and "Trainer(accumulate_grad_batches=K)), check with --gas K" in err
    assert cli.main(["check", str(LIGHTNING_CONFIG), "--gas", "4", "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["acco"]["enabled"] is True
    assert "gradient_accumulation_steps = 4 from the trainer (--gas; Lightning: Trainer(accumulate_grad_batches=4))" \
        in captured.err and "checked at data-parallel size 2" in captured.err
    assert cli.main(["check", str(LIGHTNING_CONFIG), "--gas", "3"]) == 2
    err = capsys.readouterr().err
    assert "gradient_accumulation_steps = 3: acco.mode 'acco'" in err and "comes from the trainer here (--gas)" in err
    assert cli.main(["check", str(LIGHTNING_CONFIG), "--gas", "0"]) == 2
    assert "--gas 0: the trainer's gradient accumulation must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("config, needle", [
    ({**BASE, "acco": {"enabled": True}}, "gradient_accumulation_steps = 4 in the config, but --gas 2"),
    ({**LIGHTNING, "zero_optimization": {"stage": 2}}, "zero_optimization.stage = 2"),
    ({**LIGHTNING, "acco": {"enabled": True, "mod": "acco"}}, "acco.mod"),
    ({**LIGHTNING, "acco": {"enabled": True, "accumulation": "dynamic"}}, None),
])
def test_check_with_gas_still_checks_everything_else(tmp_path, config, needle):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    rc = cli.check(str(path), out=out, err=err, gas=2)
    if needle is None:  # dynamic bounds resolved at the trainer's accumulation: 4 x A/2
        assert rc == 0, err.getvalue()
        assert json.loads(out.getvalue())["acco"]["dynamic"]["max_micro_batches"] == 4
    else:
        assert rc == 2 and needle in err.getvalue(), err.getvalue()


def test_check_missing_file(tmp_path):
    err = io.StringIO()
    assert cli.check(str(tmp_path / "nope.json"), out=io.StringIO(), err=err) == 2
    assert "nope.json" in err.getvalue()


def test_check_with_hf_auto_values_skips_deepspeed_checks(tmp_path):
    rc, out, err = run_check(tmp_path, {**BASE, "gradient_accumulation_steps": "auto", "acco": {"enabled": True}})
    assert rc == 0 and "auto" in err


@pytest.mark.slow  # a fresh interpreter running python -m ds_acco (~2 s)
def test_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ds_acco", "check", str(REPO / "ds_configs" / "acco.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(40))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["acco"]["enabled"] is True


@pytest.mark.parametrize("command", ["ab", "advise", "cluster-test"])
def test_moved_commands_name_their_new_home(command, capsys):
    # The benchmarks left the library: the old command fails (exit 2) and names the new one, whatever follows it.
    assert cli.main([command, "--steps", "3"]) == 2
    assert f"python -m benchmarks {command}" in capsys.readouterr().err
