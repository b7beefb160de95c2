"""One process, world size 1: which engines built after ``ds_acco.install()`` warn that a config
with an enabled ``"acco"`` block runs stock. Prints ``CASE <name>`` before each case, so the test
can count the warnings each case printed (DeepSpeed's logger writes to stdout)."""
import sys

from deepspeed import initialize as initialize_looked_up_early  # before install(): the original

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

import ds_acco

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}
ACCO_ON = {**BASE, "acco": {"enabled": True}}


def model():
    return torch.nn.Linear(4, 2)


def case(name, build):
    print(f"CASE {name}", flush=True)
    engine = build()
    print(f"ENGINE {type(engine).__name__} {type(engine.optimizer).__name__}", flush=True)
    engine.destroy()


def main():
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    ds_acco.install()
    case("early_import", lambda: initialize_looked_up_early(model=model(), config=dict(ACCO_ON))[0])
    case("direct", lambda: DeepSpeedEngine(args=None, model=model(), config=dict(ACCO_ON),
                                           config_class=DeepSpeedConfig(dict(ACCO_ON))))
    case("routed", lambda: deepspeed.initialize(model=model(), config=dict(ACCO_ON))[0])
    case("stock_config", lambda: deepspeed.initialize(model=model(), config=dict(BASE))[0])
    case("disabled_block", lambda: deepspeed.initialize(model=model(), config={**BASE, "acco": {"enabled": False}})[0])
    ds_acco.uninstall()
    case("after_uninstall", lambda: initialize_looked_up_early(model=model(), config=dict(ACCO_ON))[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
