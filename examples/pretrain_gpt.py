"""Megatron-style GPT pretraining with DeepSpeed ZeRO-1 or ACCO: iterations, periodic evaluation on
committed weights, periodic checkpoints and exact resume.

    deepspeed --num_gpus 2 examples/pretrain_gpt.py --deepspeed --deepspeed_config ds_configs/acco.json \\
        --train-iters 200 --eval-interval 50 --eval-iters 10 --save ckpt --save-interval 50
    deepspeed --num_gpus 2 examples/pretrain_gpt.py --deepspeed --deepspeed_config ds_configs/acco.json \\
        --train-iters 400 --load ckpt --save ckpt --save-interval 50          # resumes where it stopped

One iteration is one optimizer step: ``gradient_accumulation_steps`` micro-batches of
``train_micro_batch_size_per_gpu`` sequences per rank (both from the config; ``--micro-batch-size``
overrides the config's value). The script calls ``engine.step()`` after every micro-batch, as
DeepSpeed expects; with ACCO the commit of iteration k lands during iteration k+1, and
``engine.global_steps`` counts commits.

* Model: the reference GPT-2 of :mod:`benchmarks.gpt` (``--num-layers``, ``--hidden-size``,
  ``--num-attention-heads``, ``--seq-length``), random initialisation, vocabulary of 256 bytes, no dropout.
* Data: ``--data-path`` -- default the embedded standard-library docstring corpus (no network); a
  local text / JSON / CSV / parquet file or directory; or a hub dataset ``name[:config]`` when
  online. Byte-tokenized; 2 % of the sequences are held out.
* Evaluation (every ``--eval-interval`` iterations and at the end) runs on the committed weights
  (``with ds_acco.committed_weights(engine):``), never on ACCO's estimate.
* Checkpoints (every ``--save-interval`` iterations and at the end, when ``--save`` is given) use
  ``engine.save_checkpoint``; ``--load`` resumes with ``engine.load_checkpoint``. With ACCO both drain
  the round in flight and keep ACCO's in-flight state, and the data stream skips what was consumed,
  so a resumed run continues exactly as the uninterrupted one.

Rank 0 shows a tqdm progress bar and prints ``PRETRAIN_RESULT {json}`` at the end.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the library, and the demo model and corpus (benchmarks/), from the checkout

from ds_acco import configs  # noqa: E402
from benchmarks.gpt import CausalLM, param_groups  # noqa: E402  (the reference model)

RESULT_TAG = "PRETRAIN_RESULT"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed", action="store_true", help="accepted for Megatron compatibility (always on)")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=configs.path("acco.json"),
                   help="DeepSpeed JSON config; its 'acco' block picks stock ZeRO-1, ACCO or DPU")
    g.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True, help="total iterations (optimizer steps)")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per micro-batch per rank (default: the config's train_micro_batch_size_per_gpu)")
    g.add_argument("--seed", type=int, default=1234, help="model init and data order")
    g.add_argument("--log-interval", type=int, default=1, help="progress bar update every N iterations")
    g = p.add_argument_group("model")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default="embedded",
                   help="'embedded' (default, no network), a local .txt/.json/.jsonl/.csv/.parquet file or "
                        "directory, or a hub dataset name[:config] (needs 'datasets' and network)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-interval", type=int, default=100, help="evaluate every N iterations (0: at the end only)")
    g.add_argument("--eval-iters", type=int, default=10, help="held-out micro-batches per rank per evaluation")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0, help="checkpoint every N iterations (0: at the end only)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory, if any")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    args = p.parse_args(argv)
    for name in ("train_iters", "eval_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def mean_across_ranks(values) -> float:
    t = torch.stack([v.detach().double() for v in values]).mean()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(engine, batches) -> float:
    import ds_acco

    with ds_acco.committed_weights(engine):  # collective; the model holds θ, never the estimate
        engine.module.eval()
        loss = mean_across_ranks([engine.module(b) for b in batches])
        engine.module.train()
    return loss


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    from tqdm import tqdm

    import ds_acco
    from benchmarks.data import build_splits, heldout_batches, micro_batches

    if not args.verbose:
        ds_logger.setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.micro_batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
        config.pop("train_batch_size", None)  # DeepSpeed derives it again

    torch.manual_seed(args.seed)
    model = CausalLM(args.seq_length, args.hidden_size, args.num_layers, args.num_attention_heads)
    engine, _, _, _ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=config)
    gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()

    start = 0
    if args.load:
        path, client_state = engine.load_checkpoint(args.load)
        if path is not None:
            start = int(client_state["iteration"])
            if rank == 0:
                print(f"resumed from {path} at iteration {start}", flush=True)
        elif rank == 0:
            print(f"no checkpoint in {args.load}: starting from scratch", flush=True)

    train_rows, heldout_rows = build_splits(args.data_path, seq_len=args.seq_length, holdout=0.02, seed=0)
    stream = micro_batches(train_rows, mbs, rank, world, args.seed)
    for _ in range(start * gas):  # the micro-batches the checkpointed iterations consumed
        next(stream)
    evals = heldout_batches(heldout_rows, mbs, rank, world)[:args.eval_iters]
    if rank == 0:
        print(f"{type(engine).__name__} + {type(engine.optimizer).__name__}: {world} ranks x {gas} micro-batches x "
              f"{mbs} sequences of {args.seq_length} bytes per iteration; {sum(p.numel() for p in model.parameters()):,} "
              f"parameters; data {args.data_path}: {train_rows.shape[0]} train / {heldout_rows.shape[0]} held-out "
              "sequences", flush=True)

    def save(iteration: int) -> None:
        engine.save_checkpoint(args.save, tag=f"iter_{iteration:07d}", client_state={"iteration": iteration})

    losses, heldout = {}, {}
    bar = tqdm(total=args.train_iters, initial=start, desc="iterations", unit="it", dynamic_ncols=True,
               disable=rank != 0 or args.no_progress)
    for iteration in range(start + 1, args.train_iters + 1):
        step_losses = []
        for _ in range(gas):
            loss = engine(next(stream))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss)
        losses[iteration] = mean_across_ranks(step_losses)
        bar.update(1)
        if iteration % args.log_interval == 0:
            bar.set_postfix(loss=f"{losses[iteration]:.4f}", committed=int(engine.global_steps))
        last = iteration == args.train_iters
        if last or (args.eval_interval and iteration % args.eval_interval == 0):
            heldout[iteration] = evaluate(engine, evals)
            bar.write(f"iteration {iteration}: held-out loss {heldout[iteration]:.4f} on committed weights "
                      f"(committed steps {engine.global_steps})") if rank == 0 else None
        if args.save and (last or (args.save_interval and iteration % args.save_interval == 0)):
            save(iteration)
    bar.close()

    result = {"engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__, "world_size": world,
              "start_iteration": start, "train_iters": args.train_iters, "global_steps": int(engine.global_steps),
              "losses": {str(k): v for k, v in losses.items()}, "heldout": {str(k): v for k, v in heldout.items()}}
    engine.destroy()
    if rank == 0:
        print(f"{RESULT_TAG} {json.dumps(result, sort_keys=True)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
