"""Exact-resume checkpoints of an :class:`~ds_acco.fsdp.AccoFSDP` run with torch.distributed.checkpoint.

Taken at a quiescent point: the round in flight is drained first, so FSDP's sharded parameters
and the optimizer state are the committed θ_t, S_t. Layout of ``path``:

  DCP files   ``model.<fqn>`` (FSDP's sharded DTensor parameters) and ``optim.<fqn>.<key>``
              (the optimizer's per-parameter state), written and read in place through DCP, so
              FSDP's own state-dict hooks (which would re-gather the resident unsharded weights
              from the shards) are never involved;
  ``acco_rank<r>.pt``  the ACCO in-flight state of rank r of the data-parallel mesh
              (``AccoSchedule.state_dict()``: G, the live weights -- possibly the estimate θ̃ --
              and B), the optimizer's param-group settings, the LR scheduler and the step counters.

Everything runs on the data-parallel mesh's own process group (``AccoFSDP.data_parallel_group``):
DCP's collectives, the barriers, and the publication. The mesh may span a subset of the world (the
'dp' dimension of a 2-D mesh, several independent jobs in one world), so another mesh's ranks are
never waited for; each mesh saves to a path of its own. A save is written to ``<path>.acco-partial``
and renamed into place by the mesh's rank 0 once every rank of the mesh has finished
(:func:`ds_acco.core.lifecycle.publish.published`), so a reader sees the old checkpoint or the complete new one.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..core.lifecycle import publish

_GROUP_PARAMS = "params"


def _fqns(acco) -> list:
    """(fqn, FSDPParamView) of every trainable parameter, in the group's order."""
    names = {id(m): n for n, m in acco.module.named_modules()}
    out = []
    for s in acco.buffers.slots:
        prefix = names[id(s.param.module)]
        out.append((f"{prefix}.{s.param.param_name}" if prefix else s.param.param_name, s.param))
    return out


def _dcp_state(acco) -> dict:
    opt = acco.optimizer
    model, optim = {}, {}
    for fqn, fp in _fqns(acco):
        p = fp.sharded
        model[fqn] = p
        for k, v in opt.state.get(p, {}).items():
            optim[f"{fqn}.{k}"] = v
    return {"model": model, "optim": optim}


def _rank_file(path: str, rank: int) -> str:
    """Where rank ``rank`` of the data-parallel mesh keeps its in-flight state."""
    return os.path.join(path, f"acco_rank{rank}.pt")


def mesh_path(root: str, group: dist.ProcessGroup) -> str:
    """``root`` for a data-parallel group over the whole world; for a group over a subset of it,
    ``root/dp-group-<g>`` with ``g`` the global rank of the group's rank 0 (disjoint groups, such
    as the 'dp' groups of a 2-D mesh, differ in it): one directory per group under one setting."""
    if dist.get_world_size(group) == dist.get_world_size():
        return root
    return os.path.join(root, f"dp-group-{dist.get_global_rank(group, 0)}")


def save(acco, path: str) -> None:
    """Drain, then write the committed shards, the optimizer state and every rank's in-flight state
    (collective over the data-parallel mesh: every rank of it calls this with the same ``path``)."""
    acco_state = acco.schedule.state_dict()  # drains: shards and optimizer state are the committed ones
    group = acco.data_parallel_group
    opt = acco.optimizer
    with publish.published(path, group) as scratch:
        dcp.save(_dcp_state(acco), checkpoint_id=scratch, process_group=group)
        extras = {
            "acco_state": acco_state,
            "param_groups": [{k: v for k, v in g.items() if k != _GROUP_PARAMS} for g in opt.param_groups],
            "lr_scheduler": acco.lr_scheduler.state_dict() if acco.lr_scheduler is not None else None,
            "global_steps": acco.global_steps,
            "skipped_steps": acco.skipped_steps,
            "global_samples": acco.global_samples,
            "world": dist.get_world_size(group),
            "loss_scaler": None if acco.loss_scaler is None else dict(vars(acco.loss_scaler)),
        }
        torch.save(extras, _rank_file(scratch, dist.get_rank(group)))


def _init_optimizer_state(opt: torch.optim.Optimizer, params) -> None:
    """Create the optimizer's per-parameter state (shapes for DCP to load into) with a zero-gradient
    step at learning rate 0, which leaves the parameters as they are."""
    missing = [p for p in params if not opt.state.get(p)]
    if not missing:
        return
    saved_lrs = [g["lr"] for g in opt.param_groups]
    try:
        for g in opt.param_groups:
            g["lr"] = 0.0
        for p in missing:
            p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved_lrs):
            g["lr"] = lr
        for p in missing:
            p.grad = None


def load(acco, path: str) -> None:
    """Load a checkpoint written by :func:`save` (collective over the data-parallel mesh; the same
    mesh size for the in-flight state; with another size the committed θ and S are loaded and a
    fresh ACCO phase starts there)."""
    schedule = acco.schedule
    schedule.drain()
    opt = acco.optimizer
    with torch.no_grad():
        _init_optimizer_state(opt, [fp.sharded for _, fp in _fqns(acco)])
    state = _dcp_state(acco)
    # Optimizer state the checkpoint does not have (saved before the first applied step, e.g.
    # while fp16 overflows were being skipped) stays absent: the optimizer initialises it later.
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    for fqn, fp in _fqns(acco):
        entries = opt.state[fp.sharded]
        for k in list(entries):
            if f"optim.{fqn}.{k}" not in saved:
                del entries[k]
                del state["optim"][f"{fqn}.{k}"]
        if not entries:
            del opt.state[fp.sharded]
    group = acco.data_parallel_group
    dcp.load(state, checkpoint_id=path, process_group=group)  # in place into the DTensor shards and state tensors
    for fqn, fp in _fqns(acco):  # non-tensor entries come back as new objects
        if fp.sharded not in opt.state:
            continue
        entries = opt.state[fp.sharded]
        for k in list(entries):
            if not torch.is_tensor(entries[k]):
                entries[k] = state["optim"][f"{fqn}.{k}"]
    rank_file = _rank_file(path, dist.get_rank(group))
    mine = os.path.exists(rank_file)  # absent when the checkpoint had fewer ranks
    extras = torch.load(rank_file if mine else _rank_file(path, 0), weights_only=False)
    for g, values in zip(opt.param_groups, extras["param_groups"]):
        g.update(values)
    if acco.lr_scheduler is not None and extras["lr_scheduler"] is not None:
        acco.lr_scheduler.load_state_dict(extras["lr_scheduler"])
    acco.global_steps = extras["global_steps"]
    acco.skipped_steps = extras["skipped_steps"]
    acco.global_samples = extras.get("global_samples")
    if acco.global_samples is None:  # written before it was counted: what fixed accumulation committed
        acco.global_samples = (acco.global_steps * acco.driver.host.micro_batch_size * acco.gradient_accumulation_steps
                               * dist.get_world_size(group))
    if acco.loss_scaler is not None and extras.get("loss_scaler"):
        vars(acco.loss_scaler).update(extras["loss_scaler"])  # scale, iteration, hysteresis
    try:
        if not mine:
            raise ValueError("no in-flight state for this rank")
        schedule.load_state_dict(extras["acco_state"])  # G, the live weights (θ or θ̃) and B
    except ValueError:
        # Another layout: start a fresh phase at the loaded committed θ (FSDP re-gathers it).
        schedule.reset(acco.global_steps)  # with sharded parameters FSDP gathers the loaded shards next
        if not acco.sharded_params:
            acco.regather_allowed = True
            try:
                for m in acco.modules:
                    m.reshard()
                for m in acco.modules:
                    m.unshard()
            finally:
                acco.regather_allowed = False
