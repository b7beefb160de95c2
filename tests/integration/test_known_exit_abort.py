"""The launch tests' one relaunch (tests/dist.py, KNOWN_EXIT_ABORT) is taken only on the known exit
abort's signature, once, and says so: any other failure, and a second abort, still fail the test."""
import subprocess
import sys

import pytest

from dist import KNOWN_EXIT_ABORT, communicate

NEEDS_DEEPSPEED_OPS = False

SCRIPT = """import os, sys
path = sys.argv[1]
n = int(open(path).read()) if os.path.exists(path) else 0
open(path, 'w').write(str(n + 1))
print('RESULT', n, flush=True)
if n < int(sys.argv[2]):
    print(sys.argv[3], flush=True)
    sys.exit(134)
"""


def _start(tmp_path, failures, message):
    cmd = [sys.executable, "-c", SCRIPT, str(tmp_path / "count"), str(failures), message]

    def start():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        proc.relaunch = start
        return proc
    return start()


def test_the_known_abort_is_run_once_more_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="known exit abort"):
        proc = _start(tmp_path, 1, KNOWN_EXIT_ABORT)
        out, timed_out = communicate(proc, 60)
    assert not timed_out and proc.returncode == 0 and "RESULT 1" in out
    assert (tmp_path / "count").read_text() == "2"


def test_a_second_abort_fails(tmp_path):
    with pytest.warns(UserWarning, match="known exit abort"):
        proc = _start(tmp_path, 2, KNOWN_EXIT_ABORT)
        out, _ = communicate(proc, 60)
    assert proc.returncode == 134 and (tmp_path / "count").read_text() == "2"


def test_any_other_failure_is_not_run_again(tmp_path):
    proc = _start(tmp_path, 1, "Segmentation fault")
    out, _ = communicate(proc, 60)
    assert proc.returncode == 134 and (tmp_path / "count").read_text() == "1"
