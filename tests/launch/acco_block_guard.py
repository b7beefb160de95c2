"""One process, world size 1, run with ds_acco_autoinstall.pth active (an installed wheel, or a site
directory holding it): every way this script can build a DeepSpeed engine from a config whose
``"acco"`` block is enabled, without ds_acco routing it, must stop; stock configs, ``DS_ACCO=off``
and the routes through ds_acco build engines. The script imports nothing of ds_acco before the
cases that call it by name, like a training script that knows nothing of it.

Prints ``CASE <name>`` then ``OUTCOME <json>`` per case: ``{"engine": class}`` or ``{"refused": exception
class, "message": text}``. argv[1]: a file path for the process group's FileStore; argv[2]: a scratch
directory.
"""
import argparse
import base64
import json
import os
import sys
import traceback

from deepspeed import initialize as initialize_looked_up_early  # before anything of ds_acco

import deepspeed
import torch
import torch.distributed as dist

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}
ACCO_ON = {**BASE, "acco": {"enabled": True}}
ACCELERATE = {**{k: v for k, v in ACCO_ON.items() if k != "optimizer"}, "zero_allow_untested_optimizer": True}
HF = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "acco": {"enabled": True}}


class Tiny(torch.nn.Module):
    """Returns its loss as HF models do (``labels``): usable by DeepSpeed, Accelerate and the Trainer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels)} if labels is not None else out


def outcome(build):
    try:
        engine = build()
    except Exception as exc:  # noqa: BLE001 -- the outcome is what we report
        if not isinstance(exc, (RuntimeError, ValueError)):
            traceback.print_exc()
        return {"refused": type(exc).__name__, "message": str(exc)}
    engine = getattr(engine, "model_wrapped", engine)  # the Trainer holds the engine there
    out = {"engine": type(engine).__name__}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def case(name, build):
    print(f"CASE {name}", flush=True)
    print("OUTCOME " + json.dumps(outcome(build)), flush=True)


def accelerate_prepare(config):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(config)))
    model = Tiny()
    engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return engine


def trainer_train(config, scratch):
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rows = [{"x": torch.randn(4), "labels": torch.randn(2)} for _ in range(8)]
    args = TrainingArguments(output_dir=os.path.join(scratch, "trainer"), deepspeed=dict(config), use_cpu=True,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=rows)
    trainer.train()
    return trainer


def main():
    store, scratch = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    path = os.path.join(scratch, "acco.json")
    with open(path, "w") as f:
        json.dump(ACCO_ON, f)
    encoded = base64.urlsafe_b64encode(json.dumps(ACCO_ON).encode()).decode()

    def model():
        return torch.nn.Linear(4, 2)

    # -- not routed through ds_acco: refused --------------------------------------------------------
    case("config-dict", lambda: deepspeed.initialize(model=model(), config=dict(ACCO_ON))[0])
    case("config-path", lambda: deepspeed.initialize(model=model(), config=path)[0])
    case("config-base64", lambda: deepspeed.initialize(model=model(), config=encoded)[0])
    case("config_params", lambda: deepspeed.initialize(model=model(), config_params=dict(ACCO_ON))[0])
    # Megatron-DeepSpeed: args.deepspeed_config, its own optimizer and scheduler
    megatron_model = model()
    megatron_opt = torch.optim.AdamW(megatron_model.parameters(), lr=1e-3)
    case("megatron-args", lambda: deepspeed.initialize(
        model=megatron_model, optimizer=megatron_opt, args=argparse.Namespace(deepspeed_config=path, local_rank=0),
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(megatron_opt, lambda s: 1.0))[0])
    case("looked-up-early", lambda: initialize_looked_up_early(model=model(), config=dict(ACCO_ON))[0])
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    case("engine-direct", lambda: DeepSpeedEngine(args=None, model=model(), config=dict(ACCO_ON),
                                                  config_class=DeepSpeedConfig(dict(ACCO_ON))))
    case("accelerate", lambda: accelerate_prepare(ACCELERATE))
    case("hf-trainer", lambda: trainer_train(HF, scratch))
    case("invalid-block", lambda: deepspeed.initialize(model=model(), config={**BASE, "acco": {"enabled": "yes"}})[0])

    # -- stock on purpose ---------------------------------------------------------------------------
    case("no-block", lambda: deepspeed.initialize(model=model(), config=dict(BASE))[0])
    case("disabled-block", lambda: deepspeed.initialize(model=model(), config={**BASE, "acco": {"enabled": False}})[0])
    os.environ["DS_ACCO"] = "off"
    case("opt-out", lambda: deepspeed.initialize(model=model(), config=dict(ACCO_ON))[0])
    case("opt-out-accelerate", lambda: accelerate_prepare(ACCELERATE))
    import ds_acco
    case("opt-out-ds_acco.initialize", lambda: ds_acco.initialize(model=model(), config=dict(ACCO_ON))[0])
    os.environ["DS_ACCO"] = "on"
    case("opt-out-unknown-value", lambda: deepspeed.initialize(model=model(), config=dict(ACCO_ON))[0])
    del os.environ["DS_ACCO"]

    # -- routed through ds_acco: ACCO ---------------------------------------------------------------
    case("ds_acco.initialize", lambda: ds_acco.initialize(model=model(), config=dict(ACCO_ON))[0])
    ds_acco.install()
    case("installed-config-base64", lambda: deepspeed.initialize(model=model(), config=encoded)[0])
    case("installed-accelerate", lambda: accelerate_prepare(ACCELERATE))
    case("installed-looked-up-early", lambda: initialize_looked_up_early(model=model(), config=dict(ACCO_ON))[0])
    ds_acco.uninstall()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
