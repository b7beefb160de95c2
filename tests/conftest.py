"""Suite-wide hygiene.

DeepSpeed's CPU shared-memory comm op creates a ~66 MB file per rank in /dev/shm for every
(master address, port) it initialises with, and never removes it. A suite that starts dozens
of rank pairs would fill /dev/shm (RAM) with them; after every test module, those created since
this session started that no live process uses are removed (tests/shm_sweep.py).

At session start all ranks and launchers are pointed at one TORCH_EXTENSIONS_DIR; after
collection, before any test and outside every test's time limit, build locks left by killed
compiles are removed and DeepSpeed's CPU ops are built (tests/prebuild.py), unless
``ACCO_TEST_OPS_BUILT=1`` (scripts/test.sh sets it after building them itself) or no collected
module needs them.
"""
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
import shm_sweep

_SESSION_START = time.time() - 1


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


def pytest_collection_modifyitems(config, items):
    """Modules with whole jobs (a ``slow`` test) first, each module's tests kept together and in order.
    Under pytest-xdist (scripts/test.sh: ``--dist loadfile``) the workers take modules in this order,
    so the longest modules start first instead of one of them starting last on an otherwise idle
    machine; in one session the order changes nothing a test may depend on (each module's fixtures
    are its own). The same order in every worker: xdist requires identical collections."""
    module = lambda item: item.nodeid.split("::")[0]
    first = {}
    for i, item in enumerate(items):
        first.setdefault(module(item), i)
    slow = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (module(item) not in slow, first[module(item)]))


@pytest.fixture(scope="module", autouse=True)
def _clean_deepspeed_shm():
    yield
    shm_sweep.sweep(_SESSION_START)
