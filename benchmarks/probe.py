"""The advisor's probe on one rank: compute-only and communication-only timings, then both at once
(what contention costs)."""
from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from typing import List

import torch
import torch.distributed as dist

from .emulation import slow_down
from .variants import build_model


# -- probe ---------------------------------------------------------------------------------------
def _timed(fn, reps: int) -> List[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def probe(spec: dict, stream, rank: int, world: int) -> dict:
    """Compute-only and communication-only timings on this setup (see the module docstring)."""
    gc.collect()  # a memory run probes after its variant: let that run's engine go first
    model = build_model(spec, rank)
    n_params = sum(p.numel() for p in model.parameters())
    slow = spec.get("slow_factor", 1.0) if rank == spec.get("slow_rank", -1) else 1.0

    def micro():
        t0 = time.perf_counter()
        model(next(stream)).backward()
        slow_down(slow, time.perf_counter() - t0)

    dist.barrier()  # every rank computes at once: same contention as in training
    _timed(micro, 2)
    mb = _timed(micro, spec.get("probe_micro_batches", 6))
    model.zero_grad(set_to_none=True)
    dist.barrier()
    padded = -(-n_params // world) * world
    # A memory run's probe (after its measured peak; it feeds only the advice line) times its
    # collectives and the shard step on at most ``probe_comm_elements`` and scales the times to the
    # model's size: model-sized buffers here would double a large model's footprint after training.
    cap = spec.get("probe_comm_elements")
    timed = padded if not cap else min(padded, max(world, int(cap) // world * world))
    scale = padded / timed
    flat = torch.zeros(timed, dtype=torch.float32)
    shard = torch.zeros(timed // world, dtype=torch.float32)
    tiny = torch.zeros(8, dtype=torch.float32)
    reps = spec.get("probe_comm_reps", 2)
    scaled = lambda ts: [t * scale for t in ts]  # noqa: E731
    _timed(lambda: dist.all_reduce(flat), 1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ar = scaled(_timed(lambda: dist.all_reduce(flat), reps))
    ag = scaled(_timed(lambda: dist.all_gather_into_tensor(flat, shard), reps))
    cpu_frac = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    lat = _timed(lambda: dist.all_reduce(tiny), 20)
    half = flat[:timed // 2].clone()
    ar_half = scaled(_timed(lambda: dist.all_reduce(half), reps))
    p = torch.nn.Parameter(torch.zeros(timed // world))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()
    opt_s = scaled(_timed(opt.step, 3))

    def one_round():  # what an ACCO round does on gloo: in-place all-reduce, shard step, all-gather
        dist.all_reduce(flat)
        opt.step()
        dist.all_gather_into_tensor(flat, shard)
    alone = torch.tensor([statistics.median(mb), (statistics.median(ar) + statistics.median(ag)) / scale])
    dist.all_reduce(alone, op=dist.ReduceOp.MAX)  # every rank must run the same number of rounds
    rounds = min(20, max(reps, math.ceil(3 * alone[0].item() / max(1e-6, alone[1].item()))))
    mb_ov, round_ov = overlapped(micro, one_round, rounds)
    round_ov *= scale
    del flat, shard, half, p, opt, model
    return {"n_params": n_params, "padded_params": padded, "comm_timed_elements": timed,
            "micro_batch_s": statistics.median(mb),
            "micro_batch_samples_s": mb, "all_reduce_s": statistics.median(ar), "all_reduce_half_s":
            statistics.median(ar_half), "all_gather_s": statistics.median(ag), "latency_s": statistics.median(lat),
            "opt_step_s": statistics.median(opt_s), "comm_bytes": padded * 4, "comm_cpu_fraction": cpu_frac,
            "micro_batch_overlap_s": mb_ov, "round_overlap_s": round_ov, "overlap_rounds": rounds}


def overlapped(micro, one_round, rounds: int, barrier=None) -> tuple:
    """Compute and rounds at once, as ACCO runs them: ``rounds`` rounds back to back on a side
    thread while this thread computes micro-batches until they end. Returns (seconds per
    micro-batch while a round ran, median seconds per round while compute ran). The rate counts
    each micro-batch by the fraction of it inside the rounds' window, so a window shorter than
    a micro-batch still measures (assuming even work through a micro-batch; the caller sizes the
    window to about 3 micro-batches, within 2-20 rounds). A failed round is re-raised here, and
    the launcher then stops every rank."""
    window = [0.0, 0.0]
    per_round: List[float] = []
    failure: List[BaseException] = []

    def comm():
        try:
            for _ in range(rounds):
                t0 = time.perf_counter()
                one_round()
                per_round.append(time.perf_counter() - t0)
        except BaseException as e:  # re-raised on the main thread
            failure.append(e)
        window[1] = time.perf_counter()

    (barrier or dist.barrier)()
    side = threading.Thread(target=comm, name="probe-rounds", daemon=True)
    window[0] = time.perf_counter()
    side.start()
    spans = []
    try:
        while side.is_alive():
            a = time.perf_counter()
            micro()
            spans.append((a, time.perf_counter()))
    finally:
        side.join()  # bounded: a fixed number of rounds; leaves no collective in flight if compute failed
    if failure:
        raise failure[0]
    return seconds_per_item(spans, *window), statistics.median(per_round)


def seconds_per_item(spans, w0: float, w1: float) -> float:
    """Seconds per item inside the window [w0, w1], each (start, end) span counted by the
    fraction of it that lies inside (work assumed even within an item)."""
    done = sum((min(b, w1) - max(a, w0)) / (b - a) for a, b in spans if b > a and min(b, w1) > max(a, w0))
    if done <= 0:
        raise ValueError(f"no item overlaps the window [{w0}, {w1}]")
    return (w1 - w0) / done
