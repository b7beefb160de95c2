"""The suite's /dev/shm hygiene removes DeepSpeed buffers it left behind, never one a live DeepSpeed
job still maps (removing that one hung a concurrent job's rank at start-up)."""
import mmap
import os
import time

from conftest import sweep_deepspeed_shm


def test_mapped_buffers_are_kept_unmapped_ones_removed():
    since = time.time() - 1
    paths = [f"/dev/shm/deepspeed_allreduce_buffer_acco_sweep_test_{os.getpid()}_{k}" for k in range(2)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    with open(paths[0], "r+b") as f:
        held = mmap.mmap(f.fileno(), 4096)  # as DeepSpeed's shm op maps its buffer
    try:
        sweep_deepspeed_shm(since)
        assert os.path.exists(paths[0]) and not os.path.exists(paths[1])
    finally:
        held.close()
    sweep_deepspeed_shm(since)
    assert not os.path.exists(paths[0])
