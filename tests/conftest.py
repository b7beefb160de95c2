"""Suite-wide hygiene.

DeepSpeed's CPU shared-memory comm op creates a ~66 MB file per rank in /dev/shm for every
(master address, port) it initialises with, and never removes it. A suite that starts dozens
of rank pairs would fill /dev/shm (RAM) with them; every test module cleans up the ones this
session created once its ranks are gone.
"""
import glob
import os
import time

import pytest

_SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"
_SESSION_START = time.time() - 1


def sweep_deepspeed_shm(since: float = _SESSION_START) -> int:
    """Remove DeepSpeed shm buffers created since ``since``; returns how many."""
    removed = 0
    for path in glob.glob(_SHM_PATTERN):
        try:
            if os.stat(path).st_mtime >= since:
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


@pytest.fixture(scope="module", autouse=True)
def _clean_deepspeed_shm():
    yield
    sweep_deepspeed_shm()
