"""The memory part: peak memory and step time of stock ZeRO-1, ACCO and DPU on a bf16 GPT, judged
by memory_verdict (a pure function tested on CPU): ACCO within stock's + 1.25 communication buffers."""
from __future__ import annotations

import gc
import json
import statistics
import time
from typing import Dict, List, Sequence

import torch

from .checks import Checks
from .gpt_runs import gpt_data, gpt_engine, gpt_micro_batch

MEMORY_FACTOR = 1.25


def memory_verdict(peaks: Dict[str, Sequence[float]], buffer_bytes: float, factor: float = MEMORY_FACTOR) -> dict:
    """Whether every ACCO variant's peak stays within stock ZeRO-1's + ``factor`` communication buffers.

    ``peaks``: variant → the peak bytes of each of its runs above what was allocated when it started;
    'stock' is the baseline (its smallest run: the strict bound), every other variant is judged by
    its largest run. ``buffer_bytes``: the bytes of ACCO's communication buffer B."""
    if not buffer_bytes > 0:
        raise ValueError(f"buffer_bytes = {buffer_bytes!r}: the communication buffer must have a positive size")
    others = {v: p for v, p in peaks.items() if v != "stock"}
    if not peaks.get("stock") or not others or not all(others.values()):
        raise ValueError(f"memory_verdict needs runs of 'stock' and of at least one other variant, got {peaks}")
    stock = min(peaks["stock"])
    bound = stock + factor * buffer_bytes
    variants = {v: {"peak": max(p), "over_stock_in_buffers": (max(p) - stock) / buffer_bytes, "ok": max(p) <= bound}
                for v, p in others.items()}
    return {"stock": stock, "buffer": buffer_bytes, "factor": factor, "bound": bound, "variants": variants,
            "ok": all(v["ok"] for v in variants.values())}


def measure_variant(variant: str, args) -> dict:
    """Peak memory above the start and step times of one variant (its engine destroyed after)."""
    gc.collect()  # the previous variant's last references: freed before this one starts, not during it
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = gpt_engine(variant, args.n_layer, args.n_embd, args.seq, args.micro_batch, args.gas)
    data = gpt_data(engine, args.micro_batch, args.seq, args.gas)  # one optimizer step's, reused
    times = []
    for k in range(args.warmup + args.steps):
        torch.cuda.synchronize()  # timing only, between optimizer steps
        t0 = time.perf_counter()
        for rows in data:
            gpt_micro_batch(engine, rows)
        torch.cuda.synchronize()
        if k >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"variant": variant, "params": sum(p.numel() for p in engine.module.parameters()),
           "peak_bytes": torch.cuda.max_memory_allocated() - start, "step_s_median": statistics.median(times),
           "step_s": times}
    if variant != "stock":
        out["buffer_bytes"] = sum(g.comm.numel() * g.comm.element_size() for g in engine.optimizer.schedule.groups)
    engine.destroy()
    del engine, data
    return out


def check_memory(checks: Checks, device: torch.device, args) -> dict:
    # The first run pays one-off allocations (cuBLAS workspaces, ...): a stock run first, not counted.
    runs = [measure_variant(v, args) for v in ("stock", "stock", "fixed", "dpu", "stock")][1:]
    for r in runs:
        print(json.dumps({k: r[k] for k in ("variant", "peak_bytes", "step_s_median")}), flush=True)
    peaks: Dict[str, List[float]] = {}
    for r in runs:
        peaks.setdefault(r["variant"], []).append(r["peak_bytes"])
    verdict = memory_verdict(peaks, next(r["buffer_bytes"] for r in runs if "buffer_bytes" in r))
    mib = {v: round(d["peak"] / 2 ** 20, 1) for v, d in verdict["variants"].items()}
    checks.expect("memory.bound", verdict["ok"], verdict,
                  f"peak MiB {mib} above the bound {verdict['bound'] / 2 ** 20:.1f} MiB = stock "
                  f"{verdict['stock'] / 2 ** 20:.1f} + {MEMORY_FACTOR} x buffer {verdict['buffer'] / 2 ** 20:.1f}")
    return {"runs": runs, "verdict": verdict}
