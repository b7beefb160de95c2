"""The README's Lightning command, run as written on 2 CPU ranks under the real ``lightning.Trainer``:

    torchrun --nproc_per_node 2 -m ds_acco run examples/lightning_train.py

``DeepSpeedStrategy(config=examples/lightning_ds_config.json)`` (no ``gradient_accumulation_steps``:
Lightning fills it from ``accumulate_grad_batches=4``) must build an ACCO engine that trains (the
held-out loss falls); every validation must evaluate the committed weights θ -- also when the module
keeps its layers in training mode, so that Lightning never calls ``engine.eval()``
(tests/launch/lightning_no_eval.py); ``"synchronous": true`` (every round inline) must train the same, bit for bit (checked together with
the train-mode validation, in one launch), and a Lightning checkpoint saved after 2 epochs (by the
uninterrupted run itself, as ``ModelCheckpoint`` saves: tests/launch/lightning_save_after.py) and
resumed for a third must end on exactly the weights of 3 uninterrupted epochs. The same command without
``-m ds_acco run`` must be refused by the guard on every rank.

As in tests/integration/test_accelerate_example.py every process gets the wheel's guard
(``ds_acco_autoinstall.pth``) processed the way ``site`` does, from a ``sitecustomize`` on
PYTHONPATH. On the ranks (``LOCAL_RANK`` set) the same ``sitecustomize`` imports
tests/launch/lightning_cpu.py, which lifts the three checks by which Lightning 2.6 refuses
DeepSpeed on a CPU: test-only, nothing of it is in the library or the example.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dist import TORCHRUN_RENDEZVOUS, communicate
from test_accelerate_example import installed_guard_env
from test_launchers import REPO, launcher, start, tail
from timeouts import scaled

# Not imported here: importing Lightning in the suite's process changes the standard library's members
# that benchmarks.data's corpus reads (tests/benchmarks/test_data.py); the ranks import it.
pytestmark = [pytest.mark.slow,  # whole jobs under torchrun
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")]
TIMEOUT_S = scaled(120)  # per launch; see tests/timeouts.py
README_COMMAND = "torchrun --nproc_per_node 2 -m ds_acco run examples/lightning_train.py"
RESULT_TAG = "LIGHTNING_RESULT"
SAVED_TAG = "LIGHTNING_SAVED"  # tests/launch/lightning_save_after.py
BANNER = "ACCO is on (DeepSpeed ZeRO-1): mode=acco, 2 micro-batches per phase (gradient_accumulation_steps=4)"
REFUSAL = 'this DeepSpeed config has "acco": {"enabled": true}, but the engine being built is a stock DeepSpeedEngine'


def lightning_env(tmp_path) -> dict:
    env = installed_guard_env(tmp_path)
    boot = tmp_path / "boot"  # installed_guard_env's sitecustomize: add the CPU patches on the ranks
    with open(boot / "sitecustomize.py", "a") as f:
        f.write(f"import os, sys\nif os.environ.get('LOCAL_RANK') is not None:\n"
                f"    sys.path.insert(0, {str(REPO / 'tests' / 'launch')!r})\n    import lightning_cpu\n"
                f"    if os.environ.get('ACCO_TEST_LIGHTNING_SAVE_AFTER'):\n        import lightning_save_after\n")
    return env


def torchrun(argv: list, env: dict) -> tuple:
    """``torchrun --nproc_per_node 2`` (its store bound by itself on port 0) with ``argv``; (cmd, out, rc)."""
    cmd = [*launcher("torchrun", module="torch.distributed.run"), "--nproc_per_node", "2", *TORCHRUN_RENDEZVOUS,
           *argv]
    proc = start(cmd, env)
    out, timed_out = communicate(proc, TIMEOUT_S)
    if timed_out:
        pytest.fail(f"timed out after {TIMEOUT_S:.0f} s: {cmd}\n{tail(out)}", pytrace=False)
    return cmd, out, proc.returncode


def tagged(out: str, tag: str) -> list:
    return [json.loads(line.split(tag + " ", 1)[1]) for line in out.splitlines() if tag + " " in line]


def run(env: dict, script: str, out_dir, *args) -> dict:
    """One routed job; rank 0's result, with its final (committed) weights under "final" (and under
    "saved", what tests/launch/lightning_save_after.py printed, if the environment asked it to save)."""
    cmd, out, rc = torchrun(["-m", "ds_acco", "run", script, "--out", str(out_dir), *args], env)
    assert rc == 0, f"{cmd} exited with {rc}\n{tail(out)}"
    assert out.count(BANNER) == 1, f"expected rank 0's ACCO banner once\n{tail(out)}"
    found = tagged(out, RESULT_TAG)
    assert len(found) == 1, tail(out)
    result = found[0]
    result["saved"] = tagged(out, SAVED_TAG)
    assert (result["engine"], result["optimizer"], result["world_size"]) == ("AccoEngine", "AccoZeroOptimizer", 2)
    result["final"] = torch.load(out_dir / "final.pt")
    return result


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_readme_lightning_command_trains_acco_validates_theta_resumes_and_reproduces(tmp_path):
    readme = (REPO / "README.md").read_text()
    assert README_COMMAND in readme, "the README's Lightning command changed: update this test with it"
    env = lightning_env(tmp_path)
    script = README_COMMAND.split(" run ", 1)[1]

    # The uninterrupted run also saves a Lightning checkpoint after its 2nd epoch (as ModelCheckpoint
    # would; tests/launch/lightning_save_after.py), resumed below for the third.
    full = run({**env, "ACCO_TEST_LIGHTNING_SAVE_AFTER": f"2 {tmp_path / 'ckpt'}"}, script, tmp_path / "full",
               "--epochs", "3")
    assert full["gradient_accumulation_steps"] == 4 and full["global_steps"] == 18, full  # 3 x 24 / 4
    assert full["saved"] == [{"global_step": 12, "epoch": 1}], full["saved"]  # 2 x 24 / 4
    assert len(full["train_losses"]) == 72 and full["val_losses"][-1] < full["val_losses"][0] < \
        full["train_losses"][0], full  # it trained
    # Each validation evaluated θ: the last one (after the last commit) read exactly the exported weights.
    assert full["val_checksums"][-1] == full["final_checksum"], full

    # Validation without engine.eval() (train-mode layers) still reads θ, and every round inline on the
    # compute thread ("synchronous": true) trains the same, bit for bit: one launch checks both (either
    # bug alone fails it: a validation on θ̃ changes the checksums, a synchronous schedule that differs
    # changes the losses and the weights).
    config = json.loads((REPO / "examples" / "lightning_ds_config.json").read_text())
    config["acco"]["synchronous"] = True
    (tmp_path / "sync.json").write_text(json.dumps(config))
    no_eval = run(env, "tests/launch/lightning_no_eval.py", tmp_path / "no_eval", "--epochs", "3",
                  "--config", str(tmp_path / "sync.json"))
    assert no_eval["val_checksums"] == full["val_checksums"], (no_eval["val_checksums"], full["val_checksums"])
    assert no_eval["train_losses"] == full["train_losses"] and same_weights(no_eval["final"], full["final"])

    # The run's Lightning checkpoint after 2 epochs, resumed for the third: the weights of 3 uninterrupted
    # epochs (saving it changed nothing in the run: the run without a save above trained the same).
    assert no_eval["saved"] == [], no_eval["saved"]
    # It also saves after fit() returns (the example's --save), which must leave the weights as they are.
    resumed = run(env, script, tmp_path / "resumed", "--epochs", "3", "--resume", str(tmp_path / "ckpt"),
                  "--save", str(tmp_path / "end"))
    assert resumed["global_steps"] == 18 and resumed["train_losses"] == full["train_losses"][48:], resumed
    assert resumed["val_checksums"] == full["val_checksums"][2:], (resumed["val_checksums"], full["val_checksums"])
    assert same_weights(resumed["final"], full["final"])
    assert (tmp_path / "end" / "latest").is_file(), sorted(p.name for p in (tmp_path / "end").iterdir())



def test_unrouted_lightning_launch_is_refused(tmp_path):
    argv = [a for a in README_COMMAND.split()[1:] if a not in ("-m", "ds_acco", "run")]
    assert argv == ["--nproc_per_node", "2", "examples/lightning_train.py"]
    cmd, out, rc = torchrun(argv[2:], lightning_env(tmp_path))
    assert rc not in (0, None), f"the launch without ds_acco was not refused\n{tail(out)}"
    assert out.count(REFUSAL) >= 2 and "torchrun ... -m ds_acco run" in out, tail(out)
    assert RESULT_TAG not in out and BANNER not in out, tail(out)
