"""The rounds' own process group, created validly whichever ranks the data-parallel group spans.

Rounds run on the lane's thread and gloo matches collectives by issue order per group, so they
get a group of their own over the data-parallel group's ranks. ``dist.new_group`` must be entered
by every rank of the default group, which holds when the data-parallel group is the whole world
(DeepSpeed's pure data parallelism, FSDP2 over every rank). It does not when it spans a subset:
an FSDP2 mesh over some ranks only, or the data-parallel dimension of a 2-D mesh (each rank then
builds its engine over a different group). Such a group is created by its members alone
(``use_local_synchronization``). torch names it from its ranks and the number of groups alive on
the rank, so it is kept until the process ends: destroyed, the next one over the same ranks would
take its name and read its stale rendezvous keys from the store (a gloo connect timeout).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

_MEMBERS_ONLY: list = []  # groups created by their members alone: never destroyed (module docstring)


def new_rounds_group(ranks: Sequence[int], timeout: timedelta):
    """A new process group over ``ranks`` (global ranks, this rank among them) for the rounds."""
    ranks = sorted(ranks)
    world = dist.get_world_size()
    if len(ranks) == world:
        return dist.new_group(ranks=ranks, timeout=timeout)
    if getattr(dist.group.WORLD, "bound_device_id", None) is not None:
        # torch then creates subgroups with ncclCommSplit, collective over the whole default group.
        raise ValueError(
            f"ACCO: the data-parallel group spans ranks {ranks} of {world}, and the default process group was "
            "initialised with a device_id (eager NCCL initialisation): torch creates every subgroup by splitting "
            "the default group's communicator, which every rank must enter, while only the data-parallel group's "
            "ranks build this engine; fix: call init_process_group without device_id, or build the data-parallel "
            "group (the FSDP mesh) over every rank")
    try:
        group = dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True)
    except Exception as exc:
        raise RuntimeError(
            f"ACCO: creating the rounds' process group over ranks {ranks} (entered by those ranks only) failed: "
            f"{exc}. torch names such a group from its ranks and the number of process groups alive on each rank; "
            "fix: give every rank of the data-parallel group the same process groups (created and destroyed "
            "alike) before it builds the engine") from exc
    _MEMBERS_ONLY.append(group)
    return group


def connected(group) -> None:
    """Return once every member of the new ``group`` has connected to it. gloo connects a group's pairs
    when it is created, and a rank may finish before its peer: were the group destroyed then (an engine
    built and destroyed at once, no round in between), the peer still connecting would fail with
    "Connection closed by peer". One barrier on the group closes that window. Other backends connect
    at first use: nothing to wait for, nothing done."""
    if group is not None and dist.get_backend(group) == "gloo":
        dist.barrier(group=group)


def new_group_everywhere(ranks: Sequence[int], timeout: timedelta):
    """A new process group over ``ranks``, created by every rank of the default group: each rank's
    ``ranks`` are gathered and every distinct group is created, in one order, on every rank (the
    way Megatron builds its groups). Valid whether or not the default group is bound to a device
    (ncclCommSplit is collective over it); for callers where every rank builds an engine, each
    over its own subset (tensor parallelism: one data-parallel group per tensor-parallel rank)."""
    mine = tuple(sorted(ranks))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    own = None
    for members in sorted(set(everyone)):
        group = dist.new_group(ranks=list(members), timeout=timeout)
        if members == mine:
            own = group
    return own


def destroyable(group) -> bool:
    """Whether releasing ``group`` may destroy it (not a group created by its members alone)."""
    return not any(group is g for g in _MEMBERS_ONLY)
