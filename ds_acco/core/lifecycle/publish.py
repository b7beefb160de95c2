"""Atomic publication of a checkpoint directory.

A checkpoint is written into a scratch directory beside its final name; once every rank has
finished, one rank renames it into place (retiring an existing one first) and, optionally,
replaces a pointer file (DeepSpeed's ``latest``) atomically. A reader sees either the old
checkpoint or the complete new one, whenever the writers are killed.

:func:`published` runs that protocol on one process group: the ranks that write the checkpoint
(an FSDP2 data-parallel mesh may span a subset of the world, and several meshes may save
independently), never the default group, and "one rank" is that group's rank 0.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator, Optional

import torch.distributed as dist

PARTIAL_SUFFIX = ".acco-partial"


def scratch_path(final: str) -> str:
    """Where a checkpoint bound for ``final`` is written first."""
    return f"{os.fspath(final).rstrip(os.sep)}{PARTIAL_SUFFIX}"


def clear_scratch(final: str) -> None:
    """Remove a scratch directory left by an interrupted save (one rank, before writing)."""
    shutil.rmtree(scratch_path(final), ignore_errors=True)


@contextlib.contextmanager
def published(final: str, group: Optional[dist.ProcessGroup] = None) -> Iterator[str]:
    """Write a checkpoint bound for ``final`` with every rank of ``group`` (None: the default
    group): inside, each rank writes its part into the yielded scratch directory; on leaving,
    once all of them have, the group's rank 0 publishes it. Every synchronisation is a barrier on
    ``group`` alone, so ranks outside it (another mesh's, with its own checkpoint) are not waited for."""
    leader = dist.get_rank(group) == 0
    if leader:
        clear_scratch(final)
    dist.barrier(group=group)  # nobody writes into a scratch directory being cleared
    yield scratch_path(final)
    dist.barrier(group=group)  # every part written
    if leader:
        publish(final)
    dist.barrier(group=group)  # on return, every rank of the group can read the checkpoint


def publish(final: str, pointer: str = None, pointee: str = None) -> None:
    """Move the scratch directory to ``final`` (one rank, after every rank has written); then,
    with ``pointer``, write ``pointee`` into that file atomically. Each step is one rename."""
    scratch = scratch_path(final)
    retired = None
    if os.path.exists(final):
        retired = f"{final}.acco-retired-{os.getpid()}"
        os.rename(final, retired)
    os.rename(scratch, final)
    if pointer is not None:
        tmp = f"{pointer}.acco-tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(pointee)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, pointer)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
