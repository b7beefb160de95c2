"""ACCO in a script nobody edits: ``python -m ds_acco run SCRIPT.py ARGS`` under torchrun and the
deepspeed launcher (its ``--module`` mode), the start-up banner on rank 0, and stock DeepSpeed when
the same script runs without ds_acco.

``tests/launch/plain_ds_script.py`` calls ``deepspeed.initialize`` itself and never imports
ds_acco; the config has an enabled ``"acco"`` block, which stock DeepSpeed ignores.
"""
import json

import pytest

from test_launchers import REPO, WORLD, base_env, free_port, launcher, run_job, tail  # noqa: F401

SCRIPT = "tests/launch/plain_ds_script.py"
TAG = "PLAIN_RESULT "
BANNER = "ACCO is on (DeepSpeed ZeRO-1): mode=acco, 2 micro-batches per phase (gradient_accumulation_steps=4)"


def _config(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
           "acco": {"enabled": True, "mode": "acco"}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(label, cmd):
    import subprocess
    from test_launchers import TIMEOUT_S, _communicate
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out, timed_out = _communicate(proc, TIMEOUT_S)
    assert not timed_out and proc.returncode == 0, f"{label}: rc={proc.returncode}\n{' '.join(cmd)}\n{tail(out)}"
    results = [json.loads(line[line.index(TAG) + len(TAG):]) for line in out.splitlines() if TAG in line]
    assert len(results) == 1, f"{label}: expected one {TAG.strip()} line\n{tail(out)}"
    return results[0], out


def _torchrun(*args):
    return launcher("torchrun", "torch.distributed.run") + ["--nproc_per_node", str(WORLD), "--master_addr",
                                                            "127.0.0.1", "--master_port", str(free_port()), *args]


def test_run_under_torchrun_turns_acco_on(tmp_path):
    cfg = _config(tmp_path)
    res, out = _run("torchrun -m ds_acco run", _torchrun("-m", "ds_acco", "run", SCRIPT, "--deepspeed", cfg))
    assert (res["engine"], res["optimizer"], res["world_size"]) == ("AccoEngine", "AccoZeroOptimizer", WORLD)
    assert res["global_steps"] == 1  # 2 steps of 4 micro-batches: the second commit is still in flight
    assert out.count(BANNER) == 1, tail(out)  # rank 0 only


def test_run_under_deepspeed_launcher_module_mode(tmp_path):
    cfg = _config(tmp_path)
    ds = launcher("deepspeed")
    if not ds:
        pytest.fail("no 'deepspeed' launcher next to the interpreter or on PATH")
    cmd = ds + ["--num_gpus", str(WORLD), "--master_port", str(free_port()), "--module", "ds_acco", "run", SCRIPT,
                "--deepspeed", cfg]
    res, out = _run("deepspeed --module ds_acco run", cmd)
    assert (res["engine"], res["world_size"]) == ("AccoEngine", WORLD)
    assert out.count(BANNER) == 1, tail(out)


def test_without_ds_acco_the_script_is_stock(tmp_path):
    res, out = _run("torchrun (stock)", _torchrun(SCRIPT, "--deepspeed", _config(tmp_path)))
    assert (res["engine"], res["optimizer"]) == ("DeepSpeedEngine", "DeepSpeedZeroOptimizer")
    assert res["global_steps"] == 2
    assert "ACCO is on" not in out
