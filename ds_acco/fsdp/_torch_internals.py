"""Every use of FSDP2's private internals, in one module (written against torch 2.13).

FSDP2 exposes no public way to keep its unsharded parameters resident, reach them, or map a
sharded parameter to its padded dim-0 shard -- the pieces ACCO's ZeRO-1-like configuration needs.
A torch upgrade that moves them is a change to this file alone: the rest of the adapter sees
:class:`FSDPParamView` and the functions below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

import torch
from torch.distributed.fsdp import FSDPModule

from ..core.checks.refusals import refuse


@dataclass(frozen=True)
class FSDPParamView:
    """What ACCO uses of one FSDP2 parameter (torch's private ``FSDPParam``)."""
    sharded: torch.Tensor  # the sharded DTensor parameter: the user's optimizer steps it
    unsharded: torch.Tensor  # the resident unsharded parameter the forward uses (param_dtype)
    numel: int  # of the whole (unsharded) parameter
    shape: torch.Size  # of the whole parameter
    padded_shard_numel: int  # elements of one padded dim-0 shard
    local_shard_size: torch.Size  # this rank's (unpadded) shard
    module: torch.nn.Module  # the module that owns it
    param_name: str  # its name in that module
    mesh: object
    reduce_dtype: torch.dtype  # the dtype gradients are reduced in
    param_dtype: torch.dtype  # the dtype the forward computes in
    _fsdp_param: object

    def to_sharded_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """A local shard-shaped tensor as a DTensor with the sharded parameter's placement."""
        return self._fsdp_param.to_sharded_dtensor(local)


def fsdp_modules(model: torch.nn.Module) -> List[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def lazy_init(model: FSDPModule) -> None:
    """FSDP's lazy initialisation, normally run by the first forward (it picks the root)."""
    model._get_fsdp_state()._lazy_init()


def param_groups(module: FSDPModule) -> list:
    """The module's FSDP parameter groups (each with its own all-gather). torch 2.13 keeps a list;
    torch <= 2.12 one optional group (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def trainable_params(modules: List[FSDPModule]) -> List[FSDPParamView]:
    """Every trainable FSDP parameter of ``modules``, after :func:`check_supported`."""
    out = []
    for m in modules:
        for pg in param_groups(m):
            for fp in pg.fsdp_params:
                if not fp.sharded_param.requires_grad:
                    continue
                check_supported(fp)
                info = fp._module_info
                out.append(FSDPParamView(
                    sharded=fp.sharded_param, unsharded=fp._unsharded_param, numel=fp._orig_size.numel(),
                    shape=fp._orig_size, padded_shard_numel=fp.padded_sharded_param_size.numel(),
                    local_shard_size=fp.sharded_size, module=info.module, param_name=info.param_name,
                    mesh=fp.mesh_info.mesh, reduce_dtype=fp.reduce_dtype or fp.param_dtype or fp.orig_dtype,
                    param_dtype=fp.param_dtype or fp.orig_dtype, _fsdp_param=fp))
    return out


def check_supported(fp) -> None:
    """Refuse FSDP settings the adapter does not map (:mod:`ds_acco.core.checks.refusals`)."""
    if fp.mesh_info.mesh.ndim != 1:
        raise refuse("fsdp_mesh")
    if fp.is_dtensor or fp.fsdp_placement.dim != 0:
        raise refuse("fsdp_placement")
    if fp.offload_to_cpu:
        raise refuse("fsdp_cpu_offload")


def guard_regather(modules: List[FSDPModule], allowed: Callable[[], bool], message: str) -> Callable[[], None]:
    """Make FSDP's re-gather of parameters it considers sharded raise ``RuntimeError(message)``
    unless ``allowed()``; returns the function that removes the guard."""
    guarded = [pg for m in modules for pg in param_groups(m)]
    for pg in guarded:
        inner = pg.unshard

        def unshard(async_op: bool = False, _pg=pg, _inner=inner):
            if not _pg.is_unsharded and not allowed():
                raise RuntimeError(message)
            return _inner(async_op)
        pg.unshard = unshard  # instance attribute: FSDP's own calls go through it

    def remove() -> None:
        for pg in guarded:
            pg.__dict__.pop("unshard", None)
    return remove


def state_dict_keeps_resident(modules: List[FSDPModule]) -> Callable[[], None]:
    """Make ``state_dict()`` leave resident unsharded parameters in place.

    FSDP's state-dict pre-hook (``FSDPParamGroup._to_sharded``) registers the sharded parameters
    for the call -- a state dict holds the sharded DTensors -- and *frees* the unsharded ones, which
    its next forward re-gathers. ACCO's resident layout keeps them: they are its live weights,
    possibly the estimate θ̃, and no shard holds them. So each of those hooks is replaced by a pair
    that registers the sharded parameters for the call and the unsharded ones again after it,
    freeing nothing. Returns the function that puts FSDP's own hooks back."""
    replaced = []
    for pg in (pg for m in modules for pg in param_groups(m)):
        handles = pg._module_to_pre_save_state_dict_hook_handle
        for module, handle in list(handles.items()):
            fsdp_hook = module._state_dict_pre_hooks[handle.id]
            handle.remove()
            pre = module.register_state_dict_pre_hook(_RegisterParams(pg, sharded=True))
            post = module.register_state_dict_post_hook(_RegisterParams(pg, sharded=False))
            replaced.append((pg, module, fsdp_hook, pre, post))

    def restore() -> None:
        for pg, module, fsdp_hook, pre, post in replaced:
            pre.remove()
            post.remove()
            pg._module_to_pre_save_state_dict_hook_handle[module] = module.register_state_dict_pre_hook(fsdp_hook)
        replaced.clear()
    return restore


class _RegisterParams:
    """Registers a parameter group's sharded (or its unsharded) parameters on their modules, if the
    group is unsharded; FSDP's own state is left as it is."""

    def __init__(self, pg, sharded: bool):
        self.pg, self.sharded = pg, sharded

    def __call__(self, *args) -> None:
        if self.pg.is_unsharded:
            for fp in self.pg.fsdp_params:
                fp._setattr_on_modules(fp.sharded_param if self.sharded else fp._unsharded_param)


def gather_source(p: FSDPParamView) -> torch.Tensor:
    """The padded flat shard FSDP all-gathers ``p`` from (``FSDPParam._sharded_param_data``: at
    first a view of the sharded parameter's own storage)."""
    return p._fsdp_param._sharded_param_data


def set_gather_source(p: FSDPParamView, data: torch.Tensor) -> None:
    """Make FSDP all-gather ``p`` from ``data`` (flat, the padded shard's numel, any float dtype:
    FSDP casts it to ``param_dtype`` as it copies the all-gather input). Read by every unshard, set
    between micro-batches only."""
    fp = p._fsdp_param
    if data.numel() != fp._sharded_param_data.numel() or data.dim() != 1:
        raise ValueError(f"gather source of {data.numel()} elements for a padded shard of "
                         f"{fp._sharded_param_data.numel()}")
    fp._sharded_param_data = data


def guard_reset(params: List[FSDPParamView], message: str) -> Callable[[], None]:
    """Make FSDP's ``reset_sharded_param`` (run by ``model.to()`` / ``_apply`` and by its
    ``load_state_dict`` post-hook) raise ``RuntimeError(message)``: it would re-point the all-gather
    source ACCO set, or move the master shards' storage. Returns the function removing the guard."""
    for p in params:
        def reset(_fp=p._fsdp_param):
            raise RuntimeError(message)
        p._fsdp_param.reset_sharded_param = reset  # instance attribute: FSDP's calls resolve it at call time

    def remove() -> None:
        for p in params:
            p._fsdp_param.__dict__.pop("reset_sharded_param", None)
    return remove


def resharded_after_forward_to_a_smaller_mesh(p: FSDPParamView) -> bool:
    """Whether ``reshard_after_forward`` is an int (FSDP then re-gathers from a post-forward shard)."""
    fp = p._fsdp_param
    return fp.post_forward_mesh_info is not None and fp.post_forward_mesh_info is not fp.mesh_info


def keep_user_settings(modules: List[FSDPModule]) -> Callable[[], None]:
    """Note the resharding and gradient-sync settings of every FSDP parameter group of ``modules``
    as they are now (after FSDP's lazy initialisation: the root's automatic
    ``reshard_after_forward=False`` included); returns the function that puts them back. FSDP has
    no getters for them: ``reshard_after_forward`` lives on as ``post_forward_mesh_info`` (None:
    False; the group's mesh info: True; another: an int), set by ``set_reshard_after_forward``,
    which also drops the root's automatic setting (``_auto_reshard_after_forward``)."""
    states = {id(s): (s, s._auto_reshard_after_forward) for s in (m._get_fsdp_state() for m in modules)}
    groups = [(pg, pg.post_forward_mesh_info, pg.reshard_after_backward, pg.reduce_grads, pg.all_reduce_grads)
              for m in modules for pg in param_groups(m)]

    def restore() -> None:
        for state, auto in states.values():
            state._auto_reshard_after_forward = auto
        for pg, post_forward, after_backward, reduce_grads, all_reduce_grads in groups:
            pg.post_forward_mesh_info = post_forward
            pg.reshard_after_backward = after_backward
            pg.reduce_grads, pg.all_reduce_grads = reduce_grads, all_reduce_grads
    return restore
