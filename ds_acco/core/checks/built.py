"""Check point 2 (docs/design.md, "One path for the config"): the refusal table against what an
adapter built, in one call made before its driver exists (no rounds group, no lane, no lane thread).

An adapter fills one :class:`Built` record with plain values and objects of the step room (the shard
optimizer) and calls :func:`check_built` once; the driver, the schedule and the rounds below it trust
what they are handed. Rows are checked in the order the table (:data:`.refusals.REFUSALS`) reads them;
the checks of each part (the optimizer's estimate, the dtypes, FSDP2's parameters) follow it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .layout import ParallelLayout
from ..step.functional_step import scalable_lr
from ..step.predict import scratch_offset
from .refusals import check_layout, refuse


@dataclass(frozen=True)
class Built:
    """What an adapter built, as :func:`check_built` reads it.

    ``foreign_optimizer``: the framework built an optimizer that is not ACCO's (its type name), so nothing
    else below exists; ``shard_optimizer``: the :class:`~ds_acco.core.step.shard_optimizer.ShardOptimizer`
    over this rank's shards (its capabilities: a functional step, Adam's second moment, the groups' rates);
    ``comm_dtype`` / ``estimate_dtype``: the rounds' communication dtype and the estimate round's
    (``estimate_dtype_row``: the adapter's row for it); ``layout``: DeepSpeed's groups as its engine built
    them; ``fsdp``: FSDP2's parameters as :func:`check_fsdp_model` reads them (its keywords);
    ``needs_functional``: a refusal key whose layout needs a functional step (FSDP's ``sharded_params``)."""

    shard_optimizer: Any = None
    foreign_optimizer: Optional[str] = None
    comm_dtype: Optional[torch.dtype] = None
    estimate_dtype: Optional[torch.dtype] = None
    estimate_dtype_row: str = ""
    layout: Optional[ParallelLayout] = None
    fsdp: Optional[dict] = None
    needs_functional: Optional[str] = None
    needs_functional_found: str = ""
    rounds_world: int = 0  # the rounds' ranks (DeepSpeed's data-parallel size; 0: not known)
    live_dtype: Optional[torch.dtype] = None  # the model's weights (DeepSpeed)


def check_built(acco, built: Built) -> None:
    """Raise the first refusal of the table that applies to an enabled ``acco`` with what was ``built``."""
    if not acco.enabled:
        return
    shard = built.shard_optimizer
    if shard is not None:
        check_estimate_variant(acco.estimate, shard, rounds="acco" in acco.schedule_modes())
        dynamic = acco.dynamic if acco.accumulation == "dynamic" else None
        if dynamic is not None and dynamic.lr_power:  # every round's rate is scaled: a rate in every group
            check_lr_scaled(f"acco.dynamic.lr_scaling = {dynamic.lr_scaling!r}", '"lr_scaling": "none"', shard)
    if "one_round" in acco.schedule_modes():
        check_one_round(acco.predictor_setting(), built, "acco.mode = 'one_round'" if acco.mode == "one_round"
                        else f"acco.auto_modes = {list(acco.auto_modes)!r}")
    if built.foreign_optimizer is not None:
        raise refuse("not_zero1_optimizer", f"acco.enabled = true but DeepSpeed built {built.foreign_optimizer}")
    if built.estimate_dtype_row and built.comm_dtype is not None:
        check_estimate_dtype(built.estimate_dtype_row, acco.estimate_comm_dtype, built.estimate_dtype,
                             built.comm_dtype)
    if built.layout is not None:
        check_layout(acco, built.layout)
    if built.fsdp is not None:
        check_fsdp_model(**built.fsdp)
    if built.needs_functional and shard is not None and not shard.functional:
        raise refuse(built.needs_functional, built.needs_functional_found)


# -- the checks of what was built, by part -------------------------------------------------------------
def check_estimate_variant(estimate, shard_optimizer, rounds: bool = True) -> None:
    """Adam's second moment read by an estimate variant needs torch Adam / AdamW (functional), a scaled
    estimate a rate in every group (:func:`check_lr_scaled`); ``rounds``: the mode has estimate rounds."""
    needs = [f"second_moment = {estimate.second_moment!r}"] if estimate.second_moment == "committed" else []
    if estimate.delay_compensation:
        needs.append(f"delay_compensation = {estimate.delay_compensation!r}")
    if needs and not shard_optimizer.committed_second_moment:
        raise refuse("estimate_variant_optimizer", f"acco.estimate.{' and '.join(needs)}",
                     optimizer=type(shard_optimizer.optimizer).__name__)
    if rounds and estimate.lr_scale != 1.0:
        check_lr_scaled(f"acco.estimate.lr_scale = {estimate.lr_scale!r}", '"estimate": "paper"', shard_optimizer)


def check_one_round(predictor, built: Built, found: str = "acco.mode = 'one_round'") -> None:
    """Mode 'one_round': DeepSpeed's flat buffers only; 'nag' reads torch Adam / AdamW's m and v; 'ext'
    keeps θ_{t-1} in bytes of B the round no longer needs, on every rank (:func:`..step.predict.scratch_offset`)."""
    if built.fsdp is not None:
        raise refuse("one_round_fsdp", f"AccoFSDP with {found}")
    shard = built.shard_optimizer
    if predictor.name == "nag" and shard is not None and not shard.committed_second_moment:
        raise refuse("one_round_predictor_optimizer", "acco.predictor.name = 'nag'",
                     optimizer=type(shard.optimizer).__name__)
    if predictor.name == "ext" and built.comm_dtype is not None and built.live_dtype is not None:
        for rank in range(built.rounds_world):
            if scratch_offset(rank, built.rounds_world, 1, built.comm_dtype.itemsize, built.live_dtype.itemsize,
                              built.comm_dtype == torch.float32) is None:
                raise refuse("one_round_ext_room", "acco.predictor.name = 'ext'", world=built.rounds_world,
                             comm_dtype=built.comm_dtype, live_dtype=built.live_dtype, rank=rank)


def check_lr_scaled(found: str, unscaled: str, shard_optimizer) -> None:
    """``found`` scales a round's learning rate (``unscaled``: the setting that does not): every group
    needs a rate the round's step can scale (the lane's own test, ``scalable_lr``)."""
    for i, group in enumerate(shard_optimizer.optimizer.param_groups):
        if not scalable_lr(group.get("lr")):
            raise refuse("estimate_lr_scale_without_lr", found, optimizer=type(shard_optimizer.optimizer).__name__,
                         group=i, lr=repr(group.get("lr")), unscaled=unscaled)


def check_estimate_dtype(key: str, estimate_comm_dtype: Optional[str], estimate_dtype: Optional[torch.dtype],
                         comm_dtype: torch.dtype) -> None:
    """An estimate round narrower than (or as wide as) the rounds' communication dtype; ``key``: the
    adapter's row (its fix names its own setting)."""
    if estimate_dtype is not None and estimate_dtype.itemsize > comm_dtype.itemsize:
        raise refuse(key, f"acco.estimate_comm_dtype = {estimate_comm_dtype!r}", comm_dtype=comm_dtype)


def check_fsdp_model(*, one_mesh: bool, reduce_dtypes: Iterable[torch.dtype], param_dtypes: Iterable[torch.dtype],
                     loss_scaling: bool, estimate_comm_dtype: Optional[str], estimate_dtype: Optional[torch.dtype],
                     post_forward_mesh: bool = False) -> None:
    """What ``AccoFSDP`` took over: whether every parameter is on one device mesh, the parameters'
    reduce and compute dtypes, whether the config asks for fp16 loss scaling, the estimate round's
    dtype, and (``sharded_params``) whether a parameter reshards after forward to a smaller mesh."""
    if not one_mesh:
        raise refuse("fsdp_mesh")
    accum, live = set(reduce_dtypes), set(param_dtypes)
    if len(accum) != 1 or len(live) != 1:
        raise refuse("fsdp_mixed_precision")
    accum_dtype, live_dtype = accum.pop(), live.pop()
    if loss_scaling and (live_dtype != torch.float16 or accum_dtype != torch.float32):
        raise refuse("fsdp_fp16_dtypes", f"fp16.enabled = true, but the model computes in {live_dtype} and reduces in "
                                         f"{accum_dtype}")
    if not loss_scaling and live_dtype == torch.float16:
        raise refuse("fsdp_fp16_unscaled", "the model computes in float16 (MixedPrecisionPolicy param_dtype) without "
                                           "loss scaling")
    check_estimate_dtype("estimate_dtype_fsdp", estimate_comm_dtype, estimate_dtype, accum_dtype)
    if post_forward_mesh:
        raise refuse("fsdp_post_forward_mesh", "AccoFSDP(sharded_params=True) with an integer reshard_after_forward "
                                               "(a post-forward mesh)")
