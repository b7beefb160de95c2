"""The ``"acco"`` block of a DeepSpeed JSON config: one typed model, defaults in one place.

Every error is a ``ValueError`` that names the key, the bad value and the fix. DeepSpeed
ignores unknown top-level keys, so nothing but this module ever reads the block.
"""
from __future__ import annotations

import base64
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ACCO_KEY = "acco"

if TYPE_CHECKING:
    from .core.refusals import ParallelLayout

# What ACCO refuses lives in ds_acco.core.refusals (one table); these names kept their old import
# path. Resolved on first use: importing the config must not import the core.
_IN_REFUSALS = ("LAYOUT_REFUSALS", "LOCKSTEP_FIX", "LOCKSTEP_WHY", "UNEVEN_STEPS", "ParallelLayout",
                "caller_boundary_refusal", "check_deepspeed_compat", "check_layout", "check_lockstep",
                "check_schedule_compat")


def __getattr__(name: str):
    if name in _IN_REFUSALS:
        from .core import refusals
        return getattr(refusals, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DynamicConfig(BaseModel):
    """When a phase ends in ``"accumulation": "dynamic"``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    min_micro_batches: int = Field(1, ge=1, description="A phase never ends before this many micro-batches.")
    max_micro_batches: Optional[int] = Field(
        None, ge=1, description="A phase ends here even if its round is still running (the wait is measured); "
        "default 4 x the fixed phase length.")
    check_every: int = Field(1, ge=1, description="Poll the round's completion every this many micro-batches.")
    lr_scaling: Literal["none", "sqrt", "linear"] = Field(
        "none", description="Scale each round's learning rate by (its global micro-batches / what fixed "
        "accumulation would give it) to this power (none: 0, sqrt: 0.5, linear: 1), so that the larger "
        "batches of long rounds move the weights further. SGD / Adam / AdamW read the scaled rate without "
        "writing the param groups; other optimizers have it written there for the step only.")

    @property
    def lr_power(self) -> float:
        return {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[self.lr_scaling]


class MetricsConfig(BaseModel):
    """Per-step overlap metrics."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    log_every: int = Field(0, ge=0, description="Rank 0 logs a metrics line every N committed steps (0: never).")
    estimate_drift: bool = Field(True, description="Measure |θ̃_{t+1} − θ_{t+1}| / |θ_{t+1} − θ_t| (acco mode).")
    monitor: bool = Field(True, description="Write the metrics through DeepSpeed's monitor (tensorboard, csv, "
                          "wandb blocks).")


class EstimateConfig(BaseModel):
    """How the estimate round computes θ̃_{t+1} (docs/estimate.md gives each as its recurrence). The
    paper's estimate is ``"estimate": "paper"`` (lr_scale 1, second_moment 'update', no delay
    compensation)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    lr_scale: float = Field(
        1.0, gt=0, le=8, description="The estimate's optimizer step uses the learning rate times this (its "
        "weight decay too): 1 is the paper's estimate; above 1 the first half of the next batch is computed "
        "further along the update (a look-ahead).")
    second_moment: Literal["update", "committed"] = Field(
        "update", description="Adam's second moment in the estimate: 'update' it with the half-batch gradient "
        "(the paper), or reuse the 'committed' one (bias-corrected for the committed steps).")
    delay_compensation: float = Field(
        0.0, ge=0, description="λ of DC-ASGD-a in the commit: the first-half mean gradient becomes "
        "g̃ + λ g̃ ⊙ g̃ ⊙ (θ_t − θ̃_t) / (√v̂_t + ε) (Adam only; one extra fp32 shard per rank). 0: off.")

    @classmethod
    def paper(cls) -> "EstimateConfig":
        return cls(lr_scale=1.0, second_moment="update", delay_compensation=0.0)


class AccoConfig(BaseModel):
    """Settings of the ``"acco"`` block (see the README's config reference)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = Field(False, description="Use ACCO; false gives stock ZeRO-1, bit for bit.")
    mode: Literal["acco", "dpu"] = Field(
        "acco", description="'acco': estimate + commit rounds; 'dpu': one-step-delayed update.")
    accumulation: Literal["fixed", "dynamic", "shared"] = Field(
        "fixed", description="'fixed': A/2 (acco) or A (dpu) micro-batches per phase; 'dynamic': a phase ends "
        "when its round has finished; 'shared': fixed's global count per phase (ranks x A/2, or x A), shared "
        "among the ranks by their measured speed.")
    dynamic: Optional[DynamicConfig] = Field(None, description="Settings of accumulation 'dynamic'.")
    weighting: Literal["micro_batch", "sample", "token"] = Field(
        "micro_batch", description="What each gradient is averaged over; 'sample' / 'token' need "
        "engine.backward(loss, weight=n).")
    nonfinite: Literal["skip", "raise"] = Field(
        "skip", description="A round whose global mean gradient has inf/NaN: 'skip' its update (counted in "
        "engine.skipped_steps; the estimate falls back to θ) or 'raise' an error.")
    sigterm: Literal["off", "stop", "checkpoint"] = Field(
        "off", description="On SIGTERM: 'off' leaves signal handling alone; 'stop' makes every rank stop at the "
        "same round and exit (code 143) after draining; 'checkpoint' also saves a checkpoint to "
        "sigterm_checkpoint_dir first.")
    sigterm_checkpoint_dir: Optional[str] = Field(None, description="Where 'checkpoint' saves on SIGTERM.")
    estimate_comm_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        None, description="Send the estimate round in this dtype (e.g. 'bf16' while gradients travel in fp32); "
        "the estimate is discarded, so only its precision drops. Default: the communication dtype.")
    synchronous: bool = Field(
        False, description="Debug: run every round inline (no overlap); results are bit-identical.")
    comm_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for a communication round before raising.")
    chunk_elements: Union[Literal["auto"], int] = Field(
        "auto", description="Rounds work through a shard in windows of at most this many elements (gradient "
        "norm, drift metric, functional optimizer step): the bound on their temporaries (a few windows' worth), "
        "and what their kernel count follows. 'auto': on CPU 2M elements and at most 1/64 of the shard "
        "(not below 64K); on accelerators at least 64M elements, or the whole shard when its workspace fits in "
        "1/16 of the free device memory. An integer >= 1024 overrides it.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Per-step overlap metrics.")
    estimate: EstimateConfig = Field(default_factory=EstimateConfig, description="How the estimate round "
                                     "computes θ̃ (mode 'acco'); \"paper\" for the paper's estimate.")
    sync_warmup_steps: int = Field(
        0, ge=0, description="The first N optimizer steps run stock's synchronous schedule (one round per "
        "step, waited for at once; ACCO's buffers), then ACCO starts from there (fixed accumulation).")

    @field_validator("estimate", mode="before")
    @classmethod
    def _estimate(cls, v: Any) -> Any:
        if v == "paper" and isinstance(v, str):
            return EstimateConfig.paper()
        if isinstance(v, str):
            raise ValueError("must be \"paper\" or an object such as {\"lr_scale\": 2.0}")
        if isinstance(v, Mapping) and isinstance(v.get("lr_scale"), int) and not isinstance(v["lr_scale"], bool):
            return {**v, "lr_scale": float(v["lr_scale"])}  # JSON writers emit 2 for 2.0
        if isinstance(v, Mapping) and isinstance(v.get("delay_compensation"), int) \
                and not isinstance(v["delay_compensation"], bool):
            return {**v, "delay_compensation": float(v["delay_compensation"])}
        return v

    @field_validator("chunk_elements", mode="before")
    @classmethod
    def _chunk_elements(cls, v: Any) -> Any:
        if v == "auto" and isinstance(v, str):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1024:
            raise ValueError("must be \"auto\" (chosen per device) or an integer number of elements >= 1024")
        return v

    @classmethod
    def _coerce(cls, block: Mapping[str, Any]) -> dict:
        # strict=True refuses ints for floats; JSON writers often emit 600 for 600.0.
        out = dict(block)
        v = out.get("comm_timeout_s")
        if isinstance(v, int) and not isinstance(v, bool):
            out["comm_timeout_s"] = float(v)
        return out

    @classmethod
    def from_block(cls, block: Any) -> "AccoConfig":
        """Validate a raw ``"acco"`` block (dict or None) into a config."""
        if block is None:
            return cls()
        if not isinstance(block, Mapping):
            raise ValueError(f"config key '{ACCO_KEY}' must be a JSON object, got {type(block).__name__} "
                             f"{block!r}; fix: write e.g. \"acco\": {{\"enabled\": true}}")
        try:
            cfg = cls.model_validate(cls._coerce(block))
        except ValidationError as exc:
            raise ValueError(_explain(exc, block)) from None
        if cfg.dynamic is not None and cfg.accumulation != "dynamic":
            raise ValueError(f"acco.dynamic = {block.get('dynamic')!r} has no effect with acco.accumulation = "
                             f"{cfg.accumulation!r}; fix: set \"accumulation\": \"dynamic\" or remove "
                             "acco.dynamic")
        if cfg.sigterm == "checkpoint" and not cfg.sigterm_checkpoint_dir:
            raise ValueError("acco.sigterm = 'checkpoint' needs acco.sigterm_checkpoint_dir; fix: set it to a "
                             "directory or use \"sigterm\": \"stop\"")
        if cfg.sigterm_checkpoint_dir and cfg.sigterm != "checkpoint":
            raise ValueError(f"acco.sigterm_checkpoint_dir = {cfg.sigterm_checkpoint_dir!r} has no effect with "
                             f"acco.sigterm = {cfg.sigterm!r}; fix: set \"sigterm\": \"checkpoint\" or remove it")
        if cfg.mode == "dpu" and ("estimate" in block or cfg.sync_warmup_steps):
            key = "estimate" if "estimate" in block else "sync_warmup_steps"
            raise ValueError(f"acco.{key} = {block.get(key)!r} has no effect with acco.mode = 'dpu' (DPU has no "
                             f"estimate round); fix: remove acco.{key} or use \"mode\": \"acco\"")
        if cfg.sync_warmup_steps and cfg.accumulation != "fixed":
            raise ValueError(f"acco.sync_warmup_steps = {cfg.sync_warmup_steps} with acco.accumulation = "
                             f"{cfg.accumulation!r}: the synchronous warm-up runs stock's fixed schedule; fix: use "
                             "\"accumulation\": \"fixed\" or remove sync_warmup_steps")
        d = cfg.dynamic
        if d is not None and d.max_micro_batches is not None and d.max_micro_batches < d.min_micro_batches:
            raise ValueError(f"acco.dynamic.max_micro_batches = {d.max_micro_batches} is below "
                             f"acco.dynamic.min_micro_batches = {d.min_micro_batches}; fix: raise "
                             "max_micro_batches or lower min_micro_batches")
        return cfg

    def phase_length(self, gradient_accumulation_steps: int) -> int:
        """Micro-batches per phase and rank in fixed accumulation (in 'shared': the equal share)."""
        return gradient_accumulation_steps // 2 if self.mode == "acco" else gradient_accumulation_steps

    def phase_policy(self, gradient_accumulation_steps: int):
        """The core's phase policy for this config (what ends a phase)."""
        from .core.phases import DynamicPhases, FixedPhases, SharedPhases
        if self.accumulation == "dynamic":
            d = self.dynamic_bounds(gradient_accumulation_steps)
            return DynamicPhases(d.min_micro_batches, d.max_micro_batches, d.check_every)
        if self.accumulation == "shared":
            return SharedPhases(self.phase_length(gradient_accumulation_steps))
        return FixedPhases(self.phase_length(gradient_accumulation_steps))

    def dynamic_bounds(self, gradient_accumulation_steps: int) -> DynamicConfig:
        """The dynamic settings with defaults resolved against the fixed phase length."""
        d = self.dynamic or DynamicConfig()
        if d.max_micro_batches is None:
            d = d.model_copy(update={"max_micro_batches": max(d.min_micro_batches,
                                                              4 * self.phase_length(gradient_accumulation_steps))})
        return d


def _explain(exc: ValidationError, block: Mapping[str, Any]) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) or "<block>"
        value: Any = block
        model: Any = AccoConfig
        field = None
        for part in loc:
            value = value.get(part, "<missing>") if isinstance(value, Mapping) else "<missing>"
            fields = getattr(model, "model_fields", {})
            field = fields.get(part)
            model = _submodel(field)
        if err["type"] == "extra_forbidden":
            parent = AccoConfig
            for part in loc[:-1]:
                parent = _submodel(parent.model_fields.get(part)) or parent
            known = ", ".join(parent.model_fields)
            lines.append(f"acco.{key} = {value!r}: unknown key; fix: remove it or use one of: {known}")
        elif field is not None:
            hint = f" ({field.description})" if field.description else ""
            default = field.default if field.default_factory is None else "{}"
            lines.append(f"acco.{key} = {value!r}: {err['msg']}{hint}; fix: set a valid value or remove the key "
                         f"to get the default {default!r}")
        else:
            lines.append(f"acco.{key} = {value!r}: {err['msg']}; fix: see the README's config reference")
    return "invalid \"acco\" block: " + "; ".join(lines)


def _submodel(field):
    """The pydantic model class a field holds (directly or as Optional), if any."""
    if field is None:
        return None
    ann = field.annotation
    for cand in (ann, *getattr(ann, "__args__", ())):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


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


def acco_config_of(ds_config: Optional[Mapping[str, Any]]) -> AccoConfig:
    """The validated ``"acco"`` block of a DeepSpeed config dict (defaults if absent)."""
    return AccoConfig.from_block((ds_config or {}).get(ACCO_KEY))


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
    from .core.refusals import ParallelLayout
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


# -- an enabled block that would train stock ---------------------------------------------------------
OPT_OUT_ENV = "DS_ACCO"  # DS_ACCO=off: an enabled "acco" block is ignored, DeepSpeed trains stock ZeRO
_opt_out_noted = False


def opted_out(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``DS_ACCO=off`` is set: a user who shares one config between stock and ACCO runs
    trains stock with it on purpose. Any other non-empty value is an error naming the variable."""
    value = (os.environ if environ is None else environ).get(OPT_OUT_ENV, "").strip()
    if value.lower() == "off":
        return True
    if value:
        raise ValueError(f"{OPT_OUT_ENV} = {value!r}: unknown value; fix: {OPT_OUT_ENV}=off to train stock DeepSpeed "
                         "ZeRO with a config whose \"acco\" block is enabled, or unset it (ACCO then runs where the "
                         "launch routes to ds_acco: python -m ds_acco run, DS_ACCO_INSTALL=1, ds_acco.install())")
    return False


def note_opt_out(rank: Optional[int] = None) -> None:
    """Say once per process, on rank 0, that ``DS_ACCO=off`` set an enabled block aside."""
    global _opt_out_noted
    if _opt_out_noted:
        return
    _opt_out_noted = True
    if rank is None:
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(f"ds_acco: {OPT_OUT_ENV}=off: the config's \"acco\" block is enabled but ignored; DeepSpeed trains "
              "stock ZeRO", file=sys.stderr, flush=True)


RUN_THROUGH_DS_ACCO = ("launch the script through ds_acco: `python -m ds_acco run SCRIPT.py ARGS` (`torchrun ... -m "
                       "ds_acco run SCRIPT.py ARGS`, `deepspeed ... --module ds_acco run SCRIPT.py ARGS`, "
                       "`accelerate launch -m ds_acco run SCRIPT.py ARGS`), or set DS_ACCO_INSTALL=1 in its "
                       "environment, or call `import ds_acco; ds_acco.install()` before the code that builds the "
                       "engine (or ds_acco.initialize instead of deepspeed.initialize)")


def stock_engine_refusal(engine_class: str, routing_installed: bool) -> str:
    """Why a stock ``engine_class`` must not be built from a config whose ``"acco"`` block is
    enabled, and the launch fix: DeepSpeed ignores the block, so the run would measure stock ZeRO."""
    head = (f"this DeepSpeed config has \"{ACCO_KEY}\": {{\"enabled\": true}}, but the engine being built is a stock "
            f"{engine_class}: DeepSpeed ignores the \"{ACCO_KEY}\" block, so this run would train stock ZeRO without "
            "ACCO")
    if routing_installed:
        why = ("; ds_acco.install() is in effect, but this engine did not come through it: a deepspeed.initialize "
               "looked up before install() (e.g. `from deepspeed import initialize` in a module imported earlier), "
               "or an engine constructed directly; fix: call ds_acco.install() before the training code imports "
               "deepspeed (or launch through `python -m ds_acco run` or DS_ACCO_INSTALL=1, which install it as "
               "deepspeed is imported), or build the engine with ds_acco.initialize")
    else:
        why = f"; fix: {RUN_THROUGH_DS_ACCO}"
    return (f"{head}{why}. To train stock ZeRO with this config on purpose, set {OPT_OUT_ENV}=off (or "
            f"\"{ACCO_KEY}\": {{\"enabled\": false}}).")
