"""The ``"acco"`` block of a DeepSpeed JSON config: one typed model, defaults in one place.

Every error is an ``AccoRefusal`` (a ``ValueError``) that names the key, the bad value and the fix,
and carries its row of the refusal table (``acco_*`` rows of ``ds_acco.core.checks.refusals``; that
table is imported only when an error is raised: importing this module does not import the core).
DeepSpeed ignores unknown top-level keys, so nothing but this module ever reads the block: an entry
point parses it once (:meth:`AccoConfig.from_block`) and hands the parsed object down.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

# Reading DeepSpeed's config and the launch's opt-out have modules of their own; their names stay
# importable from here.
from .config_deepspeed import (ACCO_KEY, BATCH_KEYS, data_parallel_size, deepspeed_config_at,  # noqa: F401
                               load_ds_config, marked_params, requested_layout, steps_with_increment)
from .config_blocks import (DEFAULT_LR_SCALE, DRIFT_EVERY, FAMILY_DOC, MAX_CHUNK_ELEMENTS,  # noqa: F401
                            NORMALISED_LR_SCALE, PREDICTOR_COEFS, SGD_LR_SCALE, DynamicConfig, EstimateConfig,
                            MetricsConfig, PredictorConfig)
from .config_families import NORMALISED, SGD, family_of
from .config_routing import (OPT_OUT_ENV, RUN_THROUGH_DS_ACCO, note_opt_out, opted_out,  # noqa: F401
                             stock_engine_refusal)

FAMILY_LR_SCALE = {NORMALISED: NORMALISED_LR_SCALE, SGD: SGD_LR_SCALE}  # the rest (moment, unknown): DEFAULT_LR_SCALE


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
        "most 1/64 of the shard (not below 256K, nor 64K per rank); on accelerators 64M elements (or the whole shard when smaller). "
        "An integer from 1024 to 2**26 (64M) overrides it.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Per-step overlap metrics.")
    estimate: EstimateConfig = Field(default_factory=EstimateConfig, description="How the estimate round "
                                     "computes θ̃ (mode 'acco'); \"paper\" for the paper's estimate.")
    sync_warmup_steps: Union[Annotated[int, Field(ge=0)], Literal["lr_warmup"]] = Field(
        0, description="The first N optimizer steps run stock's synchronous schedule (one round per "
        "step, waited for at once; ACCO's buffers), then ACCO starts from there (fixed accumulation). "
        "'lr_warmup': N is the warm-up of the DeepSpeed \"scheduler\" block (WarmupLR / WarmupDecayLR / "
        "WarmupCosineLR). Default: 0, and for the normalised-update family (Adafactor, Lion) the LR warm-up's "
        "steps where that scheduler gives them (docs/estimate.md).")
    # Set by for_optimizer: (the optimizer's family in the banner's words, the family's default lr_scale).
    _family: Optional[tuple] = PrivateAttr(None)

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

    @field_validator("sync_warmup_steps", mode="before")
    @classmethod
    def _sync_warmup_steps(cls, v: Any) -> Any:
        if (v == "lr_warmup" and isinstance(v, str)) or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("must be a number of optimizer steps (an integer, 0 or more) or \"lr_warmup\" (the "
                         "warm-up of the DeepSpeed \"scheduler\" block)")

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
            raise _refused("acco_sync_warmup_not_fixed", f"acco.sync_warmup_steps = {cfg.sync_warmup_steps!r} with "
                           f"acco.accumulation = {cfg.accumulation!r}: the synchronous warm-up runs stock's fixed "
                           "schedule; fix: use \"accumulation\": \"fixed\" or remove sync_warmup_steps")
        d = cfg.dynamic
        if d is not None and d.max_micro_batches is not None and d.max_micro_batches < d.min_micro_batches:
            raise _refused("acco_dynamic_bounds", f"acco.dynamic.max_micro_batches = {d.max_micro_batches} is below "
                           f"acco.dynamic.min_micro_batches = {d.min_micro_batches}; fix: raise "
                           "max_micro_batches or lower min_micro_batches")
        return cfg

    def for_optimizer(self, optimizer, lr_warmup_steps: Optional[int] = None) -> "AccoConfig":
        """This config for the optimizer the adapter built (an instance or its class) and the LR warm-up's
        length where the adapter knows it (``lr_warmup_steps``: that of the scheduler DeepSpeed runs,
        :func:`.config_deepspeed.configured_lr_warmup`; None: unknown). Where the block does not set
        ``estimate.lr_scale``, the default of the optimizer's family (``DEFAULT_LR_SCALE`` for the moment
        family and an unknown class, ``SGD_LR_SCALE`` for SGD, ``NORMALISED_LR_SCALE`` for the normalised-update
        family: ``FAMILY_LR_SCALE``; the table:
        config_families.py); where it does not set ``sync_warmup_steps``, the normalised-update family in
        mode 'acco' with fixed accumulation runs stock's schedule through the LR warm-up (0 where its
        length is unknown); ``"sync_warmup_steps": "lr_warmup"`` becomes that length (refused where it is
        unknown). The banner then names what came from where. Every adapter calls it once on what it built,
        before check point 2; a given value always wins (mode 'auto': for its 'acco' candidate)."""
        out = self
        if self.sync_warmup_steps == "lr_warmup":
            if lr_warmup_steps is None:
                raise _refused("acco_lr_warmup_unknown", 'acco.sync_warmup_steps = "lr_warmup" but this run\'s LR '
                               "warm-up is not known to ACCO (DeepSpeed runs no \"scheduler\" block of type "
                               "WarmupLR, WarmupDecayLR or WarmupCosineLR with an integer warmup_num_steps: a client "
                               "lr_scheduler, another type, none, or an adapter without DeepSpeed's schedulers); fix: "
                               "set acco.sync_warmup_steps to the warm-up's number of optimizer steps")
            out = self.model_copy(update={"sync_warmup_steps": lr_warmup_steps})
        if "acco" not in self.schedule_modes():
            return out
        family = family_of(optimizer)
        normalised = family.family == NORMALISED
        default = FAMILY_LR_SCALE.get(family.family, DEFAULT_LR_SCALE)
        given = "lr_scale" in self.estimate.model_fields_set  # "paper" sets it too
        estimate = self.estimate if given else self.estimate.model_copy(update={"lr_scale": default})
        update = {"estimate": estimate}
        warm = (f', sync_warmup_steps {lr_warmup_steps} ("lr_warmup": the scheduler\'s LR warm-up)'
                if self.sync_warmup_steps == "lr_warmup" else "")
        if normalised and "sync_warmup_steps" not in self.model_fields_set and self.mode == "acco" \
                and self.accumulation == "fixed":
            update["sync_warmup_steps"] = lr_warmup_steps or 0
            warm = (f", sync_warmup_steps {lr_warmup_steps} (the scheduler's LR warm-up) by default" if lr_warmup_steps
                    else ", no synchronous warm-up (the LR warm-up is not known: set acco.sync_warmup_steps to "
                    "its steps)")
        out = out.model_copy(update=update)
        how = f"default lr_scale {default:g}, acco.estimate.lr_scale {estimate.lr_scale:g} as set" if given else \
            f"estimate lr_scale {default:g} by default"
        out._family = (f"{family.words()}, {how}{warm} ({FAMILY_DOC})", default)
        return out

    def estimate_in_banner(self) -> str:
        """The banner's words for the estimate: the optimizer's family and what it gave
        (:meth:`for_optimizer`), the estimate in use and the key that gives the paper's (docs/estimate.md)."""
        if self.mode == "auto":
            modes = self.schedule_modes()
            return (f"auto between stock and {' / '.join(modes)} after {self.auto_probe_steps} stock steps"
                    + "".join(f"; if {m}: " + self.model_copy(update={"mode": m}).estimate_in_banner() for m in modes))
        if self.mode == "one_round":
            p = self.predictor_setting()
            return f"no estimate (mode one_round), predictor={p.name} {p.value:g}"
        if self.mode != "acco":
            return "no estimate (mode dpu)"
        family, default = self._family or ("", DEFAULT_LR_SCALE)
        name, paper = self.estimate.name(default), '"estimate": "paper"'
        words = f"estimate={name} ({paper})" if name == "the paper's" else f"estimate={name}, the paper's: {paper}"
        return f"{family}; {words}" if family else words

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
