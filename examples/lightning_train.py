"""A plain Lightning training script with DeepSpeed ZeRO-1 and ACCO.

    torchrun --nproc_per_node 2 -m ds_acco run examples/lightning_train.py

Nothing in it is ACCO-specific: ``DeepSpeedStrategy(config="examples/lightning_ds_config.json")``
points at a ZeRO-1 config with an enabled ``"acco"`` block, and ``-m ds_acco run`` routes the
``deepspeed.initialize`` that the strategy calls to ACCO (it runs ``ds_acco.install()`` first, then
this script as ``__main__``). The config has no ``gradient_accumulation_steps``: Lightning refuses
it there and fills it from ``Trainer(accumulate_grad_batches=...)`` (even, ≥ 2, for ACCO); check it
with ``python -m ds_acco check examples/lightning_ds_config.json --gas 4``. Under ``install()``
Lightning's validation runs on the committed weights θ (never the estimate θ̃), and its
checkpoints hold θ and ACCO's in-flight state. Lightning calls ``engine.step()`` after every
micro-batch; ``trainer.global_step`` counts optimizer steps, as ``engine.global_steps`` does.

The same command with ``DS_ACCO=off`` trains stock ZeRO-1 from the same config. Lightning's
``DeepSpeedStrategy`` runs on CUDA GPUs only (``setup_environment`` refuses any other accelerator);
the suite runs this script on 2 CPU ranks with that one check lifted (tests/launch/lightning_cpu.py).

The model is a small MLP on a synthetic regression task: nothing is downloaded. Rank 0 prints
``LIGHTNING_RESULT {json}`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

RESULT_TAG = "LIGHTNING_RESULT"
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "lightning_ds_config.json"), help="DeepSpeed JSON config")
    p.add_argument("--accumulate", type=int, default=4, help="accumulate_grad_batches (gradient_accumulation_steps)")
    p.add_argument("--epochs", type=int, default=2, help="epochs; each ends with a validation")
    p.add_argument("--batches", type=int, default=24, help="training micro-batches per epoch and rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--accelerator", default="auto", help="Lightning's accelerator (DeepSpeedStrategy wants cuda)")
    p.add_argument("--devices", default=os.environ.get("LOCAL_WORLD_SIZE", "auto"),
                   help="devices per node (default: torchrun's --nproc_per_node)")
    p.add_argument("--out", default=None, help="a folder: rank 0 saves the final weights here (final.pt)")
    p.add_argument("--save", default=None, help="save a Lightning checkpoint here after training")
    p.add_argument("--resume", default=None, help="resume from this Lightning checkpoint")
    return p.parse_args(argv)


def make_data(n: int, seed: int):
    """``n`` samples of a fixed synthetic regression task, y = tanh(x W) v + noise, drawn with ``seed``."""
    g = torch.Generator().manual_seed(0)
    w, v = torch.randn(8, 16, generator=g) / 8 ** 0.5, torch.randn(16, 1, generator=g) / 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w) @ v + 0.05 * torch.randn(n, 1, generator=g))


def weights_checksum(module: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.train_losses, self.val_losses, self.val_checksums = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.val_checksums.append(weights_checksum(self.net))  # the weights this validation evaluates
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def on_validation_epoch_end(self):
        self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def main(argv=None, module_class=Regressor) -> dict:
    args = parse_args(argv)
    L.seed_everything(0, workers=True)
    model = module_class(args.lr)
    micro = json.load(open(args.config))["train_micro_batch_size_per_gpu"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train = make_data(micro * args.batches * world, seed=1)
    val = make_data(micro * 4 * world, seed=2)
    trainer = L.Trainer(
        strategy=DeepSpeedStrategy(config=args.config), accelerator=args.accelerator,
        devices=int(args.devices) if str(args.devices).isdigit() else args.devices,
        accumulate_grad_batches=args.accumulate, max_epochs=args.epochs, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False,
        deterministic=True)
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=micro),
                torch.utils.data.DataLoader(val, batch_size=micro), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank: DeepSpeed's sharded checkpoint
    engine = trainer.strategy.model
    final = {k: v.detach().clone() for k, v in model.net.state_dict().items()}  # the committed θ (ACCO's exports)
    result = {"world_size": trainer.world_size, "engine": type(engine).__name__,
              "optimizer": type(engine.optimizer).__name__, "gradient_accumulation_steps":
              engine.gradient_accumulation_steps(), "global_steps": int(engine.global_steps),
              "trainer_global_step": trainer.global_step, "train_losses": model.train_losses,
              "val_losses": model.val_losses, "val_checksums": model.val_checksums,
              "final_checksum": float(sum(t.double().sum() for t in final.values()))}
    if trainer.is_global_zero:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(final, os.path.join(args.out, "final.pt"))
        print(f"{RESULT_TAG} {json.dumps(result, sort_keys=True)}", flush=True)
    return result


if __name__ == "__main__":
    main()
