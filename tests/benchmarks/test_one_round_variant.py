"""The A/B runner's `one_round` variant: the library's one-round mode with its default predictor, not DPU."""
from benchmarks import variants
from ds_acco.config import AccoConfig


def test_the_one_round_variant_runs_the_one_round_mode():
    spec = {"micro_batch": 2, "gas": 4, "model": {"n_embd": 64}}
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "acco": {"estimate": "paper"}}
    cfg = variants.variant_config(base, "one_round", spec)
    acco = AccoConfig.from_block(cfg["acco"])
    assert (acco.mode, acco.accumulation, variants.mode_of("one_round")) == ("one_round", "fixed", "one_round")
    assert "estimate" not in cfg["acco"]  # refused in that mode: the base config's estimate is not passed on


def test_the_auto_variants_run_mode_auto_with_their_candidates():
    spec = {"micro_batch": 2, "gas": 4, "model": {"n_embd": 64}}
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    auto = AccoConfig.from_block(variants.variant_config(base, "auto", spec)["acco"])
    every = AccoConfig.from_block(variants.variant_config(base, "auto_all", spec)["acco"])
    assert (auto.mode, tuple(auto.auto_modes), variants.mode_of("auto_all")) == ("auto", ("stock", "acco"), "auto")
    assert tuple(every.auto_modes) == ("stock", "acco", "one_round")
