"""DeepSpeed's side of a config: its file as ``deepspeed.initialize`` reads it, the parallel layout a
call asks for, and its batch arithmetic at a given data-parallel size."""
from __future__ import annotations

import base64
import json
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from .core.checks.refusals import ParallelLayout

ACCO_KEY = "acco"  # the block of a DeepSpeed config that ds_acco reads (DeepSpeed ignores it)


def load_ds_config(config: Any = None, args: Any = None) -> Optional[dict]:
    """Resolve a DeepSpeed config the way ``deepspeed.initialize`` does: a dict, a path to a JSON
    (or HJSON) file, a base64-encoded JSON string (DeepSpeed's autotuner passes those), or
    ``args.deepspeed_config``. Returns None when none was given (DeepSpeed will complain); raises
    ``OSError`` for a path that does not exist, ``ValueError`` for text that does not parse."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, os.PathLike) or (isinstance(config, str) and os.path.exists(config)):
        with open(config) as f:
            return _parse_config_text(f.read())
    if isinstance(config, str):
        try:  # not a file: DeepSpeed then reads it as base64
            found = _parse_config_text(base64.urlsafe_b64decode(config).decode("utf-8"))
        except (ValueError, ImportError):  # binascii.Error, UnicodeDecodeError and parse errors are ValueErrors
            found = None
        if not isinstance(found, Mapping):
            raise FileNotFoundError(f"no such DeepSpeed config file: {config!r} (nor is it base64-encoded JSON)")
        return dict(found)
    raise ValueError(f"DeepSpeed config must be a dict, a path to a JSON file or base64-encoded JSON, got "
                     f"{type(config).__name__}")


def _parse_config_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            import hjson  # DeepSpeed parses configs as HJSON (a superset of JSON); installed with it
        except ImportError:
            raise
        return hjson.loads(text)


def _size(mpu, *names) -> tuple:
    """The first of ``names`` the mpu answers: (its value, where it was read)."""
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn()), f"mpu.{name}()"
    return 1, ""


def marked_params(model) -> tuple:
    """Names of the parameters marked as Megatron sequence-parallel, and of MoE expert parameters
    (DeepSpeed's ``is_moe_param``; DeepSpeed is imported only when there is a model to read)."""
    if not hasattr(model, "named_parameters"):
        return (), ()
    from deepspeed.moe.utils import is_moe_param
    named = list(model.named_parameters())
    return (tuple(n for n, p in named if getattr(p, "sequence_parallel", False) is True),
            tuple(n for n, p in named if is_moe_param(p)))


def steps_with_increment(lr_scheduler) -> bool:
    """Megatron's scheduler is stepped with ``increment=``: a caller that counts its own batches."""
    import inspect
    step = getattr(lr_scheduler, "step", None)
    try:
        return step is not None and "increment" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


def requested_layout(raw: Optional[Mapping[str, Any]], mpu: Any = None, model: Any = None, lr_scheduler: Any = None,
                     mesh_param: Any = None) -> ParallelLayout:
    """The layout a ``deepspeed.initialize`` call asks for, read before any engine or process group
    exists: its ``mpu``, the config's ``tensor_parallel.autotp_size`` / ``sequence_parallel_size``,
    ``mesh_param``, the model's marked parameters, a scheduler stepped with ``increment=``."""
    from .core.checks.refusals import ParallelLayout
    raw = raw or {}
    tp, tp_from = _size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    autotp = (raw.get("tensor_parallel") or {}).get("autotp_size") or 0
    if isinstance(autotp, int) and autotp > 1:
        tp, tp_from = autotp, "AutoTP: tensor_parallel.autotp_size"
    pp, pp_from = _size(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    sp, sp_from = _size(mpu, "get_sequence_parallel_world_size")
    if sp <= 1 and isinstance(raw.get("sequence_parallel_size"), int):
        sp, sp_from = raw["sequence_parallel_size"], "sequence_parallel_size"
    if sp <= 1 and mesh_param:
        sp, sp_from = int(mesh_param[1]), "mesh_param[1] (the sequence-parallel size of the mesh)"
    sequence_parallel_params, expert_params = marked_params(model)
    return ParallelLayout(tensor_parallel=tp, tensor_parallel_from=tp_from, pipeline_parallel=pp,
                          pipeline_parallel_from=pp_from, sequence_parallel=sp, sequence_parallel_from=sp_from,
                          sequence_parallel_params=sequence_parallel_params, expert_params=expert_params,
                          caller_sets_boundary=mpu is not None or steps_with_increment(lr_scheduler))


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def data_parallel_size(ds_config: Mapping[str, Any], world_size: Optional[int] = None) -> int:
    """The data-parallel size to check ``ds_config`` at (``python -m ds_acco check --world-size``):
    ``world_size`` when given, else ``train_batch_size / (train_micro_batch_size_per_gpu ×
    gradient_accumulation_steps)`` when all three are integers, else 1. Under tensor or pipeline
    parallelism this is the number of data-parallel replicas, not of GPUs."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ValueError(f"--world-size {world_size!r}: the data-parallel size must be an integer >= 1; fix: pass "
                         "the number of data-parallel ranks (GPUs / (tensor x pipeline parallel size))")
    values = [ds_config.get(k) for k in BATCH_KEYS]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return 1 if world_size is None else world_size  # DeepSpeed derives the missing ones, or names the bad one
    train, micro, gas = values
    per_rank = micro * gas
    implied = train // per_rank if train % per_rank == 0 else None
    triple = (f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = {micro} x {gas} = {per_rank} "
              "samples per data-parallel rank")
    if world_size is None:
        if implied is None:
            raise ValueError(f"train_batch_size = {train} is not a multiple of {triple}, so no data-parallel size "
                             "fits; fix: set train_batch_size to a multiple of it (train_batch_size = "
                             f"{per_rank} x data-parallel ranks, e.g. {2 * per_rank} for 2), or remove "
                             "train_batch_size and pass --world-size N")
        return implied
    if train != per_rank * world_size:
        other = f", or check at --world-size {implied} (what these values imply)" if implied else ""
        raise ValueError(f"train_batch_size = {train} does not match --world-size {world_size}: {triple}, times "
                         f"{world_size} ranks is {per_rank * world_size}; fix: set train_batch_size to "
                         f"{per_rank * world_size} for {world_size} data-parallel ranks{other}, or remove "
                         "train_batch_size (DeepSpeed derives it)")
    return world_size


def deepspeed_config_at(ds_config: dict, world_size: int):
    """DeepSpeed's own ``DeepSpeedConfig`` of ``ds_config`` parsed for ``world_size`` data-parallel
    ranks, without a process group (its batch checks are those of a real run at that size)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class AtWorldSize(DeepSpeedConfig):
        # DeepSpeedConfig.__init__ takes the data-parallel size from torch.distributed (or an mpu,
        # which needs it too) and falls back to 1 without a process group; it reads it only after
        # _initialize_params, in _configure_train_batch_size.
        def _initialize_params(self, param_dict):
            self.world_size = world_size
            super()._initialize_params(param_dict)

    ds = AtWorldSize(ds_config)
    if ds.world_size != world_size:  # a DeepSpeed that reads it elsewhere: say so rather than check at 1
        raise RuntimeError(f"could not check at data-parallel size {world_size}: this DeepSpeed's config parser "
                           f"used {ds.world_size}")
    return ds


# DeepSpeed's schedulers with an LR warm-up ("scheduler": {"type": ...}); each makes it at least 2 steps.
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def lr_warmup_steps(scheduler_name: Optional[str], scheduler_params: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The LR warm-up's length in optimizer steps of DeepSpeed's ``"scheduler"`` block (its parsed
    ``scheduler_name`` / ``scheduler_params``): ``warmup_num_steps`` of WarmupLR / WarmupDecayLR /
    WarmupCosineLR (DeepSpeed's default 1000), at least 2 as those schedulers make it. None for any other
    scheduler or none (a client scheduler: its warm-up is not known here), and for a value that is not an
    integer yet (the HF Trainer fills ``"auto"`` before the engine is built)."""
    if scheduler_name not in WARMUP_SCHEDULERS:
        return None
    n = (scheduler_params or {}).get("warmup_num_steps", 1000)
    return max(2, n) if isinstance(n, int) and not isinstance(n, bool) else None


def configured_lr_warmup(ds: Any, client_lr_scheduler: Any = None) -> Optional[int]:
    """The LR warm-up of the scheduler DeepSpeed will run for parsed config ``ds`` (a ``DeepSpeedConfig``):
    :func:`lr_warmup_steps` of its ``"scheduler"`` block, but None where the caller passed a client
    ``lr_scheduler`` (an object or a callable): DeepSpeed runs that one and ignores the block."""
    if client_lr_scheduler:  # DeepSpeed's own test (engine._configure_lr_scheduler)
        return None
    return lr_warmup_steps(getattr(ds, "scheduler_name", None), getattr(ds, "scheduler_params", None))
