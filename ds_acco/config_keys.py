"""Every key of a DeepSpeed config, classified for ACCO, and the check of a parsed config against it.

Each key DeepSpeed reads is one of (:data:`KEYS`; ``tests/package/test_config_keys.py`` walks
DeepSpeed's own config parser and fails on a key missing here, so a new DeepSpeed release cannot
slip one through):

- ``honoured``: ACCO behaves as stock ZeRO-1 does with it; the note names the test that shows it.
- ``refused``: the values ACCO does not honour are refused (:func:`check_deepspeed_compat`, a row of
  ``ds_acco.core.checks.refusals.REFUSALS``: the note names it); the other values are honoured.
- ``replaced``: shapes stock's own gradient communication or overflow handling, which ACCO's rounds
  replace; the values ACCO steps with are the same (the engine warns when one is set).
- ``inherited``: acts in DeepSpeed code that ``AccoEngine`` runs unchanged (the model's forward and
  backward, the data loader, checkpoint files): the same as stock, by construction.
- ``irrelevant``: cannot change the gradient, its reduction, the step, the learning rate or the step
  count (logging, profiling), or only matters under a setting that is refused.

A key ending in ``.*`` covers its whole block; ``*`` inside a name is a wildcard (fnmatch).
"""
from __future__ import annotations

import fnmatch
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional

import torch

from .config_deepspeed import WARMUP_SCHEDULERS
from .core.checks.refusals import check_schedule_compat, refuse

KINDS = ("honoured", "refused", "replaced", "inherited", "irrelevant")


class Key(NamedTuple):
    kind: str  # one of KINDS
    note: str  # honoured: the test (path::name); refused: the refusal row; otherwise: why


def _h(test: str) -> Key:
    return Key("honoured", test)


def _r(row: str) -> Key:
    return Key("refused", row)


def _rep(why: str) -> Key:
    return Key("replaced", why)


def _inh(why: str) -> Key:
    return Key("inherited", why)


def _irr(why: str) -> Key:
    return Key("irrelevant", why)


REF = "tests/deepspeed/test_reference.py::test_matches_reference"
SUM = "tests/deepspeed/test_reduction_keys.py::test_gradient_allreduce_op_sum_is_honoured"
FP16 = "tests/deepspeed/test_loss_scaling.py::test_real_fp16_skips_overflows_and_matches_the_reference"
BF16 = "tests/deepspeed/test_mixed_precision.py::test_trains_and_matches_the_fp32_reference_loosely"
WIRE = "tests/comm/test_wire_bytes.py::test_deepspeed_gathers_in_the_model_dtype"
LR = "tests/deepspeed/test_lr_skipped_commit.py::test_every_step_uses_stocks_settings_with_skipped_steps"
TP = "tests/deepspeed/test_autotp.py::test_autotp_matches_the_unsplit_reference"
CKPT = "tests/deepspeed/test_checkpoint.py::test_universal_checkpoint_resumes_at_another_world_size"
STAGE3 = "ZeRO stage 3 only (zero_optimization.stage other than 1 is refused)"
BUCKETS = "shapes stock's bucketed reduce / all-gather, which ACCO's rounds replace (the same sums)"
MODEL = "acts in the model's forward / backward, which AccoEngine inherits unchanged"
LOGGING = "logging, monitoring or profiling"
CHECKPOINT_FILES = "how checkpoint files are written, named or validated"
ZERO1_LOAD = "stock ZeRO-1's state_dict / load_state_dict, which ACCO's optimizer calls unchanged"

KEYS: Dict[str, Key] = {
    # -- batch, accumulation, step --------------------------------------------------------------------
    "train_batch_size": _h(REF), "train_micro_batch_size_per_gpu": _h(REF), "gradient_accumulation_steps": _h(REF),
    "managed_gradient_accumulation": _r("unmanaged_accumulation"),
    "gradient_allreduce_op": _h(SUM),
    "gradient_clipping": _h(REF),
    "prescale_gradients": _rep("where stock divides by the ranks (before or after the sum): the same mean; ACCO "
                               "divides after the sum in its rounds"),
    "gradient_predivide_factor": _rep("stock's split of the division by the ranks around the sum: the same mean"),
    "communication_data_type": _h(WIRE),
    "seq_parallel_communication_data_type": _irr("Ulysses sequence parallelism only (refused: ulysses)"),
    "disable_allgather": _irr("read by no ZeRO-1 code path"),
    "optimizer.*": _h(REF), "scheduler.*": _h(LR),
    "zero_allow_untested_optimizer": _irr("a permission check at construction"),
    "zero_force_ds_cpu_optimizer": _irr("optimizer offload only (refused: optimizer_offload)"),
    # -- precision -----------------------------------------------------------------------------------------
    "fp16.enabled": _h(FP16), "fp16.loss_scale": _h(FP16), "fp16.initial_scale_power": _h(FP16),
    "fp16.loss_scale_window": _h(FP16), "fp16.hysteresis": _h(FP16), "fp16.min_loss_scale": _h(FP16),
    "fp16.consecutive_hysteresis": _h(FP16), "fp16.fp16_master_weights_and_grads": _r("fp16_master_weights"),
    "fp16.auto_cast": _inh(MODEL),
    "bf16.enabled": _h(BF16), "bfloat16.enabled": _h(BF16),
    "bf16.bf16_master_weights_and_grads": _r("bf16_master_weights"),
    "bfloat16.bf16_master_weights_and_grads": _r("bf16_master_weights"),
    "bf16.bf16_optimizer_states": _irr("needs bf16_master_weights_and_grads (refused: bf16_master_weights)"),
    "bfloat16.bf16_optimizer_states": _irr("needs bf16_master_weights_and_grads (refused: bf16_master_weights)"),
    "bf16.check_grad_overflow": _rep("acco.nonfinite decides what a non-finite gradient does (skip or raise)"),
    "bfloat16.check_grad_overflow": _rep("acco.nonfinite decides what a non-finite gradient does (skip or raise)"),
    "bf16.immediate_grad_update": _irr("DeepSpeed's BF16_Optimizer (ZeRO stage 0) only"),
    "bfloat16.immediate_grad_update": _irr("DeepSpeed's BF16_Optimizer (ZeRO stage 0) only"),
    "data_types.grad_accum_dtype": _h(WIRE),
    "data_types.param_dtype": _inh("the model's dtype, cast at initialize"),
    "data_types.buffer_dtype": _inh("the buffers' dtype, cast at initialize"),
    "data_types.keep_in_fp32_modules": _inh("buffers kept in fp32, at initialize"),
    "torch_autocast.enabled": _r("fp16_autocast"), "torch_autocast.dtype": _r("fp16_autocast"),
    "torch_autocast.lower_precision_safe_modules": _inh(MODEL),
    # -- ZeRO ------------------------------------------------------------------------------------------
    "zero_optimization.stage": _r("zero_stage"),
    "zero_optimization.offload_optimizer.*": _r("optimizer_offload"),
    "zero_optimization.cpu_offload": _r("optimizer_offload"),  # deprecated: sets offload_optimizer
    "zero_optimization.zenflow.*": _r("zenflow"),
    "zero_optimization.contiguous_gradients": _rep(BUCKETS), "zero_optimization.reduce_scatter": _rep(BUCKETS),
    "zero_optimization.reduce_bucket_size": _rep(BUCKETS), "zero_optimization.allgather_bucket_size": _rep(BUCKETS),
    "zero_optimization.overlap_comm": _rep(BUCKETS), "zero_optimization.round_robin_gradients": _rep(BUCKETS),
    "zero_optimization.use_multi_rank_bucket_allreduce": _rep(BUCKETS),
    "zero_optimization.allgather_partitions": _rep(BUCKETS),
    "zero_optimization.compute_grad_norm": _rep("ACCO's rounds always compute the norm (its values do not change)"),
    "zero_optimization.parameter_alignment": _inh("the flat groups' padding, which ACCO's buffers map as built"),
    "zero_optimization.ignore_unused_parameters": _irr("an assertion of stock's gradient hooks, which ACCO removes"),
    "zero_optimization.load_from_fp32_weights": _inh(ZERO1_LOAD), "zero_optimization.elastic_checkpoint": _inh(ZERO1_LOAD),
    "zero_optimization.pipeline_loading_checkpoint": _irr(STAGE3),
    "zero_optimization.legacy_stage1": _irr("removed from DeepSpeed (it raises when set)"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _irr(STAGE3),
    "zero_optimization.offload_param.*": _irr(STAGE3), "zero_optimization.cpu_offload_param": _irr(STAGE3),
    "zero_optimization.cpu_offload_use_pin_memory": _irr("optimizer offload only (refused: optimizer_offload)"),
    "zero_optimization.sub_group_size": _irr(STAGE3), "zero_optimization.stage3_*": _irr(STAGE3),
    "zero_optimization.zero_hpz_partition_size": _irr(STAGE3),
    "zero_optimization.zero_quantized_*": _irr(STAGE3 + "; ZeRO++"),
    "zero_optimization.memory_efficient_linear": _irr(STAGE3), "zero_optimization.override_module_apply": _irr(STAGE3),
    "zero_optimization.log_trace_cache_warnings": _irr(STAGE3), "zero_optimization.enable_sanity_checks": _irr(STAGE3),
    "zero_optimization.leaf_module.*": _irr(STAGE3),
    # -- engines and parallelism ------------------------------------------------------------------------
    "hybrid_engine.enabled": _r("hybrid_engine"),
    "hybrid_engine.*": _irr("read only with hybrid_engine.enabled (refused: hybrid_engine)"),
    "compile.deepcompile": _r("deepcompile"),
    "compile.*": _irr("options of DeepCompile (refused: deepcompile)"),
    "pipeline.*": _irr("DeepSpeed's pipeline engine only (refused: pipeline_module)"),
    "tensor_parallel.*": _h(TP),
    "expert_parallel.enabled": _r("moe_experts"),
    "expert_parallel.*": _irr("read only with expert_parallel.enabled (refused: moe_experts)"),
    "use_data_before_expert_parallelism": _irr("MoE experts only (refused: moe_experts)"),
    "sequence_parallel_size": _r("ulysses"), "data_parallel_size": _inh("the mesh deepspeed.initialize builds"),
    "weight_quantization.*": _irr("inference and the hybrid engine only"),
    # -- data --------------------------------------------------------------------------------------------
    "data_efficiency.data_sampling.dynamic_batching.enabled": _r("dynamic_batching"),
    "data_efficiency.data_sampling.dynamic_batching.*": _irr("read only with dynamic_batching.enabled (refused)"),
    "data_efficiency.*": _inh("DeepSpeed's data sampler and random-LTD layers (curriculum by engine.global_steps, "
                              "ACCO's committed steps)"),
    "dataloader_drop_last": _inh("DeepSpeed's data loader"),
    "activation_checkpointing.*": _inh(MODEL),
    # -- files, logs, tools --------------------------------------------------------------------------------
    "checkpoint.load_universal": _h(CKPT), "checkpoint.*": _irr(CHECKPOINT_FILES),
    "datastates_ckpt.*": _irr(CHECKPOINT_FILES), "aio.*": _irr("NVMe offload I/O (offload is refused)"),
    "steps_per_print": _irr(LOGGING), "wall_clock_breakdown": _irr(LOGGING), "memory_breakdown": _irr(LOGGING),
    "dump_state": _irr(LOGGING), "log_level": _irr(LOGGING), "flops_profiler.*": _irr(LOGGING),
    "comms_logger.*": _irr(LOGGING), "tensorboard.*": _irr(LOGGING), "wandb.*": _irr(LOGGING),
    "csv_monitor.*": _irr(LOGGING), "comet.*": _irr(LOGGING),
    "timers.*": _irr(LOGGING + " (ACCO leaves the throughput timer unsynchronised)"),
    "autotuning.*": _irr("the autotuner's experiments, which write the batch keys above"),
    "vocabulary_size": _irr("a warning about tensor-core alignment"),
    "disable_python_gc": _irr("when Python's garbage collector runs"),
}


def classify(path: str) -> Optional[Key]:
    """The entry covering ``path`` (dotted, e.g. ``zero_optimization.stage``): its own, else the
    nearest enclosing ``block.*``, else a wildcard entry; None when the key is unclassified."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        block = ".".join(parts[:n]) + ".*"
        if block in KEYS:
            return KEYS[block]
    for pattern, key in KEYS.items():
        if not pattern.endswith(".*") and "*" in pattern and fnmatch.fnmatchcase(path, pattern):
            return key
    return None


def set_keys(raw: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key a config sets (into nested objects)."""
    for name, value in raw.items():
        yield prefix + name
        if isinstance(value, Mapping):
            yield from set_keys(value, f"{prefix}{name}.")


def _deepspeed_default(path: str) -> Any:
    """DeepSpeed's own default for a ``replaced`` key (its config models' and constants'), or a
    sentinel equal to nothing when it has none."""
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    block, _, name = path.rpartition(".")
    model = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config,
             "bfloat16": DeepSpeedBF16Config}.get(block)
    if model is not None:
        field = model.model_fields.get(name)
        if name == "overlap_comm":
            return False  # None in the model: DeepSpeed sets it to stage == 3, and ACCO runs stage 1
        return field.default if field is not None else object()
    return getattr(constants, f"{path.upper()}_DEFAULT", object())


def replaced_keys(raw: Mapping[str, Any]) -> List[str]:
    """The keys ``raw`` sets, to a value other than DeepSpeed's default, that ACCO's own
    communication replaces (the engine warns about them: a template that spells out the defaults,
    as Megatron's do, is not warned about)."""
    def value(path: str) -> Any:
        node: Any = raw
        for part in path.split("."):
            node = node[part]
        return node
    return [k for k in set_keys(raw) if (classify(k) or Key("", "")).kind == "replaced"
            and value(k) != _deepspeed_default(k)]


def check_lr_warmup(acco, scheduler_name: Optional[str], client_lr_scheduler: Any = None) -> None:
    """Refuse ``"sync_warmup_steps": "lr_warmup"`` where the run's LR warm-up cannot be read: no DeepSpeed
    warm-up scheduler in the config (``scheduler_name``: its ``"scheduler"`` block's type), or a client
    ``lr_scheduler``, which DeepSpeed runs instead of the block. Check point 1 runs it on the raw config, before
    any process group; the warm-up's value itself (an integer once the HF Trainer fills ``"auto"``) is read when
    the engine builds its optimizer."""
    if acco.sync_warmup_steps != "lr_warmup" or (scheduler_name in WARMUP_SCHEDULERS and not client_lr_scheduler):
        return
    scheduler = ("a client lr_scheduler passed to initialize (DeepSpeed runs it, not the config's \"scheduler\")"
                 if client_lr_scheduler else f"scheduler.type = {scheduler_name!r}" if scheduler_name
                 else 'no "scheduler" block')
    raise refuse("acco_lr_warmup_unknown", f'acco.sync_warmup_steps = "lr_warmup" with {scheduler}')


def check_requested_lr_warmup(acco, raw: Optional[Mapping[str, Any]], client_lr_scheduler: Any = None) -> None:
    """:func:`check_lr_warmup` at check point 1, on the raw config the caller passed (its "scheduler" block)."""
    scheduler = (raw or {}).get("scheduler")
    if acco.enabled:
        check_lr_warmup(acco, scheduler.get("type") if isinstance(scheduler, Mapping) else None, client_lr_scheduler)


def check_deepspeed_compat(acco, ds, client_lr_scheduler: Any = None) -> None:
    """Refuse the DeepSpeed settings ACCO does not honour (the ``refused`` rows of :data:`KEYS`), naming
    the key, the value and the fix. ``ds`` is DeepSpeed's parsed ``DeepSpeedConfig``;
    ``client_lr_scheduler`` the ``lr_scheduler`` the caller passed to ``initialize``, if any."""
    check_schedule_compat(acco, ds.gradient_accumulation_steps, ds.float16_config)
    check_lr_warmup(acco, ds.scheduler_name, client_lr_scheduler)
    if getattr(ds, "gradient_allreduce_op", "mean") == "sum" and (acco.accumulation != "fixed"
                                                                 or acco.weighting != "micro_batch"):
        raise refuse("sum_not_fixed", f'gradient_allreduce_op = "sum" with accumulation = {acco.accumulation!r}, '
                                      f"weighting = {acco.weighting!r}")
    if getattr(ds, "managed_gradient_accumulation", True) is False:
        raise refuse("unmanaged_accumulation", "managed_gradient_accumulation = false")
    bf16 = getattr(ds, "bfloat16_config", None)
    if bf16 is not None and getattr(bf16, "bf16_master_weights_and_grads", False):
        raise refuse("bf16_master_weights", "bf16.bf16_master_weights_and_grads = true")
    autocast_dtype = getattr(ds, "torch_autocast_dtype", None)
    if getattr(ds, "torch_autocast_enabled", False) and autocast_dtype in (None, torch.float16):
        raise refuse("fp16_autocast", f"torch_autocast.enabled = true with dtype {autocast_dtype or 'unset'}")
    stage = ds.zero_config.stage if ds.zero_enabled else 0
    if stage != 1:
        raise refuse("zero_stage", f"zero_optimization.stage = {stage}")
    offload = ds.zero_config.offload_optimizer
    device = str(getattr(getattr(offload, "device", None), "value", getattr(offload, "device", "none")))
    if offload is not None and device != "none":
        raise refuse("optimizer_offload", f"zero_optimization.offload_optimizer.device = {device!r}")
    if getattr(ds.zero_config, "zenflow", None) is not None:
        raise refuse("zenflow", "zero_optimization.zenflow is set")
    if getattr(ds, "hybrid_engine", None) is not None and ds.hybrid_engine.enabled:
        raise refuse("hybrid_engine", "hybrid_engine.enabled = true")
    if getattr(getattr(ds, "compile_config", None), "deepcompile", False):
        raise refuse("deepcompile", "compile.deepcompile = true")
    if getattr(getattr(ds, "expert_parallel_config", None), "enabled", False):
        raise refuse("moe_experts", "acco.enabled = true with expert_parallel.enabled = true (AutoEP)")
    sampling = (getattr(ds, "data_efficiency_config", None) or {}).get("data_sampling") or {}
    if (sampling.get("dynamic_batching") or {}).get("enabled"):
        raise refuse("dynamic_batching", "data_efficiency.data_sampling.dynamic_batching.enabled = true")
