"""What a DeepSpeed engine runs under, read for the refusals: the ranks' agreement on the settings
before it is built, the layout its groups form and what it built (check point 2's record)."""
from __future__ import annotations

import os
from typing import Optional

from deepspeed import comm as ds_dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..config import AccoConfig
from ..config_deepspeed import marked_params, steps_with_increment
from ..core.checks.built import Built
from ..core.checks.refusals import ParallelLayout
from ..core.driver import check_same_on_all_ranks


def check_ranks_agree(acco: AccoConfig, raw: Optional[dict], kwargs: dict) -> None:
    """Refuse a run whose ranks disagree on the ACCO settings (one small collective at start-up).
    The rank's device is set first, as DeepSpeed's engine would: NCCL stages the objects there."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if kwargs.get("dist_init_required") is False and not dist.is_initialized():
        return
    accelerator = get_accelerator()
    ds_dist.init_distributed(dist_backend=accelerator.communication_backend_name(),
                             distributed_port=kwargs.get("distributed_port", 29500),
                             dist_init_required=kwargs.get("dist_init_required"))
    if not accelerator.is_synchronized_device() and "LOCAL_RANK" in os.environ:
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    check_same_on_all_ranks({"acco": acco.model_dump(), "gradient_accumulation_steps":
                             (raw or {}).get("gradient_accumulation_steps"), "fp16": (raw or {}).get("fp16")},
                            "the \"acco\" block (or gradient_accumulation_steps / fp16)")


def built_layout(engine: DeepSpeedEngine, model, mpu, lr_scheduler) -> ParallelLayout:
    """The layout ``engine`` built: DeepSpeed's groups as the engine read them in
    ``_configure_distributed_model`` (model-parallel and sequence-parallel sizes, the data-parallel
    group ZeRO reduces over), whatever built them (an mpu, AutoTP, ``tp_model_init``, a mesh)."""
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size
    autotp = engine.autotp_size()
    tp_from = "AutoTP's model-parallel group size" if autotp > 1 else "the engine's model-parallel group size"
    sp, sp_from = engine.sequence_parallel_size, "the engine's sequence-parallel group size"
    if sp <= 1 and engine.seq_dp_world_size != engine.dp_world_size:
        sp, sp_from = engine.seq_dp_world_size // max(1, engine.dp_world_size), (
            "the engine's sequence-data-parallel group size / data-parallel group size")
    sequence_parallel_params, expert_params = marked_params(model)
    return ParallelLayout(tensor_parallel=engine.mp_world_size, tensor_parallel_from=tp_from,
                          pipeline_parallel=bwc_pipeline_parallel_world_size(engine.mpu),
                          pipeline_parallel_from="the engine's mpu pipeline-parallel size", sequence_parallel=sp,
                          sequence_parallel_from=sp_from, sequence_parallel_params=sequence_parallel_params,
                          expert_params=expert_params,
                          caller_sets_boundary=mpu is not None or steps_with_increment(lr_scheduler))


def built_by(engine: DeepSpeedEngine, layout: ParallelLayout, acco_optimizer: type) -> Built:
    """What ``engine`` built, for check point 2: ``layout`` (:func:`built_layout` of its groups), its
    optimizer (not ``acco_optimizer``: refused), the rounds' and the estimate round's dtypes, the shard
    optimizer."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, acco_optimizer):
        return Built(foreign_optimizer=type(optimizer).__name__, layout=layout)
    return Built(shard_optimizer=optimizer.shard_optimizer, comm_dtype=optimizer.comm_dtype,
                 estimate_dtype=optimizer.estimate_dtype, estimate_dtype_row="estimate_dtype_deepspeed",
                 layout=layout, rounds_world=engine.dp_world_size,
                 live_dtype=next((p.dtype for p in engine.module.parameters()), None))
