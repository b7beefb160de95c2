"""The optimizer family table (ds_acco/config_families.py) and the estimate's default it gives
(``AccoConfig.for_optimizer``; docs/estimate.md#the-default-per-optimizer-family): by class, through the
MRO, without importing the optimizer's package, and never over an lr_scale the block sets. The engine
runs are tests/deepspeed/test_estimate_family.py; these cover the classes CPU cannot build (DeepSpeed's
config-built Lion types) and the classes of packages not installed (bitsandbytes)."""
import pytest
import torch

from ds_acco.config import DEFAULT_LR_SCALE, NORMALISED_LR_SCALE, SGD_LR_SCALE, AccoConfig
from ds_acco.config_families import MOMENT, NORMALISED, SGD, family_of


def _named(module, name):
    return type(name, (torch.optim.Optimizer,), {"__module__": module})


def test_deepspeeds_config_built_optimizers_by_class():
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion  # "optimizer": {"type": "Lion"} builds one of these
    assert {c.__name__: family_of(c).family for c in (FusedLion, DeepSpeedCPULion, FusedAdam, DeepSpeedCPUAdam)} == {
        "FusedLion": NORMALISED, "DeepSpeedCPULion": NORMALISED, "FusedAdam": MOMENT, "DeepSpeedCPUAdam": MOMENT}


def test_packages_and_subclasses():
    from lion_pytorch import Lion
    from transformers.optimization import Adafactor

    class MyLion(Lion):
        pass
    found = {c: family_of(c) for c in (Lion, MyLion, Adafactor, torch.optim.Adafactor, torch.optim.AdamW,
                                       torch.optim.SGD, _named("bitsandbytes.optim.lion", "PagedLion8bit"))}
    assert {c.__name__: f.family for c, f in found.items()} == {
        "Lion": NORMALISED, "MyLion": NORMALISED, "Adafactor": NORMALISED, "AdamW": MOMENT, "SGD": SGD,
        "PagedLion8bit": NORMALISED}
    assert found[MyLion].listed == "lion_pytorch.lion_pytorch.Lion"
    assert found[torch.optim.SGD].words() == "SGD: SGD family"  # the banner's words
    apex = family_of(_named("apex.optimizers.fused_sgd", "FusedSGD"))  # listed by name, apex not installed
    assert (apex.family, apex.listed) == (SGD, "apex.optimizers.fused_sgd.FusedSGD")


def test_an_unknown_class_is_the_moment_family_and_said_so():
    f = family_of(_named("my.pkg", "Shampoo")([torch.nn.Parameter(torch.zeros(1))], {}))
    assert (f.family, f.listed) == (MOMENT, None)
    assert f.words() == "Shampoo: not in the optimizer family table, moment family assumed"


@pytest.mark.parametrize("block, optimizer, want", [
    ({"enabled": True}, "lion", NORMALISED_LR_SCALE),
    ({"enabled": True, "estimate": {}}, "lion", NORMALISED_LR_SCALE),  # the object without lr_scale
    ({"enabled": True, "estimate": {"lr_scale": 2}}, "lion", 2.0),  # given: it wins
    ({"enabled": True, "estimate": "paper"}, "adamw", 1.0),
    ({"enabled": True}, "adamw", DEFAULT_LR_SCALE),
    ({"enabled": True}, "sgd", SGD_LR_SCALE),
    ({"enabled": True, "estimate": {"lr_scale": 2}}, "sgd", 2.0),
    ({"enabled": True}, "unknown", DEFAULT_LR_SCALE),
    ({"enabled": True, "mode": "auto"}, "lion", NORMALISED_LR_SCALE),  # auto's 'acco' candidate: the family's
    ({"enabled": True, "mode": "auto", "auto_modes": ["stock", "one_round"]}, "lion", DEFAULT_LR_SCALE),  # none
])
def test_the_default_lr_scale_by_family_and_a_given_one_wins(block, optimizer, want):
    from lion_pytorch import Lion
    cls = {"lion": Lion, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "unknown": _named("my.pkg", "Shampoo")}[
        optimizer]
    cfg = AccoConfig.from_block(block).for_optimizer(cls)
    assert cfg.estimate.lr_scale == want
    assert cfg.for_optimizer(cls).estimate == cfg.estimate  # once resolved, resolved


def test_dpu_has_no_estimate_to_resolve():
    from lion_pytorch import Lion
    cfg = AccoConfig.from_block({"enabled": True, "mode": "dpu"})
    assert cfg.for_optimizer(Lion) is cfg and cfg.estimate_in_banner() == "no estimate (mode dpu)"
