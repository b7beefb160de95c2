"""The examples, a few steps each on 2 CPU ranks under the ``deepspeed`` launcher:
``pretrain_gpt.py`` (with a checkpoint and an exact resume), ``finetune_hf_trainer.py`` (HF Trainer
+ ``ds_acco.install()``) and ``train_gpt.py --ab``. The launcher comes from ``sys.executable``'s
directory, with a non-existent ``--hostfile`` (never ``/job/hostfile`` or ssh), on 127.0.0.1 (a launch
whose port was taken before rank 0 bound it is retried, see tests/dist.py); on failure the test shows
the command and the tail of its output."""
from __future__ import annotations

import json

import pytest

from timeouts import scaled
from dist import communicate
from test_launchers import REPO, base_env, run_deepspeed, start, tail, torchrun_cmd

pytestmark = pytest.mark.slow  # whole examples under the deepspeed launcher and torchrun
TIMEOUT_S = scaled(80)  # per example run; see tests/timeouts.py
EXAMPLES = REPO / "examples"


def deepspeed_run(tmp_path, script, *args) -> str:
    """Run ``deepspeed --num_gpus 2 script args``; return its output, or fail with its tail."""
    cmd, out, rc, timed_out = run_deepspeed(["--hostfile", str(tmp_path / "no-hostfile"), str(script),
                                             *map(str, args)], base_env(), TIMEOUT_S)
    if timed_out or rc != 0:
        why = f"timed out after {TIMEOUT_S:.0f} s" if timed_out else f"exited with status {rc}"
        pytest.fail(f"{script.name}: {why}\ncommand: {' '.join(cmd)}\n--- last lines of output ---\n{tail(out)}",
                    pytrace=False)
    return out


def result_of(out: str, tag: str) -> dict:
    lines = [line.split(tag + " ", 1)[1] for line in out.splitlines() if tag + " " in line]
    assert len(lines) == 1, f"expected one {tag} line (rank 0), found {len(lines)}\n{tail(out)}"
    return json.loads(lines[0])


def test_pretrain_gpt_checkpoint_and_exact_resume(tmp_path):
    script = EXAMPLES / "pretrain_gpt.py"
    ckpt = tmp_path / "ckpt"
    common = ["--deepspeed", "--deepspeed_config", REPO / "ds_configs" / "acco.json", "--train-iters", "4",
              "--eval-interval", "2", "--eval-iters", "2", "--seq-length", "32", "--no-progress"]
    full = result_of(deepspeed_run(tmp_path, script, *common, "--save", ckpt, "--save-interval", "2"),
                     "PRETRAIN_RESULT")
    assert (full["engine"], full["optimizer"], full["world_size"]) == ("AccoEngine", "AccoZeroOptimizer", 2)
    assert full["global_steps"] == 4 and sorted(full["heldout"]) == ["2", "4"]
    assert full["losses"]["4"] < full["losses"]["1"]
    assert {p.name for p in ckpt.iterdir()} >= {"iter_0000002", "iter_0000004", "latest"}

    (ckpt / "latest").write_text("iter_0000002")  # resume from the middle of the run above
    resumed = result_of(deepspeed_run(tmp_path, script, *common, "--load", ckpt), "PRETRAIN_RESULT")
    assert resumed["start_iteration"] == 2 and sorted(resumed["losses"]) == ["3", "4"]
    # Exact resume: the same losses and held-out loss as the uninterrupted run, bit for bit.
    assert resumed["losses"] == {k: full["losses"][k] for k in ("3", "4")}
    assert resumed["heldout"]["4"] == full["heldout"]["4"]
    assert resumed["global_steps"] == 4


def test_finetune_hf_trainer(tmp_path):
    pytest.importorskip("accelerate", reason="HF Trainer's DeepSpeed integration needs accelerate")
    out = deepspeed_run(tmp_path, EXAMPLES / "finetune_hf_trainer.py", "--max-steps", "4", "--train-sequences",
                        "200", "--output-dir", tmp_path / "out")
    r = result_of(out, "FINETUNE_RESULT")
    assert (r["engine"], r["optimizer"], r["world_size"]) == ("AccoEngine", "AccoZeroOptimizer", 2)
    assert r["hf_global_step"] == 4 and r["engine_global_steps"] == 4
    assert r["losses"][-1] < r["losses"][0]


def test_train_gpt_ab(tmp_path):
    json_out = tmp_path / "ab.json"
    out = deepspeed_run(tmp_path, EXAMPLES / "train_gpt.py", "--ab", "--steps", "2", "--eval-every", "0",
                        "--json-out", json_out)
    assert "final held-out loss" in out, tail(out)
    runs = json.loads(json_out.read_text())["runs"]
    assert runs["stock"]["engine"] == "DeepSpeedEngine" and runs["acco"]["engine"] == "AccoEngine"
    assert [r["step"] for r in runs["acco"]["records"]] == [1, 2]


def test_train_fsdp(tmp_path):
    """examples/train_fsdp.py under torchrun: FSDP2 + ACCO, a few steps, held-out loss at the end."""
    cmd = torchrun_cmd(str(EXAMPLES / "train_fsdp.py"), "--steps", "2")
    proc = start(cmd, base_env())
    out, timed_out = communicate(proc, TIMEOUT_S)
    assert not timed_out and proc.returncode == 0, f"command: {' '.join(cmd)}\n{tail(out)}"
    assert "done: 2 committed steps" in out and "held-out loss" in out, tail(out)
