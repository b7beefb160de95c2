"""The ``"acco"`` block's sub-blocks and their defaults: ``dynamic``, ``metrics``, ``estimate`` and
``predictor`` (each a typed model; :mod:`ds_acco.config` assembles the block from them and its names
stay importable from there)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


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


DEFAULT_LR_SCALE = 2.0  # the look-ahead estimate: beat stock at every AdamW setting up to LR x4 (docs/estimate.md)
# The normalised-update family's default (Adafactor, Lion: every coordinate moves by about lr, so the estimate at
# 2·lr lands a whole step further): the paper's estimate, ahead of lr_scale 2 in both measured (docs/estimate.md)
NORMALISED_LR_SCALE = 1.0
# SGD (with momentum): 1.5 met stock at both LRs and sizes measured, 2 missed at the higher LR (docs/estimate.md)
SGD_LR_SCALE = 1.5
FAMILY_DOC = "docs/estimate.md#the-default-per-optimizer-family"


class EstimateConfig(BaseModel):
    """How the estimate round computes θ̃_{t+1} (docs/estimate.md gives each as its recurrence). The
    default is the look-ahead estimate (lr_scale 2): the estimate's step takes twice the learning
    rate. The paper's estimate is ``"estimate": "paper"`` (lr_scale 1, second_moment 'update', no
    delay compensation), v0.3's behaviour bit for bit."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    lr_scale: float = Field(
        DEFAULT_LR_SCALE, gt=0, le=8, description="The estimate's optimizer step uses the learning rate times "
        "this (its weight decay too): 1 is the paper's estimate; above 1 the first half of the next batch is "
        "computed further along the update (a look-ahead). Default by the optimizer's family: 2 (Adam-like "
        "and unknown optimizers: median held-out loss below stock's at every AdamW setting measured up to LR x4), "
        "1.5 for SGD, 1 for the normalised-update family (Adafactor, Lion; "
        "docs/estimate.md#the-default-per-optimizer-family).")
    second_moment: Literal["update", "committed"] = Field(
        "update", description="Adam's second moment in the estimate: 'update' it with the half-batch gradient "
        "(the paper), or reuse the 'committed' one (bias-corrected for the committed steps).")
    delay_compensation: float = Field(
        0.0, ge=0, description="λ of DC-ASGD-a in the commit: the first-half mean gradient becomes "
        "g̃ + λ g̃ ⊙ g̃ ⊙ (θ_t − θ̃_t) / (√v̂_t + ε) (Adam only; one extra fp32 shard per rank). 0: off.")

    @classmethod
    def paper(cls) -> "EstimateConfig":
        return cls(lr_scale=1.0, second_moment="update", delay_compensation=0.0)

    def name(self, default_lr_scale: float = DEFAULT_LR_SCALE) -> str:
        """This estimate as the start-up banner names it: "the paper's", the default's name, or the
        keys that depart from the paper's (docs/estimate.md specifies each); ``default_lr_scale``:
        the optimizer family's default (:meth:`AccoConfig.for_optimizer`)."""
        if self == self.paper():
            return "the paper's"
        keys = [f"lr_scale={self.lr_scale:g}"] if self.lr_scale != 1.0 else []
        keys += [f"second_moment={self.second_moment}"] if self.second_moment != "update" else []
        keys += [f"delay_compensation={self.delay_compensation:g}"] if self.delay_compensation else []
        default = " (the default)" if self == type(self)(lr_scale=default_lr_scale) else ""
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
