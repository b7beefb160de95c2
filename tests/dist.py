"""Spawn N local ranks (gloo on 127.0.0.1, a free port) that run one function each."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import tempfile
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_ranks(fn, world: int = 2, timeout: float = 300.0, allow_missing: bool = False, **kwargs):
    """Run ``fn(**kwargs)`` on ``world`` ranks; return the list of their return values.

    With ``allow_missing`` a rank that died without a result gives None instead of an error.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, kwargs, outs[r])) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
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
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{', timed out' if procs[r] in hung else ''})")
                continue
            data = torch.load(out, weights_only=False)
            if "error" in data:
                errors.append(f"rank {r}:\n{data['error']}")
            else:
                results.append(data["ok"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
