"""The README's Accelerate command, run as written on 2 CPU ranks:

    accelerate launch --config_file examples/accelerate_config.yaml -m ds_acco run examples/accelerate_loop.py

It must train ACCO (rank 0's banner, an ACCO engine, the data sharded over 2 processes, six
committed steps, a held-out loss below the first training loss) and exit 0. The same launch
without ``-m ds_acco run`` must be refused by the guard a ds_acco wheel installs
(``ds_acco_autoinstall.pth``) before any engine trains: every rank stops with the launch fix, no
result, no banner.

Both launches run as from an installed wheel: the suite's own install is editable, and editable
installs do not load the ``.pth`` (there the unrouted launch trains stock ZeRO-1, as the README
says). So every process of the job gets the wheel's ``.pth`` file processed the way ``site``
processes site-packages (``site.addsitedir`` on a folder holding a copy of it, from a
``sitecustomize`` on PYTHONPATH), and the package itself from the checkout on PYTHONPATH.

``accelerate launch`` binds the rendezvous port it is given (``--main_process_port``, added to the
README's command; the config file leaves it at Accelerate's default): a launch that lost its port to
another process is retried on another (tests/dist.py ``launch``).
"""
from __future__ import annotations

import json
import math
import shlex

import pytest

from dist import launch
from timeouts import scaled
from test_launchers import REPO, base_env, launcher, start, tail

pytestmark = pytest.mark.slow  # two whole jobs under accelerate launch
TIMEOUT_S = scaled(120)  # per launch; see tests/timeouts.py
README_COMMAND = ("accelerate launch --config_file examples/accelerate_config.yaml -m ds_acco run "
                  "examples/accelerate_loop.py")
BANNER = "ACCO is on (DeepSpeed ZeRO-1): mode=acco, 2 micro-batches per phase (gradient_accumulation_steps=4)"
RESULT_TAG = "ACCELERATE_RESULT"
REFUSAL = 'DeepSpeed ignores the "acco" block'
FIX = "`accelerate launch -m ds_acco run SCRIPT.py ARGS`"


def installed_guard_env(tmp_path) -> dict:
    """The suite's launch environment, plus the wheel's .pth processed at every interpreter start."""
    site_dir, boot = tmp_path / "site-packages", tmp_path / "boot"
    site_dir.mkdir()
    boot.mkdir()
    (site_dir / "ds_acco_autoinstall.pth").write_text((REPO / "ds_acco_autoinstall.pth").read_text())
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    env = base_env()  # PYTHONPATH: the checkout (the .pth looks ds_acco up on sys.path, as in site-packages)
    env["PYTHONPATH"] = f"{boot}:{env['PYTHONPATH']}"
    env.pop("DS_ACCO", None)
    env.pop("DS_ACCO_INSTALL", None)
    return env


def accelerate_launch(argv: list, env: dict) -> tuple:
    """Run ``accelerate launch`` with ``argv`` (after ``launch``) from the checkout; (cmd, output, rc)."""
    exe = launcher("accelerate", module="accelerate.commands.accelerate_cli")
    if not exe:
        pytest.fail("no 'accelerate' next to the interpreter or on PATH (pip install accelerate)")
    proc, out, timed_out = launch(lambda port: start([*exe, "launch", "--main_process_port", str(port), *argv], env),
                                  TIMEOUT_S)
    if timed_out:
        pytest.fail(f"timed out after {TIMEOUT_S:.0f} s: {proc.args}\n{tail(out)}", pytrace=False)
    return proc.args, out, proc.returncode


def results(out: str) -> list:
    return [json.loads(line.split(RESULT_TAG + " ", 1)[1]) for line in out.splitlines() if RESULT_TAG + " " in line]


def test_readme_accelerate_command_trains_acco_and_the_unrouted_launch_is_refused(tmp_path):
    readme = (REPO / "README.md").read_text()
    assert README_COMMAND in readme, "the README's Accelerate command changed: update this test with it"
    argv = shlex.split(README_COMMAND)[2:]  # after `accelerate launch`
    env = installed_guard_env(tmp_path)

    cmd, out, rc = accelerate_launch(argv, env)
    assert rc == 0, f"{cmd} exited with {rc}\n{tail(out)}"
    assert out.count(BANNER) == 1, f"expected rank 0's ACCO banner once\n{tail(out)}"
    found = results(out)
    assert len(found) == 1, f"expected one result line (rank 0's), got {len(found)}: every rank believed it was " \
        f"the main process (Accelerate saw one process per rank: data not sharded)\n{tail(out)}"
    result = found[0]
    assert (result["engine"], result["optimizer"]) == ("AccoEngine", "AccoZeroOptimizer"), result
    assert result["world_size"] == 2, result  # Accelerate saw both processes: the data was sharded
    assert result["gradient_accumulation_steps"] == 4 and result["global_steps"] == 6, result
    assert len(result["losses"]) == 24 and all(math.isfinite(x) for x in result["losses"]), result
    assert result["heldout_loss"] < result["losses"][0], result  # it trained
    assert math.isfinite(result["export_checksum"]), result

    unrouted = [a for a in argv if a not in ("-m", "ds_acco", "run")]
    assert unrouted == ["--config_file", "examples/accelerate_config.yaml", "examples/accelerate_loop.py"]
    cmd, out, rc = accelerate_launch(unrouted, env)
    assert rc not in (0, None), f"the launch without ds_acco was not refused\n{tail(out)}"
    assert out.count(REFUSAL) >= 2 and FIX in out, f"expected the guard's refusal on both ranks\n{tail(out)}"
    assert not results(out) and BANNER not in out, tail(out)
