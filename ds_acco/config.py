"""The ``"acco"`` block of a DeepSpeed JSON config: one typed model, defaults in one place.

Every error is an ``AccoRefusal`` (a ``ValueError``) that names the key, the bad value and the fix,
and carries its row of the refusal table (``acco_*`` rows of ``ds_acco.core.checks.refusals``; that
table is imported only when an error is raised: importing this module does not import the core).
DeepSpeed ignores unknown top-level keys, so nothing but this module ever reads the block: an entry
point parses it once (:meth:`AccoConfig.from_block`) and hands the parsed object down.
"""
from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Reading DeepSpeed's config and the launch's opt-out have modules of their own; their names stay
# importable from here.
from .config_deepspeed import (ACCO_KEY, BATCH_KEYS, data_parallel_size, deepspeed_config_at,  # noqa: F401
                               load_ds_config, marked_params, requested_layout, steps_with_increment)
from .config_routing import (OPT_OUT_ENV, RUN_THROUGH_DS_ACCO, note_opt_out, opted_out,  # noqa: F401
                             stock_engine_refusal)

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


MAX_CHUNK_ELEMENTS = 1 << 26  # acco.chunk_elements' hard bound (ds_acco.core.step.chunking.MAX_CHUNK_ELEMS)
DRIFT_EVERY = 100  # the drift metric's default sampling: one commit in 100 pays its pass over the shard


class MetricsConfig(BaseModel):
    """Per-step overlap metrics."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    log_every: int = Field(0, ge=0, description="Rank 0 logs a metrics line every N committed steps (0: never).")
    estimate_drift: bool = Field(True, description="Measure |θ̃_{t+1} − θ_{t+1}| / |θ_{t+1} − θ_t| and the "
                                 "cosine of the two updates (acco mode), in the commits estimate_drift_every picks.")
    estimate_drift_every: int = Field(
        DRIFT_EVERY, ge=1, description="With estimate_drift: measure it in the commit of every N-th optimizer step "
        "(steps 0, N, 2N, ...; 1: every commit). Each measured commit makes one extra pass over the shard.")

    def drift_every(self) -> int:
        """Every how many steps a commit measures the drift (0: never)."""
        return self.estimate_drift_every if self.estimate_drift else 0
    monitor: bool = Field(True, description="Write the metrics through DeepSpeed's monitor (tensorboard, csv, "
                          "wandb blocks).")


DEFAULT_LR_SCALE = 2.0  # the look-ahead estimate: beat stock at every setting measured (docs/estimate.md)


class EstimateConfig(BaseModel):
    """How the estimate round computes θ̃_{t+1} (docs/estimate.md gives each as its recurrence). The
    default is the look-ahead estimate (lr_scale 2): the estimate's step takes twice the learning
    rate. The paper's estimate is ``"estimate": "paper"`` (lr_scale 1, second_moment 'update', no
    delay compensation), v0.3's behaviour bit for bit."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    lr_scale: float = Field(
        DEFAULT_LR_SCALE, gt=0, le=8, description="The estimate's optimizer step uses the learning rate times "
        "this (its weight decay too): 1 is the paper's estimate; above 1 the first half of the next batch is "
        "computed further along the update (a look-ahead). Default 2: median held-out loss below stock's in "
        "every setting measured, where the paper's estimate trails it by up to 3.1% (docs/estimate.md).")
    second_moment: Literal["update", "committed"] = Field(
        "update", description="Adam's second moment in the estimate: 'update' it with the half-batch gradient "
        "(the paper), or reuse the 'committed' one (bias-corrected for the committed steps).")
    delay_compensation: float = Field(
        0.0, ge=0, description="λ of DC-ASGD-a in the commit: the first-half mean gradient becomes "
        "g̃ + λ g̃ ⊙ g̃ ⊙ (θ_t − θ̃_t) / (√v̂_t + ε) (Adam only; one extra fp32 shard per rank). 0: off.")

    @classmethod
    def paper(cls) -> "EstimateConfig":
        return cls(lr_scale=1.0, second_moment="update", delay_compensation=0.0)

    def name(self) -> str:
        """This estimate as the start-up banner names it: "the paper's", the default's name, or the
        keys that depart from the paper's (docs/estimate.md specifies each)."""
        if self == self.paper():
            return "the paper's"
        keys = [f"lr_scale={self.lr_scale:g}"] if self.lr_scale != 1.0 else []
        keys += [f"second_moment={self.second_moment}"] if self.second_moment != "update" else []
        keys += [f"delay_compensation={self.delay_compensation:g}"] if self.delay_compensation else []
        default = " (the default)" if self == type(self)() else ""
        kind = "look-ahead" if self.lr_scale > 1.0 else "variant"
        return f"{kind} {', '.join(keys)}{default}"


PREDICTOR_COEFS = {"ef": 0.5, "ext": 1.0, "nag": 1.0}  # ds_acco.core.step.predict.PREDICTORS' defaults


class PredictorConfig(BaseModel):
    """Mode 'one_round': the point P_{t+1} the whole next step is computed at (docs/estimate.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Literal["ef", "ext", "nag"] = Field(
        "ef", description="'ef' (error feedback, γ), 'ext' (extrapolation, c) or 'nag' (AdamW look-ahead along "
        "the momentum, c; torch Adam / AdamW only).")
    coef: Optional[float] = Field(None, ge=0, le=8, description="γ of ef (below 1; default 0.5) or c of ext / nag "
                                  "(default 1).")

    @property
    def value(self) -> float:
        return PREDICTOR_COEFS[self.name] if self.coef is None else self.coef


class AccoConfig(BaseModel):
    """Settings of the ``"acco"`` block (see the README's config reference)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = Field(False, description="Use ACCO; false gives stock ZeRO-1, bit for bit.")
    mode: Literal["acco", "dpu", "one_round", "auto"] = Field(
        "acco", description="'acco': estimate + commit rounds; 'dpu': one-step-delayed update; 'one_round': one "
        "commit round per step, the next step computed at a predicted point (acco.predictor); 'auto': the first "
        "auto_probe_steps steps are stock's and measure a round against the compute, then every rank runs the "
        "mode of auto_modes the measured times predict fastest (stock unless an ACCO mode is 5% faster).")
    auto_probe_steps: int = Field(
        3, ge=2, description="Mode 'auto': the stock steps before the decision (the first is a warm-up, not "
        "measured; the others' medians decide).")
    auto_modes: Tuple[Literal["stock", "acco", "one_round"], ...] = Field(
        ("stock", "acco"), description="Mode 'auto': the modes it may choose; \"stock\" and at least one of "
        "\"acco\" (fixed accumulation) and \"one_round\" (which trains worse than stock: opt in by listing it).")
    predictor: Optional[PredictorConfig] = Field(
        None, description="Mode 'one_round': the predictor, e.g. {\"name\": \"ef\", \"coef\": 0.5} (the default) "
        "or \"nag\".")
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
        "norm, drift metric, functional optimizer step): the bound on their temporaries (a few windows' worth, "
        "at most 24 bytes per element), and what their kernel count follows. 'auto': on CPU 2M elements and at "
        "most 1/64 of the shard (not below 64K); on accelerators 64M elements (or the whole shard when smaller). "
        "An integer from 1024 to 2**26 (64M) overrides it.")
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

    @field_validator("predictor", mode="before")
    @classmethod
    def _predictor(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"name": v}
        if isinstance(v, Mapping) and isinstance(v.get("coef"), int) and not isinstance(v["coef"], bool):
            return {**v, "coef": float(v["coef"])}
        return v

    @field_validator("chunk_elements", mode="before")
    @classmethod
    def _chunk_elements(cls, v: Any) -> Any:
        if v == "auto" and isinstance(v, str):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1024 <= v <= MAX_CHUNK_ELEMENTS:
            raise ValueError(f"must be \"auto\" (chosen per device) or an integer number of elements from 1024 to "
                             f"{MAX_CHUNK_ELEMENTS} (2**26, the bound of a round's temporaries)")
        return v

    @classmethod
    def _coerce(cls, block: Mapping[str, Any]) -> dict:
        # strict=True refuses ints for floats; JSON writers often emit 600 for 600.0.
        out = dict(block)
        if isinstance(out.get("auto_modes"), list):
            out["auto_modes"] = tuple(out["auto_modes"])
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
            raise _refused("acco_not_object", f"config key '{ACCO_KEY}' must be a JSON object, got "
                           f"{type(block).__name__} {block!r}; fix: write e.g. \"acco\": {{\"enabled\": true}}")
        try:
            cfg = cls.model_validate(cls._coerce(block))
        except ValidationError as exc:
            # Several errors: an unknown key decides the row (the likelier typo, and it leaves a setting at
            # its default); the message lists every error.
            unknown = any(e["type"] == "extra_forbidden" for e in exc.errors())
            raise _refused("acco_unknown_key" if unknown else "acco_invalid_value", _explain(exc, block)) from None
        if cfg.dynamic is not None and cfg.accumulation != "dynamic":
            raise _refused("acco_no_effect", f"acco.dynamic = {block.get('dynamic')!r} has no effect with "
                           f"acco.accumulation = {cfg.accumulation!r}; fix: set \"accumulation\": \"dynamic\" or "
                           "remove acco.dynamic")
        if cfg.sigterm == "checkpoint" and not cfg.sigterm_checkpoint_dir:
            raise _refused("acco_sigterm_checkpoint_dir", "acco.sigterm = 'checkpoint' needs "
                           "acco.sigterm_checkpoint_dir; fix: set it to a directory or use \"sigterm\": \"stop\"")
        if cfg.sigterm_checkpoint_dir and cfg.sigterm != "checkpoint":
            raise _refused("acco_no_effect", f"acco.sigterm_checkpoint_dir = {cfg.sigterm_checkpoint_dir!r} has no "
                           f"effect with acco.sigterm = {cfg.sigterm!r}; fix: set \"sigterm\": \"checkpoint\" or "
                           "remove it")
        modes = cfg.schedule_modes()
        if cfg.mode == "auto":
            _check_auto(cfg, block)
        elif "auto_probe_steps" in block or "auto_modes" in block:
            key = "auto_probe_steps" if "auto_probe_steps" in block else "auto_modes"
            raise _refused("acco_no_effect", f"acco.{key} = {block.get(key)!r} has no effect with acco.mode = "
                           f"{cfg.mode!r}; fix: remove acco.{key} or use \"mode\": \"auto\"")
        if "acco" not in modes and "estimate" in block:
            raise _refused("acco_no_effect", f"acco.estimate = {block.get('estimate')!r} has no effect with acco.mode = "
                           f"{cfg.mode!r} (it has no estimate round); fix: remove acco.estimate or use \"mode\": \"acco\"")
        if cfg.mode not in ("acco", "one_round") and cfg.sync_warmup_steps:
            raise _refused("acco_no_effect", f"acco.sync_warmup_steps = {cfg.sync_warmup_steps!r} has no effect with "
                           f"acco.mode = {cfg.mode!r} (mode 'auto': auto_probe_steps); fix: remove "
                           "acco.sync_warmup_steps or use \"mode\": \"acco\"")
        if cfg.predictor is not None and "one_round" not in modes:
            raise _refused("acco_no_effect", f"acco.predictor = {block.get('predictor')!r} has no effect with "
                           f"acco.mode = {cfg.mode!r}; fix: remove acco.predictor or use \"mode\": \"one_round\" "
                           "(mode 'auto': list \"one_round\" in auto_modes)")
        if cfg.predictor is not None and cfg.predictor.name == "ef" and cfg.predictor.value >= 1:
            raise _refused("acco_invalid_value", f"acco.predictor.coef = {cfg.predictor.value!r} with name 'ef': γ "
                           "must be below 1 (the error feedback's offset is stable for γ < 1); fix: set a coef "
                           "below 1 or remove it to get the default 0.5")
        if cfg.mode == "one_round" and cfg.accumulation != "fixed":
            raise _refused("one_round_accumulation", f"acco.accumulation = {cfg.accumulation!r} with acco.mode = "
                           "'one_round'; fix: use \"accumulation\": \"fixed\" (or \"mode\": \"acco\")")
        if cfg.sync_warmup_steps and cfg.accumulation != "fixed":
            raise _refused("acco_sync_warmup_not_fixed", f"acco.sync_warmup_steps = {cfg.sync_warmup_steps} with "
                           f"acco.accumulation = {cfg.accumulation!r}: the synchronous warm-up runs stock's fixed "
                           "schedule; fix: use \"accumulation\": \"fixed\" or remove sync_warmup_steps")
        d = cfg.dynamic
        if d is not None and d.max_micro_batches is not None and d.max_micro_batches < d.min_micro_batches:
            raise _refused("acco_dynamic_bounds", f"acco.dynamic.max_micro_batches = {d.max_micro_batches} is below "
                           f"acco.dynamic.min_micro_batches = {d.min_micro_batches}; fix: raise "
                           "max_micro_batches or lower min_micro_batches")
        return cfg

    def estimate_in_banner(self) -> str:
        """The banner's words for the estimate: the one in use and the key that gives the paper's
        (the default departs from it; docs/estimate.md)."""
        if self.mode == "auto":
            modes = self.schedule_modes()
            return (f"auto between stock and {' / '.join(modes)} after {self.auto_probe_steps} stock steps"
                    + "".join(f"; if {m}: " + self.model_copy(update={"mode": m}).estimate_in_banner() for m in modes))
        if self.mode == "one_round":
            p = self.predictor_setting()
            return f"no estimate (mode one_round), predictor={p.name} {p.value:g}"
        if self.mode != "acco":
            return "no estimate (mode dpu)"
        name, paper = self.estimate.name(), '"estimate": "paper"'
        return f"estimate={name} ({paper})" if name == "the paper's" else f"estimate={name}, the paper's: {paper}"

    def schedule_modes(self) -> Tuple[str, ...]:
        """The ACCO schedules this config may run: its mode, or mode 'auto''s candidates besides stock."""
        return tuple(m for m in self.auto_modes if m != "stock") if self.mode == "auto" else (self.mode,)

    def predictor_setting(self) -> PredictorConfig:
        """The predictor of mode 'one_round' (the default, ef 0.5, when the block names none)."""
        return self.predictor or PredictorConfig()

    def phase_length(self, gradient_accumulation_steps: int) -> int:
        """Micro-batches per phase and rank in fixed accumulation (in 'shared': the equal share)."""
        return gradient_accumulation_steps // 2 if self.mode in ("acco", "auto") else gradient_accumulation_steps

    def dynamic_bounds(self, gradient_accumulation_steps: int) -> DynamicConfig:
        """The dynamic settings with defaults resolved against the fixed phase length."""
        d = self.dynamic or DynamicConfig()
        if d.max_micro_batches is None:
            d = d.model_copy(update={"max_micro_batches": max(d.min_micro_batches,
                                                              4 * self.phase_length(gradient_accumulation_steps))})
        return d


def _check_auto(cfg: AccoConfig, block: Mapping[str, Any]) -> None:
    """Mode 'auto': its candidates (stock and at least one ACCO mode, each once) and fixed accumulation."""
    modes = cfg.auto_modes
    if "stock" not in modes or len(modes) < 2 or len(set(modes)) != len(modes):
        raise _refused("acco_invalid_value", f"acco.auto_modes = {block.get('auto_modes')!r}: must list \"stock\" "
                       "and at least one of \"acco\", \"one_round\", each once; fix: e.g. [\"stock\", \"acco\"] "
                       "(the default) or [\"stock\", \"acco\", \"one_round\"]")
    if cfg.accumulation != "fixed":
        raise _refused("auto_accumulation", f"acco.accumulation = {cfg.accumulation!r} with acco.mode = 'auto'; fix: "
                       "use \"accumulation\": \"fixed\" (or name the mode, e.g. \"mode\": \"acco\")")


def _refused(key: str, message: str) -> ValueError:
    """The refusal table's error of the block's row ``key`` with ``message`` (which names the key, the
    value and the fix). The table is imported here, on an error only: importing this module must not
    import the core."""
    from .core.checks.refusals import REFUSALS, AccoRefusal
    return AccoRefusal(message, REFUSALS[key])


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


def acco_config_of(ds_config: Optional[Mapping[str, Any]]) -> AccoConfig:
    """The validated ``"acco"`` block of a DeepSpeed config dict (defaults if absent)."""
    return AccoConfig.from_block((ds_config or {}).get(ACCO_KEY))
