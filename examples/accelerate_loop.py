"""A plain Accelerate training loop with DeepSpeed ZeRO-1 and ACCO.

    accelerate launch --config_file examples/accelerate_config.yaml -m ds_acco run examples/accelerate_loop.py

The loop is Accelerate's own, with nothing ACCO-specific in it: ``accelerate_config.yaml`` picks
DeepSpeed and points at ``accelerate_ds_config.json``, a ZeRO-1 config with an enabled ``"acco"``
block, and ``-m ds_acco run`` routes the ``deepspeed.initialize`` that ``accelerator.prepare``
calls to ACCO (it runs ``ds_acco.install()`` first, then this script as ``__main__``). The one
ACCO-aware line is the evaluation inside ``ds_acco.committed_weights``: between micro-batches the
live weights are half the time the estimate θ̃, the held-out loss must be taken on the committed θ.
Exports need nothing: ``accelerator.get_state_dict`` returns the committed θ.

The same command with ``DS_ACCO=off`` in the environment trains stock ZeRO-1 from the same config
(the stock side of an A/B). Without ``-m ds_acco run`` an installed ds_acco refuses to start (the
config enables ACCO, the engine would be stock); see the README's Accelerate section.

The model is the demo byte-level GPT-2 (random init) on the embedded standard-library docstring
corpus: nothing is downloaded. Rank 0 prints ``ACCELERATE_RESULT {json}`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the demo model and corpus live in the checkout, not in the installed library

import ds_acco  # noqa: E402
from benchmarks.data import build_splits, heldout_batches  # noqa: E402
from benchmarks.gpt import CausalLM, heldout_loss, param_groups  # noqa: E402

RESULT_TAG = "ACCELERATE_RESULT"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (each gradient_accumulation_steps "
                   "micro-batches, from the DeepSpeed config)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--export", default=None, help="save the exported state dict here (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from accelerate import Accelerator, PartialState
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # CPU-only host: Accelerate finds no device and would treat the job as one process; this state
        # keeps DeepSpeed (ACCELERATE_USE_CPU / `accelerate launch --cpu` would drop it) and shards the data.
        PartialState(cpu=True)
    accelerator = Accelerator()  # DeepSpeed plugin, batch and accumulation from the launch's config file
    if accelerator.state.deepspeed_plugin is None:
        raise SystemExit("accelerate_loop.py: Accelerate did not select DeepSpeed (launched with --cpu, "
                         "ACCELERATE_USE_CPU=true, or without a DeepSpeed config file), so neither DeepSpeed nor "
                         "ACCO would train; fix: accelerate launch --config_file examples/accelerate_config.yaml "
                         "-m ds_acco run examples/accelerate_loop.py, without --cpu")
    torch.manual_seed(0)

    train_rows, heldout_rows = build_splits(seq_len=args.seq_len)
    model = CausalLM(args.seq_len)
    optimizer = torch.optim.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    micro_batch = accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"]
    loader = torch.utils.data.DataLoader(train_rows, batch_size=micro_batch, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # model: the DeepSpeed engine

    gas = model.gradient_accumulation_steps()
    losses = []
    model.train()
    for i, rows in enumerate(loader):
        if i == args.steps * gas:
            break
        with accelerator.accumulate(model):
            loss = model(rows)
            accelerator.backward(loss)  # under ACCO: engine.backward + engine.step, every micro-batch
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    rank, world = accelerator.process_index, accelerator.num_processes
    with ds_acco.committed_weights(model):  # every rank: it may wait for the commit round in flight
        heldout = heldout_loss(model, heldout_batches(heldout_rows, 16, rank, world)[:4])
    state = accelerator.get_state_dict(model)  # the committed weights, no context needed
    if args.export and accelerator.is_main_process:
        torch.save(state, args.export)

    result = {"world_size": world, "engine": type(model).__name__, "optimizer": type(model.optimizer).__name__,
              "gradient_accumulation_steps": gas, "global_steps": int(model.global_steps),
              "losses": losses, "heldout_loss": heldout,
              "export_checksum": float(sum(t.double().sum() for t in state.values()))}
    if accelerator.is_main_process:
        print(f"{RESULT_TAG} {json.dumps(result, sort_keys=True)}", flush=True)
    return result


if __name__ == "__main__":
    main()
