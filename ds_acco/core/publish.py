"""Atomic publication of a checkpoint directory.

A checkpoint is written into a scratch directory beside its final name; once every rank has
finished, one rank renames it into place (retiring an existing one first) and, optionally,
replaces a pointer file (DeepSpeed's ``latest``) atomically. A reader sees either the old
checkpoint or the complete new one, whenever the writers are killed.
"""
from __future__ import annotations

import os
import shutil

PARTIAL_SUFFIX = ".acco-partial"


def scratch_path(final: str) -> str:
    """Where a checkpoint bound for ``final`` is written first."""
    return f"{os.fspath(final).rstrip(os.sep)}{PARTIAL_SUFFIX}"


def clear_scratch(final: str) -> None:
    """Remove a scratch directory left by an interrupted save (one rank, before writing)."""
    shutil.rmtree(scratch_path(final), ignore_errors=True)


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
