"""Suite-wide hygiene.

DeepSpeed's CPU shared-memory comm op creates a ~66 MB file per rank in /dev/shm for every
(master address, port) it initialises with, and never removes it. A suite that starts dozens
of rank pairs would fill /dev/shm (RAM) with them; every test module cleans up the ones this
session created once its ranks are gone.

At session start all ranks and launchers are pointed at one TORCH_EXTENSIONS_DIR; after
collection, before any test and outside every test's time limit, build locks left by killed
compiles are removed and DeepSpeed's CPU ops are built (tests/prebuild.py), unless
``ACCO_TEST_OPS_BUILT=1`` (scripts/test.sh sets it after building them itself) or no collected
module needs them.
"""
import glob
import os

# setuptools first: torch.utils.cpp_extension (imported by DeepSpeed's JIT op loader, e.g. inside
# deepspeed.init_distributed) imports setuptools, whose distutils shim asserts if some earlier test
# in this process had imported the standard library's distutils.
import setuptools  # noqa: F401,E402
import subprocess
import sys
import time

import pytest

import prebuild

_SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"
_SESSION_START = time.time() - 1


def _mapped_shm_buffers() -> set:
    """The DeepSpeed shm buffers some live process has mapped (from every readable /proc/PID/maps)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if "deepspeed_allreduce_buffer_" in line)
        except OSError:  # the process ended, or belongs to another user (whose files are not ours to remove)
            pass
    return mapped


def sweep_deepspeed_shm(since: float = _SESSION_START) -> int:
    """Remove DeepSpeed shm buffers created since ``since`` that no live process maps (a DeepSpeed
    job running beside the suite keeps its own: removing one it is still opening hangs its peer
    rank at start-up); returns how many."""
    removed = 0
    in_use = _mapped_shm_buffers()
    for path in glob.glob(_SHM_PATTERN):
        try:
            if os.stat(path).st_mtime >= since and path not in in_use:
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def pytest_sessionstart(session):
    # One extensions dir for everything the suite starts (spawned ranks, launchers, bench
    # subprocesses inherit it), so each op is compiled once per machine, not once per dir.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", prebuild.default_extensions_dir())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    prebuild.interpreter_bin_first()  # one ninja for every build (see prebuild.py)


def pytest_collection_finish(session):
    """After collection, before the first test: build the ops unless already built or no collected
    module needs them (modules that start no DeepSpeed say ``NEEDS_DEEPSPEED_OPS = False``)."""
    if os.environ.get("ACCO_TEST_OPS_BUILT", "") == "1":
        return
    modules = {getattr(item, "module", None) for item in session.items}
    if not any(getattr(m, "NEEDS_DEEPSPEED_OPS", True) for m in modules if m is not None):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    say = tr.write_line if tr is not None else (lambda line: sys.stderr.write(line + "\n"))
    t0 = time.perf_counter()
    # A subprocess: the session itself never imports DeepSpeed's ops; no time limit on purpose.
    r = subprocess.run([sys.executable, prebuild.__file__], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("prebuild:") and ("removed" in line or "held" in line or time.perf_counter() - t0 > 20):
            say(line)
    if r.returncode != 0:
        say(f"conftest: building DeepSpeed's CPU ops failed (exit {r.returncode}); tests that start DeepSpeed "
            f"will fail:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    else:
        os.environ["ACCO_TEST_OPS_BUILT"] = "1"


@pytest.fixture(scope="module", autouse=True)
def _clean_deepspeed_shm():
    yield
    sweep_deepspeed_shm()
