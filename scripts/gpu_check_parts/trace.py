"""The trace part: a torch.profiler trace of ACCO steps, analysed (analyse_trace, a pure function
tested on CPU) for the lane's ops on their own streams overlapping compute, with no host
synchronisation on the compute side."""
from __future__ import annotations

import json
import os
from typing import Collection, List, Sequence

import torch

from .checks import Checks, device_sleep, sleep_cycles_per_ms
from .gpt_runs import gpt_data, gpt_engine, gpt_micro_batch

MICRO_BATCH = "gpu_check::micro_batch"  # the profiler label around every traced micro-batch
MODEL = "gpu_check::model_forward"  # around the model's own forward: its host syncs are the model's


GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
HOST_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cuCtxSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize")


def _union(spans: Sequence[tuple]) -> List[tuple]:
    out: List[list] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(s) for s in out]


def _length(spans: Sequence[tuple]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(xs: Sequence[tuple], ys: Sequence[tuple]) -> List[tuple]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def trace_tids(thread) -> set:
    """The ids a profiler trace may give ``thread`` (a started threading.Thread): its system id where
    Kineto knows the thread, else CUPTI's own, the low 32 bits of pthread_self() (Python's ident),
    as unsigned, as signed, or -- seen on an H200 with torch 2.11 -- as the signed value's magnitude."""
    low = thread.ident & 0xFFFFFFFF
    signed = low - (1 << 32) if low >= 1 << 31 else low
    return {thread.native_id, low, signed, abs(signed)}


def analyse_trace(trace, lane_tids: Collection[int], marker: str = MICRO_BATCH, model: str = MODEL) -> dict:
    """What a chrome trace of torch.profiler (its dict, or its ``traceEvents``) says about ACCO's
    rounds. Device ops (kernels, copies, memsets) are attributed to the thread that launched them
    through the launch's correlation id: the lane thread (``lane_tids``: :func:`trace_tids`)
    launches the rounds' ops, NCCL's included; every other thread (the training loop's, autograd's)
    is compute. Returns the counts, the streams of each side, the share of the rounds' device time
    that overlaps compute ops, and the host synchronisations of the compute side inside ``marker``
    spans (one per micro-batch) -- apart from those inside ``model`` spans (the model's own forward:
    transformers' GPT-2 reads a mask value on the host), listed as ``model_syncs``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lane_tids = set(lane_tids)
    launcher = {e["args"]["correlation"]: e.get("tid") for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") in GPU_OPS and e.get("args", {}).get("correlation") in launcher]
    rounds = [e for e in ops if launcher[e["args"]["correlation"]] in lane_tids]
    compute = [e for e in ops if launcher[e["args"]["correlation"]] not in lane_tids]
    compute_streams = sorted({e["args"].get("stream") for e in compute})
    round_streams = sorted({e["args"].get("stream") for e in rounds})
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])

    def overlapped(side):
        spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in side])
        total = _length(spans)
        return _length(_intersection(spans, busy)) / total if total > 0 else 0.0
    nccl = [e for e in rounds if "nccl" in e.get("name", "").lower()]
    def spans(name):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == name and e.get("ph") == "X"
                and e.get("cat") != "gpu_user_annotation"]
    windows, forwards = spans(marker), spans(model)
    inside = [e for e in events if e.get("cat") in LAUNCHES and e.get("name") in HOST_SYNCS
              and e.get("tid") not in lane_tids and any(a <= e["ts"] <= b for a, b in windows)]
    in_model = [any(a <= e["ts"] <= b for a, b in forwards) for e in inside]
    syncs = [e["name"] for e, m in zip(inside, in_model) if not m]
    return {"micro_batches": len(windows), "compute_ops": len(compute), "round_ops": len(rounds),
            "nccl_kernels": len(nccl), "compute_streams": compute_streams, "round_streams": round_streams,
            "rounds_on_compute_streams": sorted({e["name"] for e in rounds
                                                 if e["args"].get("stream") in compute_streams})[:10],
            "round_time_us": _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in rounds])),
            "round_overlap": overlapped(rounds), "nccl_overlap": overlapped(nccl) if nccl else None,
            "compute_syncs_in_micro_batches": syncs,
            "model_syncs": [e["name"] for e, m in zip(inside, in_model) if m],
            "launching_threads": sorted({str(t) for t in launcher.values()})}


OVERLAP_MIN = 0.5


def check_trace_analysis(checks: Checks, analysis: dict) -> None:
    """The trace part's assertions, on :func:`analyse_trace`'s result."""
    found = analysis["micro_batches"] > 0 and analysis["compute_ops"] > 0 and analysis["round_ops"] > 0
    checks.expect("trace.threads", found, {k: analysis[k] for k in ("micro_batches", "compute_ops", "round_ops",
                                                                    "nccl_kernels", "launching_threads")},
                  "the trace needs micro-batch spans, compute ops and ops launched from the lane thread; found "
                  f"{analysis['micro_batches']} / {analysis['compute_ops']} / {analysis['round_ops']} "
                  f"(threads that launched: {analysis['launching_threads']})")
    apart = found and not analysis["rounds_on_compute_streams"]
    checks.expect("trace.side_stream", apart, {"round": analysis["round_streams"],
                                               "compute": analysis["compute_streams"]},
                  f"round ops on a compute stream: {analysis['rounds_on_compute_streams']}")
    shares = [analysis["round_overlap"]] + ([analysis["nccl_overlap"]] if analysis["nccl_overlap"] is not None else [])
    checks.expect("trace.overlap", found and min(shares) >= OVERLAP_MIN,
                  {"rounds": analysis["round_overlap"], "nccl": analysis["nccl_overlap"],
                   "round_time_us": analysis["round_time_us"]},
                  f"share of the rounds' device time overlapping compute ops: rounds {analysis['round_overlap']:.2f}, "
                  f"NCCL {analysis['nccl_overlap']} (at least {OVERLAP_MIN} required)")
    syncs = analysis["compute_syncs_in_micro_batches"]
    checks.expect("trace.compute_syncs", found and not syncs, syncs,
                  f"host synchronisations from the compute side inside micro-batches: {syncs[:5]}")


def check_trace(checks: Checks, device: torch.device, args) -> dict:
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    gas = 4
    engine = gpt_engine("fixed", 2, 256, 128, 4, gas)
    sleep = device_sleep(args.trace_sleep_ms, sleep_cycles_per_ms())
    data = gpt_data(engine, 4, 128, gas * 4)
    for rows in data[:2 * gas]:  # bootstrap, first swaps: steady state from here
        gpt_micro_batch(engine, rows, sleep)
    lane_tids = trace_tids(engine.optimizer.schedule.lane._thread)
    span = {}

    def enter(*_):  # returns None: a pre-hook's value would replace the forward's inputs
        span["f"] = record_function(MODEL)
        span["f"].__enter__()

    def leave(*_):
        span.pop("f").__exit__(None, None, None)
    hooks = [engine.module.register_forward_pre_hook(enter), engine.module.register_forward_hook(leave)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for rows in data[2 * gas:]:
            with record_function(MICRO_BATCH):
                gpt_micro_batch(engine, rows, sleep)
        torch.cuda.synchronize()  # outside the micro-batches: the analysis ignores it
    for hook in hooks:
        hook.remove()
    engine.destroy()
    path = os.path.join(args.out, "acco_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        analysis = analyse_trace(json.load(f), lane_tids)
    check_trace_analysis(checks, analysis)
    return {"trace": path, "lane_tids": sorted(lane_tids), "analysis": analysis}
