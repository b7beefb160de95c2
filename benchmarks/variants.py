"""The A/B variants: what each name means (engine, mode, LR rule, sharding), its DeepSpeed config
and its model."""
from __future__ import annotations

import copy
from typing import Optional

import torch

from benchmarks.gpt import CausalLM


LR_RULES = ("sqrt", "linear")  # dynamic_<rule>: acco.dynamic.lr_scaling = <rule>
DS_VARIANTS = ("stock", "fixed", "dynamic", "dpu", "shared")
# the one-round mode (opt-in, it trains worse: docs/estimate.md), its default predictor: named only
ONE_ROUND_VARIANTS = ("one_round",)
# mode auto (stock or fixed by the measured r after 3 stock steps; auto_all: the one-round mode a candidate too)
AUTO_VARIANTS = ("auto", "auto_all")
FSDP_VARIANTS = ("fsdp_stock", "fsdp_fixed", "fsdp_dynamic", "fsdp_dpu")
# FSDP2 with parameters resharded after forward and backward (FSDP's memory-saving configuration):
# stock with no-sync accumulation, and ACCO with AccoFSDP(sharded_params=True); named explicitly
FSDP_SHARDED_VARIANTS = ("fsdp_stock_sharded", "fsdp_fixed_sharded")
LR_VARIANTS = tuple(f"dynamic_{r}" for r in LR_RULES)  # DeepSpeed, named explicitly (not in 'all')
# ACCO fixed with the paper's estimate ("estimate": "paper"), beside the default look-ahead's: named only
PAPER_VARIANTS = ("fixed_paper",)
# Stock ZeRO-1 with DeepSpeed's own overlap settings, named explicitly (not in 'all'): the stronger
# baseline an ACCO speedup should also be measured against (docs/benchmarking.md says what an
# emulated run can and cannot show of it).
STOCK_OVERLAP = "stock_overlap"
VARIANTS = (DS_VARIANTS + FSDP_VARIANTS + LR_VARIANTS + FSDP_SHARDED_VARIANTS + PAPER_VARIANTS + (STOCK_OVERLAP,)
            + ONE_ROUND_VARIANTS + AUTO_VARIANTS)


def mode_of(variant: str) -> str:
    """The schedule a variant runs ('stock', 'fixed', 'dynamic', 'dpu', 'one_round' or 'auto'), whatever the framework
    and learning-rate rule."""
    if variant == STOCK_OVERLAP:  # stock's schedule: one reduce per step, in the boundary micro-batch
        return "stock"
    mode = variant[len("fsdp_"):] if variant.startswith("fsdp_") else variant
    mode = mode[:-len("_sharded")] if mode.endswith("_sharded") else mode
    mode = mode[:-len("_paper")] if mode.endswith("_paper") else mode
    mode = "auto" if mode in AUTO_VARIANTS else mode
    return "dynamic" if lr_rule_of(variant) else mode


def is_sharded(variant: str) -> bool:
    """An FSDP2 variant whose parameters stay sharded between uses (FSDP_SHARDED_VARIANTS)."""
    return is_fsdp(variant) and variant.endswith("_sharded")


def lr_rule_of(variant: str) -> Optional[str]:
    """The dynamic learning-rate rule a variant names (``dynamic_sqrt``: 'sqrt'), else None."""
    return next((r for r in LR_RULES if variant.endswith(f"dynamic_{r}")), None)


def is_fsdp(variant: str) -> bool:
    return variant.startswith("fsdp_")


# -- model ---------------------------------------------------------------------------------------
def build_model(spec: dict, rank: int = 0) -> CausalLM:
    """The reference GPT (:mod:`benchmarks.gpt`) at the spec's size, from the spec's seed; with
    ``spec['emulate']``, the accelerator stand-in of :mod:`benchmarks.emulation` instead."""
    torch.manual_seed(spec["seed"])  # same initial weights in every variant
    m = spec["model"]
    emulate = spec.get("emulate")
    if emulate:
        from .emulation import EmulatedLM, compute_for_rank
        return EmulatedLM(spec["seq_len"], emulate["params"], compute_for_rank(emulate["compute_s"], rank),
                          m["n_embd"], m["n_layer"], m["n_head"])
    return CausalLM(spec["seq_len"], m["n_embd"], m["n_layer"], m["n_head"])


# -- configs -------------------------------------------------------------------------------------
def overlap_bucket_size(spec: dict) -> int:
    """``reduce_bucket_size`` of ``stock_overlap`` (elements): the spec's ``overlap_bucket_size``, else
    hidden size squared, the value HF Trainer and Accelerate fill in for ``"auto"``. DeepSpeed's
    default (5e8 elements) holds every model this runner builds in one bucket, which could only be
    reduced after the whole backward: nothing would overlap."""
    size = spec.get("overlap_bucket_size") or spec["model"]["n_embd"] ** 2
    if not (isinstance(size, int) and size > 0):
        raise ValueError(f"overlap_bucket_size = {size!r}: must be a positive number of elements")
    return size


def variant_config(base: dict, variant: str, spec: dict) -> dict:
    """The DeepSpeed config of one variant: the base config, with or without an ``acco`` block
    (the FSDP variants read the same JSON: its ``acco`` block, accumulation, clipping and the
    AdamW settings of its ``optimizer`` block)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    rule = lr_rule_of(variant)
    overlap = variant == STOCK_OVERLAP
    paper = variant in PAPER_VARIANTS
    every_mode = variant == "auto_all"
    variant = mode_of(variant)
    cfg = copy.deepcopy(base)
    # The base config's estimate variant (docs/estimate.md) applies to every variant with an estimate, its
    # synchronous warm-up (sync_warmup_steps) to every variant that can run one (fixed accumulation, mode
    # acco or one_round); the rest of its acco block is the variant's
    block = cfg.pop("acco", None) or {}
    estimate = "paper" if paper else block.get("estimate")
    warmup = block.get("sync_warmup_steps")
    cfg["train_micro_batch_size_per_gpu"] = spec["micro_batch"]
    cfg["gradient_accumulation_steps"] = spec["gas"]
    cfg.pop("train_batch_size", None)
    cfg["steps_per_print"] = 10 ** 9
    if variant == "stock":
        if overlap:  # the bucketed reduce starts from the gradient hooks of the step's last backward
            cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "overlap_comm": True,
                                        "contiguous_gradients": True, "reduce_bucket_size": overlap_bucket_size(spec)}
        return cfg
    if variant == "fixed":
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "fixed"}
    elif variant == "dpu":
        cfg["acco"] = {"enabled": True, "mode": "dpu", "accumulation": "fixed"}
    elif variant == "auto":
        cfg["acco"] = {"enabled": True, "mode": "auto", "accumulation": "fixed"}
        if every_mode:
            cfg["acco"]["auto_modes"] = ["stock", "acco", "one_round"]
    elif variant == "one_round":
        cfg["acco"] = {"enabled": True, "mode": "one_round", "accumulation": "fixed"}
    elif variant == "shared":  # stock's batch per step, shared among the ranks by measured speed
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "shared"}
    elif variant == "dynamic":
        lo = spec.get("dynamic_min") or max(1, spec["gas"] // 2)
        hi = max(lo, spec.get("dynamic_max") or 256)
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "dynamic",
                       "dynamic": {"min_micro_batches": lo, "max_micro_batches": hi, "check_every": 1}}
        if rule:
            cfg["acco"]["dynamic"]["lr_scaling"] = rule
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    if estimate is not None and cfg["acco"]["mode"] in ("acco", "auto"):
        cfg["acco"]["estimate"] = estimate
    if warmup is not None and cfg["acco"]["mode"] in ("acco", "one_round") and cfg["acco"]["accumulation"] == "fixed":
        cfg["acco"]["sync_warmup_steps"] = warmup
    return cfg


def check_fsdp_config(cfg: dict) -> None:
    """What the FSDP variants do not build from the JSON, refused rather than silently dropped."""
    for key in ("scheduler", "bf16", "fp16"):
        block = cfg.get(key)
        if block and (key == "scheduler" or block.get("enabled", False)):
            raise ValueError(f"base config block \"{key}\": the FSDP variants train in fp32 with torch AdamW and no "
                             "LR schedule; fix: remove it from the base config, or run the DeepSpeed variants only")
