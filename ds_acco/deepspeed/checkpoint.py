"""Atomic publication of a DeepSpeed checkpoint tag.

DeepSpeed writes a tag's files in place and then the ``latest`` pointer; a process killed in
between leaves a half-written tag (and, if the tag existed, a corrupted one). We let DeepSpeed
write into a scratch tag, then rename it into place and replace ``latest`` atomically, so a
reader sees either the old checkpoint or the complete new one.
"""
from __future__ import annotations

import os
import shutil

PARTIAL_SUFFIX = ".acco-partial"


def scratch_tag(tag: str) -> str:
    return f"{tag}{PARTIAL_SUFFIX}"


def clear_scratch(save_dir: str, tag: str) -> None:
    """Remove a scratch tag left by an interrupted save."""
    shutil.rmtree(os.path.join(save_dir, scratch_tag(tag)), ignore_errors=True)


def publish(save_dir: str, tag: str, save_latest: bool) -> None:
    """Move the scratch tag to ``tag`` and point ``latest`` at it, each step atomic."""
    final = os.path.join(save_dir, tag)
    scratch = os.path.join(save_dir, scratch_tag(tag))
    retired = None
    if os.path.exists(final):
        retired = f"{final}.acco-retired-{os.getpid()}"
        os.rename(final, retired)
    os.rename(scratch, final)
    if save_latest:
        pointer = os.path.join(save_dir, "latest")
        tmp = f"{pointer}.acco-tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, pointer)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
