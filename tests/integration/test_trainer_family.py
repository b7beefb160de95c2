"""The estimate's default per optimizer family through a real HF Trainer (docs/estimate.md, "The default
per optimizer family"): ``optim="adafactor"`` builds transformers' Adafactor, which the Trainer hands to
DeepSpeed as a client optimizer; ACCO's estimate then runs lr_scale 1, and a block that sets lr_scale
keeps it. With DeepSpeed's WarmupLR in the config (its ``"auto"`` values filled by the Trainer from
``warmup_steps``) the first steps, the LR warm-up's, are stock's by default; with the Trainer's own
scheduler the warm-up is not known to ACCO and none runs."""
import pytest
import torch

import hf_workers
from dist import run_ranks
from timeouts import scaled

pytestmark = pytest.mark.slow  # three Trainer runs on 2 ranks


def test_the_trainers_adafactor_gets_the_normalised_familys_estimate(tmp_path):
    cases = [{"acco": {}, "gas": 2, "steps": 2, "out_dir": str(tmp_path / "default"), "optim": "adafactor"},
             {"acco": {"estimate": {"lr_scale": 2}}, "gas": 2, "steps": 2, "out_dir": str(tmp_path / "given"),
              "optim": "adafactor"},
             {"acco": {}, "gas": 2, "steps": 4, "out_dir": str(tmp_path / "warm"), "optim": "adafactor",
              "ds_warmup_lr": True, "warmup_steps": 3}]
    for default, given, warm in run_ranks(hf_workers.trainer_cases, cases=cases, timeout=scaled(400)):
        assert (default["sync_warmup_steps"], given["sync_warmup_steps"], warm["sync_warmup_steps"]) == (0, 0, 3)
        assert warm["lrs"][:4] == sorted(warm["lrs"][:4]) and warm["lrs"][0] < warm["lrs"][3]  # it warmed up
        assert default["optimizer"] == given["optimizer"] == "Adafactor"
        assert default["estimate_lr_scale"] == 1.0 and given["estimate_lr_scale"] == 2.0
        # the same first step (both at θ_0), then different estimates: the lr_scale is the one that runs
        assert default["losses"][0] == given["losses"][0] and not all(
            torch.equal(default["final"][n], given["final"][n]) for n in default["final"])
