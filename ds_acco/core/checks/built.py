"""Check point 2 (docs/design.md, "One path for the config"): the refusal table against what an
adapter built, in one call made before its driver exists (no rounds group, no lane, no lane thread).

An adapter fills one :class:`Built` record with plain values and objects of the step room (the shard
optimizer) and calls :func:`check_built` once; the driver, the schedule and the rounds below it trust
what they are handed. Rows are checked in the order the table (:data:`.refusals.REFUSALS`) reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .layout import ParallelLayout
from .refusals import check_estimate_dtype, check_estimate_variant, check_fsdp_model, check_layout, \
    check_lr_scaled, refuse


@dataclass(frozen=True)
class Built:
    """What an adapter built, as :func:`check_built` reads it.

    ``foreign_optimizer``: the framework built an optimizer that is not ACCO's (its type name), so nothing
    else below exists; ``shard_optimizer``: the :class:`~ds_acco.core.step.shard_optimizer.ShardOptimizer`
    over this rank's shards (its capabilities: a functional step, Adam's second moment, the groups' rates);
    ``comm_dtype`` / ``estimate_dtype``: the rounds' communication dtype and the estimate round's
    (``estimate_dtype_row``: the adapter's row for it); ``layout``: DeepSpeed's groups as its engine built
    them; ``fsdp``: FSDP2's parameters as :func:`.refusals.check_fsdp_model` reads them (its keywords);
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


def check_built(acco, built: Built) -> None:
    """Raise the first refusal of the table that applies to an enabled ``acco`` with what was ``built``."""
    if not acco.enabled:
        return
    shard = built.shard_optimizer
    if shard is not None:
        check_estimate_variant(acco.estimate, shard, rounds=acco.mode == "acco")
        dynamic = acco.dynamic if acco.accumulation == "dynamic" else None
        if dynamic is not None and dynamic.lr_power:  # every round's rate is scaled: a rate in every group
            check_lr_scaled(f"acco.dynamic.lr_scaling = {dynamic.lr_scaling!r}", '"lr_scaling": "none"', shard)
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
