"""Build DeepSpeed's JIT-compiled CPU ops that the suite uses, once, before any test runs.

Run as a script (``python tests/prebuild.py``: scripts/test.sh does, and conftest.py's
``pytest_sessionstart`` does unless ``ACCO_TEST_OPS_BUILT=1``), outside every test's time limit.

Why: the first test that needs an op otherwise compiles it inside its own limit. On a busy
machine the compile (~30-50 s idle) can outlast that limit; the test's ranks are then killed
mid-compile and leave torch's build lock behind, and every later test waits on that lock until
its own limit.

torch 2.13's lock (torch/utils/file_baton.py, used by cpp_extension._jit_compile) is a plain file
``<TORCH_EXTENSIONS_DIR>/<op>/lock`` created with O_CREAT | O_EXCL; the builder keeps its file
descriptor open until it removes the file, and waiters poll until the file is gone (forever).
There is no flock and no owner pid in it. So a lock is stale when no live process has the file
open: we look through /proc/<pid>/fd. When some processes' descriptors cannot be read (other
users), a lock counts as stale only once it is older than ``STALE_AFTER_S``.
"""
from __future__ import annotations

import glob
import os
import sys
import time

OPS = ("ShareMemCommBuilder",  # deepspeed_shm_comm: every DeepSpeed start on CPU
       "FusedAdamBuilder")  # fused_adam: DeepSpeed's config-built AdamW without torch_adam
STALE_AFTER_S = 600.0


def default_extensions_dir() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(repo, ".cache", "torch_extensions")


def lock_holders(path: str) -> tuple[set[int], bool]:
    """Pids with ``path`` open, and whether every process's descriptors could be read."""
    target = os.path.realpath(path)
    holders, complete = set(), True
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            fds = os.listdir(os.path.join(proc, "fd"))
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(proc, "fd", fd)) == target:
                    holders.add(int(os.path.basename(proc)))
            except OSError:
                pass
    return holders, complete


def clear_stale_locks(root: str, log=print) -> list[str]:
    """Remove torch build locks under ``root`` that no live process holds; return their paths."""
    removed = []
    for lock in glob.glob(os.path.join(root, "*", "lock")):
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue
        holders, complete = lock_holders(lock)
        if holders:
            log(f"prebuild: {lock} is held by pid(s) {sorted(holders)}: a build is running, waiting for it")
            continue
        if not complete and age < STALE_AFTER_S:
            log(f"prebuild: {lock} has no visible holder but some processes could not be inspected; "
                f"leaving it (age {age:.0f} s < {STALE_AFTER_S:.0f} s)")
            continue
        try:
            os.unlink(lock)
            removed.append(lock)
            log(f"prebuild: removed stale build lock {lock} (age {age:.0f} s, no process holds it)")
        except FileNotFoundError:
            pass
    return removed


def build(ops=OPS, log=print) -> list[str]:
    """Load (compiling if needed) each op; return the names built or found."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator
    done = []
    for name in ops:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            log(f"prebuild: {name} not available on this accelerator, skipped")
            continue
        t0 = time.perf_counter()
        builder.load(verbose=False)
        log(f"prebuild: {builder.NAME} ready ({time.perf_counter() - t0:.1f} s)")
        done.append(builder.NAME)
    return done


def interpreter_bin_first() -> None:
    """Put this interpreter's bin directory first on PATH, so every build of the suite (this one,
    spawned ranks, launchers, which already do so) runs the same ``ninja``. torch calls ``ninja``
    from PATH; a venv's ninja (1.13: build log v7, rapidhash) and the system's (1.11: log v5,
    MurmurHash) each read the other's log as stale and rebuild everything, so a suite that mixed
    them recompiled DeepSpeed's ops (~30-50 s idle, 150 s loaded) at every switch."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path[:1] != [bindir]:
        os.environ["PATH"] = os.pathsep.join([bindir] + [p for p in path if p != bindir])


def main() -> int:
    interpreter_bin_first()
    root = os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    os.makedirs(root, exist_ok=True)
    clear_stale_locks(root)
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
