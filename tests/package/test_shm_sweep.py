"""The suite's /dev/shm hygiene (tests/shm_sweep.py) removes DeepSpeed buffers it left behind, never one a
live DeepSpeed job still uses: mapped (removing that one hung a concurrent job's rank at start-up), or
open but not yet mapped, as a buffer is while DeepSpeed's ``shared_create`` writes it (removing that one
hung the peer of a job that a second suite running beside this one started)."""
import ctypes
import mmap
import os
import time

from shm_sweep import sweep


def test_used_buffers_are_kept_unused_ones_removed():
    since = time.time() - 1
    paths = [f"/dev/shm/deepspeed_allreduce_buffer_acco_sweep_test_{os.getpid()}_{k}" for k in range(3)]
    # Each buffer the sweep must keep is held from its creation on: another pytest-xdist worker's sweep
    # (after each of its modules) may run at any moment, and a fresh buffer nobody holds is fair game.
    fd = os.open(paths[0], os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"\0" * 4096)
    with open(paths[1], "wb") as f:
        f.write(b"\0" * 4096)
    writing = open(paths[2], "wb")  # as shared_create holds it, from its O_CREAT open, while it writes
    writing.write(b"\0" * 4096)
    writing.flush()
    # Mapped, its descriptor closed (libc's mmap: Python's mmap.mmap keeps a duplicate of the descriptor).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    held = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    assert held not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        sweep(since)
        assert os.path.exists(paths[0]) and not os.path.exists(paths[1]) and os.path.exists(paths[2])
    finally:
        libc.munmap(held, 4096)
        writing.close()
    sweep(since)
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[2])
