"""Remove the /dev/shm buffers DeepSpeed's CPU shm comm op left behind, never one a live job uses.

The op (deepspeed/ops/csrc/cpu/comm/shm.cpp) creates one ~66 MB file per rank and (master address,
port) and never removes it. ``shared_create`` opens the file with ``O_CREAT`` and keeps that
descriptor open for the rest of the process; it writes the whole buffer (tens of ms) and only then
maps it, and the peers open and map it after that. So a buffer that exists belongs to a live job if
and only if some live process has it open or mapped: both are read from /proc *after* listing the
files, so a buffer created while we look is kept (checking maps alone removed buffers still being
written -- a concurrent job's peer then waited for its file forever).

Used by tests/conftest.py after every test module (in each pytest-xdist worker: scripts/test.sh runs
2-3 at once, and another suite may run beside them) and, as a script, by .ci/run before the suite
(``python3 tests/shm_sweep.py``: every buffer no live process uses). Standard library only.
"""
from __future__ import annotations

import glob
import os
import sys

PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"


def in_use(paths) -> set:
    """Those of ``paths`` that some live process has open (/proc/PID/fd) or mapped (/proc/PID/maps);
    processes of other users are unreadable (their buffers are not ours to remove either: they
    cannot be, /dev/shm files are created 0600)."""
    wanted, used = set(paths), set()
    if not wanted:
        return used
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(proc, "maps")) as f:
                used.update(w for w in (line.split(None, 5)[-1].strip() for line in f
                                        if "deepspeed_allreduce_buffer_" in line) if w in wanted)
            for fd in os.listdir(os.path.join(proc, "fd")):
                try:
                    target = os.readlink(os.path.join(proc, "fd", fd))
                except OSError:
                    continue
                if target in wanted:
                    used.add(target)
        except OSError:  # the process ended meanwhile, or is another user's
            pass
    return used


def sweep(since: float = 0.0) -> int:
    """Remove the buffers modified since ``since`` (a time.time()) that no live process uses; how many."""
    candidates = []
    for path in glob.glob(PATTERN):
        try:
            if os.stat(path).st_mtime >= since:
                candidates.append(path)
        except FileNotFoundError:
            pass
    used = in_use(candidates)  # after the listing: a buffer being created is open by its creator
    removed = 0
    for path in candidates:
        if path not in used:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


if __name__ == "__main__":
    n = sweep()
    if n:
        print(f"shm_sweep: removed {n} unused DeepSpeed buffer(s) from /dev/shm", file=sys.stderr)
