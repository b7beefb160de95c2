"""Train a small GPT-2 on CPU ranks with stock ZeRO-1 or ACCO, or both side by side (``--ab``).

    deepspeed --num_gpus 2 examples/train_gpt.py --ab
    torchrun --nproc_per_node 2 examples/train_gpt.py --deepspeed_config ds_configs/dpu.json --steps 3

The data is the embedded standard-library docstring corpus of :mod:`benchmarks.data` (no network),
byte-tokenized. Rank 0 prints, per optimizer step, the train loss (mean over the step's
micro-batches, averaged across ranks) and the step's wall time, plus the held-out loss on the
committed weights every ``--eval-every`` steps and at the end.

Step k's micro-batches are the k-th block of ``gradient_accumulation_steps`` micro-batches of the
loop, in every mode (in ACCO its first half is computed at the estimate, in DPU at the previous
weights). A step's wall time is the time between consecutive increments of
``engine.global_steps`` on rank 0, held-out evaluation excluded. Summary medians skip step 1
(warm-up) and steps committed while draining (at an evaluation or at the end), which are not
steady-state steps.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the library, and the demo model and corpus (benchmarks/), from the checkout

from ds_acco import configs  # noqa: E402
from benchmarks.gpt import CausalLM, heldout_loss, param_groups  # noqa: E402  (the reference model)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=configs.path("acco.json"),
                   help="DeepSpeed JSON config; its 'acco' block picks stock ZeRO-1, ACCO or DPU")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (per run with --ab)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--eval-every", type=int, default=10,
                   help="held-out loss every N committed steps (0: at the end only); in DPU mode the drain "
                        "before an evaluation commits one more step, so it reports N+1")
    p.add_argument("--ab", action="store_true",
                   help="run stock ZeRO-1 (config without its acco block) then ACCO (the config's acco block, "
                        "or acco mode if it has none) with the same seed, init and data; print a comparison")
    p.add_argument("--data", default="embedded",
                   help="'embedded' (default, no network), a local .txt/.json/.jsonl/.csv/.parquet path, "
                        "or a hub dataset name[:config] (needs the 'datasets' package and network)")
    p.add_argument("--json-out", default=None, help="rank 0 writes the per-step records here")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher; ignored")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


# -- configs -----------------------------------------------------------------------------------
def stock_config(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    out.pop("acco", None)
    return out


def acco_config(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    out["acco"] = {"mode": "acco", "accumulation": "fixed", **(out.get("acco") or {}), "enabled": True}
    return out


def run_label(cfg: dict) -> str:
    block = cfg.get("acco") or {}
    return block.get("mode", "acco") if block.get("enabled", False) else "stock"


# -- one training run --------------------------------------------------------------------------
class StepLog:
    """Per-step records on rank 0: the loss comes at the end of the step's micro-batches, the
    time when ``global_steps`` moves; a line is printed once both are known."""

    def __init__(self, label: str, steps: int, rank: int):
        self.label, self.steps, self.rank = label, steps, rank
        self.records = [{"step": s + 1} for s in range(steps)]
        self.printed = 0

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{self.label}] {msg}", flush=True)

    def flush(self) -> None:
        while self.printed < self.steps and {"loss", "step_time_s"} <= self.records[self.printed].keys():
            r = self.records[self.printed]
            note = "  (drained)" if r["drained"] else ""
            self.say(f"step {r['step']:3d}/{self.steps}  loss {r['loss']:.4f}  time {r['step_time_s']:.3f}s{note}")
            self.printed += 1


def train(cfg: dict, args, train_rows, heldout_rows) -> dict:
    import ds_acco
    from benchmarks.data import heldout_batches, micro_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    label = run_label(cfg)
    torch.manual_seed(args.seed)  # same init in every run
    model = CausalLM(args.seq_len)
    engine, _, _, _ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    gas = engine.gradient_accumulation_steps()
    stream = micro_batches(train_rows, engine.train_micro_batch_size_per_gpu(), rank, world, args.seed)
    evals = heldout_batches(heldout_rows, 16, rank, world)
    log = StepLog(label, args.steps, rank)
    log.say(f"{type(engine).__name__} + {type(engine.optimizer).__name__}, {world} ranks, "
            f"{engine.train_micro_batch_size_per_gpu()} seqs x {gas} micro-batches per rank per step, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters")

    state = {"seen": engine.global_steps, "t_last": time.perf_counter()}
    heldout = []  # (committed step, loss)

    def note_commits(now: float, drained: bool) -> None:
        while state["seen"] < min(engine.global_steps, args.steps):
            log.records[state["seen"]].update(step_time_s=now - state["t_last"], drained=drained)
            state["seen"] += 1
            state["t_last"] = now
        log.flush()

    def evaluate() -> None:
        with ds_acco.committed_weights(engine):  # drains: a commit may land here
            note_commits(time.perf_counter(), drained=True)
            loss = heldout_loss(engine.module, evals)
            heldout.append((engine.global_steps, loss))
            log.records[engine.global_steps - 1]["heldout_loss"] = loss
            log.say(f"held-out loss {loss:.4f} on committed weights after step {engine.global_steps}")
        state["t_last"] = time.perf_counter()  # evaluation is not step time

    t_start = time.perf_counter()
    losses = []
    next_eval = args.eval_every
    for i in range(args.steps * gas):
        loss = engine(next(stream))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        if (i + 1) % gas == 0:  # the step's micro-batches are done: mean over them and the ranks
            mean = torch.stack(losses[-gas:]).mean().double()
            dist.all_reduce(mean)
            log.records[i // gas]["loss"] = mean.item() / world
        note_commits(time.perf_counter(), drained=False)
        if args.eval_every and engine.global_steps >= next_eval and engine.global_steps < args.steps:
            evaluate()
            next_eval = (engine.global_steps // args.eval_every + 1) * args.eval_every
    evaluate()  # drains what is in flight: the last steps commit here
    wall = time.perf_counter() - t_start
    assert engine.global_steps == args.steps, (engine.global_steps, args.steps)
    engine.destroy()
    steady = [r["step_time_s"] for r in log.records[1:] if not r["drained"]]
    result = {"label": label, "records": log.records, "heldout": heldout, "final_heldout": heldout[-1][1],
              "median_step_s": statistics.median(steady) if steady else None, "wall_s": wall,
              "engine": type(engine).__name__}
    log.say(f"done: {args.steps} steps in {wall:.1f}s, final held-out loss {result['final_heldout']:.4f}, "
            f"median step time {_secs(result['median_step_s'])}")
    return result


# -- reporting ---------------------------------------------------------------------------------
def _secs(x) -> str:
    return "n/a (too few steady steps)" if x is None else f"{x:.3f}s"


def print_ab(stock: dict, acco: dict) -> None:
    a = acco["label"]
    print(f"\n{'step':>4} | {'stock loss':>10} | {a + ' loss':>10} | {'diff':>8} | {'stock s':>8} | {a + ' s':>8}")
    print("-" * 64)
    def mark(rec):
        return "*" if rec["drained"] else " "

    for s, r in zip(stock["records"], acco["records"]):
        print(f"{s['step']:>4} | {s['loss']:>10.4f} | {r['loss']:>10.4f} | {r['loss'] - s['loss']:>+8.4f} | "
              f"{s['step_time_s']:>7.3f}{mark(s)} | {r['step_time_s']:>7.3f}{mark(r)}")
    print("(* committed while draining for an evaluation or at the end; left out of the medians)")
    ms, ma = stock["median_step_s"], acco["median_step_s"]
    ratio = f"{ma / ms:.2f}" if ms and ma else "n/a"
    print(f"\nfinal held-out loss:   stock {stock['final_heldout']:.4f}   {a} {acco['final_heldout']:.4f}   "
          f"diff {acco['final_heldout'] - stock['final_heldout']:+.4f}")
    print(f"median step time:      stock {_secs(ms)}   {a} {_secs(ma)}   ratio {a}/stock {ratio}")
    print(f"training wall time:    stock {stock['wall_s']:.1f}s   {a} {acco['wall_s']:.1f}s", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from benchmarks.data import build_splits

    if not args.verbose:
        ds_logger.setLevel(logging.WARNING)
        # Stock ZeRO-1 calls this torch API on every step; the warning is not ours to fix.
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    train_rows, heldout_rows = build_splits(args.data, seq_len=args.seq_len, holdout=0.02, seed=0)
    if rank == 0:
        print(f"data: {args.data}: {train_rows.shape[0]} train / {heldout_rows.shape[0]} held-out sequences of "
              f"{args.seq_len + 1} bytes; config {os.path.relpath(args.deepspeed_config)}", flush=True)

    runs = {}
    if args.ab:
        runs["stock"] = train(stock_config(cfg), args, train_rows, heldout_rows)
        dist.barrier()
        runs["acco"] = train(acco_config(cfg), args, train_rows, heldout_rows)
        if rank == 0:
            print_ab(runs["stock"], runs["acco"])
    else:
        result = train(cfg, args, train_rows, heldout_rows)
        runs[result["label"]] = result

    if rank == 0 and args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "local_rank"}, "runs": runs}, f, indent=1)
        print(f"wrote {args.json_out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
