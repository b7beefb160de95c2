"""A training script that knows nothing of ds_acco: it builds a model and calls
``deepspeed.initialize`` itself, like HF example scripts or Megatron-DeepSpeed do.

    torchrun --nproc_per_node 2 tests/launch/plain_ds_script.py --deepspeed cfg.json       # stock
    torchrun --nproc_per_node 2 -m ds_acco run tests/launch/plain_ds_script.py --deepspeed cfg.json

Rank 0 prints ``PLAIN_RESULT {json}`` last: the engine and optimizer classes, the committed step
count and every loss.
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        print("PLAIN_RESULT " + json.dumps({"engine": type(engine).__name__, "optimizer":
                                            type(engine.optimizer).__name__, "world_size": dist.get_world_size(),
                                            "global_steps": engine.global_steps, "losses": losses}), flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
