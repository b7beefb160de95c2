"""The ``"acco"`` block of a DeepSpeed JSON config: one typed model, defaults in one place.

Every error is a ``ValueError`` that names the key, the bad value and the fix. DeepSpeed
ignores unknown top-level keys, so nothing but this module ever reads the block.
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ACCO_KEY = "acco"


class AccoConfig(BaseModel):
    """Settings of the ``"acco"`` block (see the README's config reference)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = Field(False, description="Use ACCO; false gives stock ZeRO-1, bit for bit.")
    mode: Literal["acco", "dpu"] = Field(
        "acco", description="'acco': estimate + commit rounds; 'dpu': one-step-delayed update.")
    accumulation: Literal["fixed", "dynamic"] = Field(
        "fixed", description="'fixed': A/2 (acco) or A (dpu) micro-batches per phase.")
    synchronous: bool = Field(
        False, description="Debug: run every round inline (no overlap); results are bit-identical.")
    comm_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for a communication round before raising.")

    # strict=True refuses ints for floats; JSON writers often emit 600 for 600.0.
    @classmethod
    def _coerce(cls, block: Mapping[str, Any]) -> dict:
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
        if cfg.enabled and cfg.accumulation == "dynamic":
            raise ValueError("acco.accumulation = 'dynamic' is not available in this version of ds_acco; "
                             "fix: use \"accumulation\": \"fixed\"")
        return cfg


def _explain(exc: ValidationError, block: Mapping[str, Any]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<block>"
        value = block.get(err["loc"][0], "<missing>") if err["loc"] else block
        if err["type"] == "extra_forbidden":
            known = ", ".join(AccoConfig.model_fields)
            lines.append(f"acco.{key} = {value!r}: unknown key; fix: remove it or use one of: {known}")
        else:
            field = AccoConfig.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            hint = f" ({field.description})" if field is not None and field.description else ""
            lines.append(f"acco.{key} = {value!r}: {err['msg']}{hint}; fix: set a valid value or remove the key "
                         f"to get the default {field.default!r}" if field is not None else f"acco.{key}: {err['msg']}")
    return "invalid \"acco\" block: " + "; ".join(lines)


def load_ds_config(config: Any = None, args: Any = None) -> Optional[dict]:
    """Resolve a DeepSpeed config the way ``deepspeed.initialize`` does: a dict, a JSON path,
    or ``args.deepspeed_config``. Returns None when none was given (DeepSpeed will complain)."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise ValueError(f"DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}")


def acco_config_of(ds_config: Optional[Mapping[str, Any]]) -> AccoConfig:
    """The validated ``"acco"`` block of a DeepSpeed config dict (defaults if absent)."""
    return AccoConfig.from_block((ds_config or {}).get(ACCO_KEY))


def check_deepspeed_compat(acco: AccoConfig, ds) -> None:
    """Refuse DeepSpeed settings ACCO would misinterpret. ``ds`` is a resolved ``DeepSpeedConfig``."""
    gas = ds.gradient_accumulation_steps
    if acco.mode == "acco" and (gas < 2 or gas % 2):
        raise ValueError(f"gradient_accumulation_steps = {gas}: acco.mode 'acco' splits each optimizer step into "
                         "two equal halves (estimate, commit), so it needs an even value >= 2; fix: set "
                         f"gradient_accumulation_steps to {max(2, gas + gas % 2)} or use \"mode\": \"dpu\"")
    stage = ds.zero_config.stage if ds.zero_enabled else 0
    if stage != 1:
        raise ValueError(f"zero_optimization.stage = {stage}: ACCO is a ZeRO stage 1 optimizer; fix: set "
                         "\"zero_optimization\": {\"stage\": 1} or disable acco")
    offload = ds.zero_config.offload_optimizer
    device = str(getattr(getattr(offload, "device", None), "value", getattr(offload, "device", "none")))
    if offload is not None and device != "none":
        raise ValueError(f"zero_optimization.offload_optimizer.device = {device!r}: ACCO keeps the "
                         "sharded optimizer on the accelerator; fix: remove offload_optimizer or disable acco")
    if ds.float16_config.enabled:
        raise ValueError("fp16.enabled = true: fp16 loss scaling is not supported by this version of ds_acco; "
                         "fix: use \"bf16\": {\"enabled\": true} or fp32")
    if ds.bfloat16_config.enabled and ds.grad_accum_dtype is not None and str(ds.grad_accum_dtype) in ("fp32", "float32",
                                                                                                       "torch.float32"):
        raise ValueError("data_types.grad_accum_dtype = 'fp32' with bf16: DeepSpeed routes this combination to its "
                         "BF16_Optimizer, not to ZeRO-1, so ACCO would never run; fix: remove "
                         "data_types.grad_accum_dtype (bf16 accumulation) or disable acco")
    if getattr(ds.zero_config, "zenflow", None) is not None:
        raise ValueError("zero_optimization.zenflow is set: ZenFlow replaces the ZeRO optimizer ACCO extends; "
                         "fix: remove zenflow or disable acco")
    if getattr(ds, "hybrid_engine", None) is not None and ds.hybrid_engine.enabled:
        raise ValueError("hybrid_engine.enabled = true: not supported with ACCO; fix: disable one of them")
