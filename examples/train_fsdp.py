"""Train the reference GPT-2 (:mod:`benchmarks.gpt`) with ACCO / DPU on an FSDP2 (``fully_shard``) model.

    torchrun --nproc_per_node 2 examples/train_fsdp.py
    torchrun --nproc_per_node 2 examples/train_fsdp.py --config ds_configs/dpu.json --steps 5 --bf16

Same data (the embedded corpus of :mod:`benchmarks.data`, byte-tokenized), model family (GPT-2,
random init) and DeepSpeed-style JSON config as the DeepSpeed example: its ``"acco"`` block,
``gradient_accumulation_steps``, ``gradient_clipping``, ``train_micro_batch_size_per_gpu`` and the
AdamW settings of its ``"optimizer"`` block are read. Rank 0 prints each optimizer step's train
loss (mean over the step's micro-batches and the ranks) and, at the end, the held-out loss on the
committed weights.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the library, and the demo model and corpus (benchmarks/), from the checkout

from ds_acco import configs  # noqa: E402
from benchmarks.gpt import CausalLM, heldout_loss, param_groups  # noqa: E402  (the reference model)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=configs.path("acco.json"),
                   help="DeepSpeed-style JSON config with an 'acco' block")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--bf16", action="store_true",
                   help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute, fp32 G and B")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def shard(model: torch.nn.Module, bf16: bool) -> torch.nn.Module:
    """fully_shard each transformer block, then the root (FSDP2's usual recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.lm.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def adamw(params, cfg: dict) -> torch.optim.AdamW:
    """torch AdamW with the settings of the config's DeepSpeed "optimizer" block (if any)."""
    p = dict((cfg.get("optimizer") or {}).get("params") or {})
    return torch.optim.AdamW(params, lr=p.get("lr", 1e-3), betas=tuple(p.get("betas", (0.9, 0.95))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.01))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import ds_acco
    from benchmarks.data import build_splits, heldout_batches, micro_batches
    from ds_acco.fsdp import AccoFSDP

    with open(args.config) as f:
        cfg = json.load(f)
    train_rows, heldout_rows = build_splits("embedded", seq_len=args.seq_len, holdout=0.02, seed=0)
    torch.manual_seed(args.seed)
    model = shard(CausalLM(args.seq_len), args.bf16)
    optimizer = adamw(param_groups(model), cfg)  # over FSDP's sharded DTensor parameters
    acco = AccoFSDP(model, optimizer, cfg)
    gas = acco.gradient_accumulation_steps
    micro = cfg.get("train_micro_batch_size_per_gpu", 4)
    stream = micro_batches(train_rows, micro, rank, world, args.seed)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"FSDP2 + ACCO mode={acco.acco_config.mode} accumulation={acco.acco_config.accumulation}, {world} ranks, "
              f"{micro} seqs x {gas} micro-batches per rank per step, {n_params:,} parameters, "
              f"{'bf16 compute' if args.bf16 else 'fp32'}", flush=True)

    t0 = time.perf_counter()
    losses = []
    for i in range(args.steps * gas):
        loss = model(next(stream))
        acco.backward(loss)
        acco.step()
        losses.append(loss.detach().float())
        if (i + 1) % gas == 0:  # step k's micro-batches are done: mean over them and the ranks
            mean = torch.stack(losses[-gas:]).mean().double()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {(i + 1) // gas:3d}/{args.steps}  loss {mean.item() / world:.4f}  "
                      f"committed {acco.global_steps}", flush=True)
    with ds_acco.committed_weights(acco):  # drains: the last step commits here
        held = heldout_loss(model, heldout_batches(heldout_rows, 16, rank, world))
    if rank == 0:
        print(f"done: {acco.global_steps} committed steps in {time.perf_counter() - t0:.1f}s, held-out loss "
              f"{held:.4f} on the committed weights", flush=True)
    acco.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
