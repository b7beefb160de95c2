"""Spawn N local ranks (gloo on 127.0.0.1, a free port) that run one function each."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback

import torch

from timeouts import scaled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clear_stale_build_locks() -> None:
    """Remove torch JIT build locks that no live process holds (see prebuild.py): a process killed
    mid-compile would otherwise make every later DeepSpeed start wait on its lock forever."""
    import prebuild
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        prebuild.clear_stale_locks(root, log=lambda line: print(line, flush=True))


def _entry(rank, world, port, fn, kwargs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    try:
        result = fn(**kwargs)
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int = 2, timeout: float = None, allow_missing: bool = False, **kwargs):
    """Run ``fn(**kwargs)`` on ``world`` ranks; return the list of their return values.

    ``timeout``: seconds, already scaled (pass ``scaled(idle_budget)``); default ``scaled(100)``.

    With ``allow_missing`` a rank that died without a result gives None instead of an error.
    """
    if timeout is None:
        timeout = scaled(100)
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, kwargs, outs[r])) for r in range(world)]
        for p in procs:
            p.start()
        # One deadline for all ranks. Once a rank has failed, the others get a grace period only:
        # they would otherwise wait in a collective until the deadline (unless dead ranks are
        # expected: allow_missing).
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if not allow_missing and any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + scaled(20))
            time.sleep(0.05)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:  # a rank killed while compiling a DeepSpeed op leaves torch's build lock behind
            clear_stale_build_locks()
        # DeepSpeed's CPU shm op leaves one buffer per rank and port in /dev/shm: drop ours.
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        results, errors = [], []
        for r, out in enumerate(outs):
            if not os.path.exists(out):
                if allow_missing:
                    results.append(None)
                    continue
                why = f", killed at the time limit ({timeout:.0f} s; ACCO_TEST_TIMEOUT_SCALE scales it) or after a peer failed" \
                    if procs[r] in hung else ""
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{why})")
                continue
            data = torch.load(out, weights_only=False)
            if "error" in data:
                errors.append(f"rank {r}:\n{data['error']}")
            else:
                results.append(data["ok"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
