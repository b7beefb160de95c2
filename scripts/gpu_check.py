"""The prepared GPU check: ds_acco's CUDA path on one GPU (world size 1, NCCL), asserted, in one short run.

    bash scripts/gpu_check.sh [OUT]                   # on the GPU machine (wheels, time limit: see the .sh)
    python scripts/gpu_check.py --out OUT             # the same checks without the .sh
    python scripts/gpu_check.py --cpu --out OUT       # dry run on CPU: gloo, and a recording accelerator
                                                      # that pretends the CPU is an asynchronous device
    python scripts/gpu_check.py --cpu --parts protocol --mutate no-ready-wait    # must fail

Every check is an assertion: a failing one is named on stderr ("FAIL <name>: why") and the exit
status is 1, after OUT/gpu_check.json holds what each part measured (rewritten after every part, so
a run stopped at its time limit keeps the parts it finished). A part that raises fails as <part>.ran
and the others still run. ``--cpu`` runs the parts that need no CUDA (protocol, precision, fsdp, tp);
trace and memory are pure functions of what they measure (analyse_trace, memory_verdict), tested on
CPU by tests/scripts/test_gpu_check.py.

Assertions (name: what must hold):
- protocol.races: TinyNet trained through DeepSpeed's engine (ACCO with clipping, and DPU), every lane
  stream, event and tensor access recorded by RecordingAccelerator(inner=DeepSpeed's accelerator):
  races() == [] -- every cross-stream access to the same bytes is ordered by an event wait
- protocol.compute_syncs: no host read or synchronisation on the compute side (the main thread and
  autograd's) in any micro-batch after the first two optimizer steps
- protocol.lane_reads: the lane thread reads the host at most once per round, and rounds ran
- protocol.widened: the runs spin (torch.cuda._sleep; on CPU only marked) on the compute stream
  before every pack of G into B, and on the side stream in every round after its host read and
  before its optimizer step: both race windows are wide open
- protocol.reference: each recorded run's committed weights are within 1e-5 (relative) of the
  float64 reference (tests/reference.py), with both windows widened
- protocol.catches_no_ready_wait: the side stream's wait on the ready event removed, the same run fails
  protocol.races and, on a device, ends off the reference (or raises)
- protocol.catches_no_done_wait: the same with the compute stream's wait on the done event removed
- trace.threads: a torch.profiler trace of ACCO steps (a small GPT, bf16, a _sleep on the compute
  stream at each micro-batch's start, standing for a large model's queued kernels: the round launched
  at the previous phase end runs beside it unless something serialises them) has compute ops and ops launched from the lane thread (the rounds' kernels and
  NCCL's; at world size 1 NCCL launches no kernel: one-rank collectives are copies or no-ops)
- trace.side_stream: no op of a round ran on a stream that compute ops ran on
- trace.overlap: at least half of the rounds' device time (NCCL's included) overlaps compute kernels
- trace.compute_syncs: no device, stream or event synchronisation from the compute side inside a
  profiled micro-batch, outside the model's own forward (transformers' GPT-2 reads a mask value on
  the host there, in stock runs too: reported as model_syncs, not counted)
- precision.fp32: DeepSpeed ACCO and DPU, fp32 AdamW with clipping and an LR schedule: within 1e-5
  of the float64 reference
- precision.bf16: DeepSpeed ACCO in bf16 (fp32 accumulation): the committed fp32 master nearest to
  ACCO's reference (below half the distance to stock ZeRO-1's, DPU's and ACCO-without-estimate's),
  the bf16 weights within 1e-2 of it
- precision.fp16: DeepSpeed ACCO in fp16 with DeepSpeed's dynamic loss scaler from a scale that
  overflows: steps skipped, scales as DeepSpeed's scaler moves them, nearest to ACCO's reference
  with the same skips, within 5e-3 (tests/reference.py: check_real_fp16)
- fsdp.fp32: AccoFSDP (ds_acco's FSDP2 adapter) ACCO and DPU, fp32 AdamW with clipping and an LR
  schedule: within 1e-5 of the float64 reference
- fsdp.bf16: AccoFSDP with bf16 compute: the committed fp32 shards nearest to ACCO's reference,
  the bf16 weights within 3e-2 of it
- fsdp.fp16: AccoFSDP with fp16 compute and DeepSpeed's loss scaler: as precision.fp16
- fsdp.sharded: AccoFSDP(sharded_params=True) -- parameters sharded between uses, FSDP's own
  all-gathers (its streams, from the compute thread, on the mesh's communicator) beside the lane's
  rounds (another communicator, another thread) -- ACCO and DPU, fp32 AdamW with clipping and an LR
  schedule: within 1e-5 of the float64 reference
- tp.reference: DeepSpeed ACCO with a Megatron-style ``mpu`` (tests/deepspeed/tp_workers.py's TPNet, its
  tensor-parallel all-reduces on the model's communicator from the compute thread, the lane's rounds
  and the gradient norm's model-parallel sum on the lane's) at tensor-parallel size 1: one GPU
  cannot host two NCCL ranks, so this checks the CUDA path of the mpu code, not a cross-rank order.
  SGD and AdamW with clipping: within 1e-5 of the float64 reference
- memory.bound: a ~86M-parameter GPT in bf16, stock ZeRO-1 then ACCO then DPU in one process:
  each variant's peak torch.cuda.max_memory_allocated above its start <= stock's + 1.25 x the
  communication buffer's bytes (stock's buckets at HF Trainer's "auto" size, n_embd^2)
- runtime.total: the whole run, imports included, under 8 minutes (on a device)
- <part>.ran (protocol, trace, precision, fsdp, memory): the part ran to its end without raising
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable, Collection, Dict, List, Optional, Sequence

STARTED = time.monotonic()  # runtime.total counts from here: the imports below included

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The checkout, the suite's harness and the workers it reuses (beside their tests, as pytest.ini lists them).
for _path in (*(os.path.join(ROOT, "tests", area) for area in ("comm", "deepspeed", "fsdp")), os.path.join(ROOT, "tests"),
              ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

PARTS = ("protocol", "trace", "precision", "fsdp", "memory", "tp")
DEVICE_ONLY = ("trace", "memory")
MUTATIONS = ("no-ready-wait", "no-done-wait")
CHECKS = (
    "protocol.races", "protocol.compute_syncs", "protocol.lane_reads", "protocol.widened", "protocol.reference",
    "protocol.catches_no_ready_wait", "protocol.catches_no_done_wait",
    "trace.threads", "trace.side_stream", "trace.overlap", "trace.compute_syncs",
    "precision.fp32", "precision.bf16", "precision.fp16", "fsdp.fp32", "fsdp.bf16", "fsdp.fp16", "fsdp.sharded",
    "tp.reference",
    "memory.bound", "runtime.total") + tuple(f"{part}.ran" for part in PARTS)
TIME_LIMIT_S = 480.0
EXACT = 1e-5  # fp32 against the float64 reference (tests/deepspeed/test_reference.py's bound)
MICRO_BATCH = "gpu_check::micro_batch"  # the profiler label around every traced micro-batch
MODEL = "gpu_check::model_forward"  # around the model's own forward: its host syncs are the model's


class Checks:
    """The run's named assertions: each records what it measured and whether it held; a failure
    is collected, not raised, so one run reports every check."""

    def __init__(self):
        self.results: Dict[str, dict] = {}

    def expect(self, name: str, ok: bool, measured, why: str = "") -> bool:
        if name not in CHECKS:
            raise KeyError(f"{name!r} is not in CHECKS (list it there and in the docstring)")
        self.results[name] = {"ok": bool(ok), "measured": measured, **({} if ok else {"why": why})}
        print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f": {why}"),
              file=sys.stdout if ok else sys.stderr, flush=True)
        return bool(ok)

    def holds(self, name: str, assertion: Callable[[], object]) -> bool:
        """``assertion()`` raises AssertionError when the check fails (tests/reference.py's helpers)."""
        try:
            measured = assertion()
        except AssertionError as exc:
            return self.expect(name, False, None, str(exc))
        return self.expect(name, True, measured)

    def failed(self) -> List[str]:
        return [name for name, r in self.results.items() if not r["ok"]]


def rel_error(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    from reference import rel_distance
    return rel_distance({n: t.cpu() for n, t in got.items()}, want)


# -- 1. the stream protocol, recorded on the device --------------------------------------------
PROTOCOL_CASES = {"acco": {"mode": "acco", "clip": 0.05}, "dpu": {"mode": "dpu"}}
PROTOCOL_GAS, PROTOCOL_STEPS = 4, 4
PACK_SPIN, ROUND_SPIN = "pack spin", "round spin"  # marks in the recording's log where a spin was queued


def sleep_cycles_per_ms() -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU (timed once, here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm-up: the first launch pays for loading the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def device_sleep(ms: float, cycles_per_ms: float) -> Callable[[], None]:
    """A function that queues ``ms`` of spinning on the calling thread's current stream."""
    cycles = int(ms * cycles_per_ms)
    return lambda: torch.cuda._sleep(cycles)


def widen_race_windows(engine, compute_sleep: Callable[[], None], round_sleep: Callable[[], None]) -> None:
    """Make each of the lane's waits matter for the numbers. The compute stream spins right before
    it packs G into B: a round that does not wait for the pack reads the previous round's B. Each
    round spins on its side stream after its host read, before its optimizer step: compute that does
    not wait for the round reads B before the round has written it."""
    def delayed(step, sleep):
        def run(*args, **kwargs):
            sleep()  # on the calling thread's current stream
            return step(*args, **kwargs)
        return run
    for group in engine.optimizer.schedule.groups:
        group.pack_grads = delayed(group.pack_grads, compute_sleep)
    shard_optimizer = engine.optimizer.driver.shard_optimizer
    for name in ("commit", "estimate_into"):
        setattr(shard_optimizer, name, delayed(getattr(shard_optimizer, name), round_sleep))


def _marked(acc, what: str, sleep: Callable[[], None]) -> Callable[[], None]:
    def run():
        acc.mark(what)
        sleep()
    return run


def widening(log, lane_thread: str = "acco-comm") -> dict:
    """Where a recorded run's spins sat (:func:`widen_race_windows`): how many packs and rounds
    spun, and how many host reads a round made after its spin -- a read there waits for the spin,
    so the round would resolve only once its writes are near, and the window would close again."""
    out = {"pack_spins": 0, "round_spins": 0, "reads_after_round_spin": 0}
    spun = False
    for e in log:
        if e.kind == "mark" and e.what == PACK_SPIN:
            out["pack_spins"] += 1
        elif e.thread != lane_thread:
            continue
        elif e.kind == "mark" and e.what == ROUND_SPIN:
            out["round_spins"] += 1
            spun = True
        elif e.kind == "read":
            out["reads_after_round_spin"] += spun
        elif e.kind == "record":  # the round's done event: its end
            spun = False
    return out


def record(device: torch.device, case: dict, args) -> dict:
    """One recorded DeepSpeed run (tests/comm/stream_workers.py) and its distance to the reference."""
    import stream_workers
    from ds_acco.testing.recording import RecordingAccelerator
    from fixtures import TinyNet, batch, make_optimizer
    from reference import reference_run
    engines = []
    if device.type == "cuda":
        from deepspeed.accelerator import get_accelerator
        acc = RecordingAccelerator(inner=get_accelerator())
        per_ms = sleep_cycles_per_ms()
        spin = lambda ms: device_sleep(ms, per_ms)  # noqa: E731
    else:
        acc = RecordingAccelerator()  # the CPU as an asynchronous device: kernels run at once
        spin = lambda ms: lambda: None  # noqa: E731 -- nothing to widen; the marks still show where

    def setup(engine):
        engines.append(engine)
        widen_race_windows(engine, _marked(acc, PACK_SPIN, spin(args.pack_sleep_ms)),
                           _marked(acc, ROUND_SPIN, spin(args.round_sleep_ms)))
    case = dict(case, gas=PROTOCOL_GAS, steps=PROTOCOL_STEPS)
    try:
        out = stream_workers.train_recorded(acc, case, setup=setup)
    except Exception as exc:  # a mutated run may fail in its rounds; the caller decides
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.destroy()
        return {"raised": f"{type(exc).__name__}: {exc}"}
    want = reference_run(TinyNet(seed=0), batch, world=1, gas=PROTOCOL_GAS, steps=PROTOCOL_STEPS, mode=case["mode"],
                         make_optimizer=make_optimizer("adamw"), clip=case.get("clip", 0.0))
    out["reference_rel_error"] = rel_error(out.pop("final"), want)
    out["widening"] = widening(acc.log)
    out["steady_compute_syncs"] = [s for s in out["compute_syncs"][2 * PROTOCOL_GAS:] if s]
    return out


def check_protocol(checks: Checks, device: torch.device, args) -> dict:
    runs = {name: record(device, dict(case, mutate=args.mutate), args) for name, case in PROTOCOL_CASES.items()}
    raised = {n: r["raised"] for n, r in runs.items() if "raised" in r}
    if raised:
        checks.expect("protocol.races", False, raised, f"the recorded runs raised: {raised}")
        return {"runs": runs}
    checks.expect("protocol.races", all(not r["races"] for r in runs.values()),
                  {n: r["races"][:5] for n, r in runs.items()},
                  "unordered cross-stream accesses: " + "; ".join(f"{n}: {r['races'][:2]}" for n, r in runs.items()))
    checks.expect("protocol.compute_syncs", all(not r["steady_compute_syncs"] for r in runs.values()),
                  {n: r["steady_compute_syncs"] for n, r in runs.items()},
                  "host syncs on the compute side in steady state: "
                  + "; ".join(f"{n}: {r['steady_compute_syncs'][:3]}" for n, r in runs.items()))
    lane = {n: {"reads": len(r["lane_syncs"]), "rounds": r["rounds"]} for n, r in runs.items()}
    checks.expect("protocol.lane_reads",
                  all(r["rounds"] >= PROTOCOL_STEPS and len(r["lane_syncs"]) <= r["rounds"] for r in runs.values()),
                  lane, f"lane host reads vs rounds: {lane}")
    spins = {n: dict(r["widening"], rounds=r["rounds"]) for n, r in runs.items()}
    checks.expect("protocol.widened", all(w["pack_spins"] >= w["rounds"] and w["round_spins"] >= w["rounds"]
                                          and not w["reads_after_round_spin"] for w in spins.values()), spins,
                  f"every round must spin after its host read and every pack before it writes B: {spins}")
    errors = {n: r["reference_rel_error"] for n, r in runs.items()}
    checks.expect("protocol.reference", all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    if args.mutate is None:  # the checks above must catch each wait removed
        for how in MUTATIONS:
            run = record(device, dict(PROTOCOL_CASES["acco"], mutate=how), args)
            runs[f"acco {how}"] = run
            raced = "raised" in run or bool(run["races"])
            wrong = "raised" in run or run["reference_rel_error"] >= EXACT
            caught = raced and (wrong or device.type != "cuda")  # on CPU kernels run at once: no wrong numbers
            checks.expect(f"protocol.catches_{how.replace('-', '_')}", caught,
                          {"races": run.get("races", [])[:2], "raised": run.get("raised"),
                           "reference_rel_error": run.get("reference_rel_error")},
                          f"with {how} the run had races={raced} and wrong numbers={wrong}")
    return {"runs": runs}


# -- 2. the profiler trace -----------------------------------------------------------------------
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


def gpt_engine(variant: str, n_layer: int, n_embd: int, seq: int, micro_batch: int, gas: int):
    """A bf16 GPT under stock ZeRO-1 ('stock'), ACCO fixed ('fixed') or DPU ('dpu'); every variant
    the same model, data type, batch and optimizer."""
    import ds_acco
    from benchmarks.gpt import CausalLM, param_groups
    torch.manual_seed(0)
    model = CausalLM(seq, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64))
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}}}
    if variant == "stock":
        # DeepSpeed's default buckets (5e8 elements) would dwarf this model and flatter ACCO: HF
        # Trainer's "auto" size instead. ACCO replaces them (and warns when they are set).
        cfg["zero_optimization"].update(reduce_bucket_size=n_embd ** 2, allgather_bucket_size=n_embd ** 2)
    else:
        cfg["acco"] = {"enabled": True, "mode": {"fixed": "acco", "dpu": "dpu"}[variant]}
    engine, *_ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def gpt_data(engine, micro_batch: int, seq: int, count: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (micro_batch, seq + 1), generator=g).to(engine.device) for _ in range(count)]


def gpt_micro_batch(engine, rows: torch.Tensor, before_forward: Optional[Callable[[], None]] = None) -> None:
    if before_forward is not None:
        before_forward()
    loss = engine(rows)
    engine.backward(loss)
    engine.step()


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


# -- 3. precision and the FSDP2 variant, against the float64 reference ---------------------------
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 1,
        "min_loss_scale": 1}  # tests/deepspeed/test_loss_scaling.py's: overflows first
FP32_CASE = {"optimizer": "adamw", "schedule": "inv", "clip": 0.05, "steps": 4, "gas": 4}
BF16_CASE = {"optimizer": "adamw-fast", "steps": 6, "gas": 4}  # adamw-fast: the schedules end far apart
FP16_CASE = {"optimizer": "sgd", "steps": 10, "gas": 4, "acco": {"enabled": True, "mode": "acco"}}


def _references(case: dict, mode: Optional[str] = None):
    """Case ``case``'s float64 θ_T of ``mode``, or of every schedule (mode None)."""
    from fixtures import TinyNet, batch, make_optimizer, make_scheduler
    from reference import mode_references, reference_run
    kw = dict(world=1, gas=case["gas"], steps=case["steps"], make_optimizer=make_optimizer(case["optimizer"]),
              make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))
    if mode is None:
        return mode_references(TinyNet(seed=0), batch, **kw)
    return reference_run(TinyNet(seed=0), batch, mode=mode, **kw)


def _check_fp32(checks: Checks, name: str, train: Callable[[dict], dict], **case) -> dict:
    errors = {mode: rel_error(train(dict(FP32_CASE, acco={"enabled": True, "mode": mode}, **case))["final"],
                              _references(FP32_CASE, mode)) for mode in ("acco", "dpu")}
    checks.expect(name, all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    return errors


def _check_low_precision(checks: Checks, name: str, run: dict, case: dict, tol: float) -> None:
    from reference import nearest_own_reference

    def nearest_and_close():
        refs = _references(case)
        distances = nearest_own_reference(run["final_fp32"], refs, "acco", label=name)
        err = rel_error(run["final"], refs["acco"])
        assert err < tol, f"{name}: weights {err:.2e} from ACCO's reference (at most {tol:g})"
        return {"distances": distances, "rel_error": err}
    checks.holds(name, nearest_and_close)


def _check_fp16(checks: Checks, name: str, run: dict) -> None:
    from fixtures import TinyNet, batch, make_optimizer
    from reference import check_real_fp16
    checks.holds(name, lambda: check_real_fp16(run, TinyNet(seed=0), batch, world=1, gas=FP16_CASE["gas"],
                                               steps=FP16_CASE["steps"], fp16=FP16,
                                               make_optimizer=make_optimizer("sgd"), label=name))


def check_precision(checks: Checks, device: torch.device, args) -> dict:
    """DeepSpeed's engine: fp32 ACCO and DPU, bf16 and fp16 ACCO (tests/deepspeed/workers.py's runs)."""
    import workers
    fp32 = _check_fp32(checks, "precision.fp32", workers.train)
    bf16_case = dict(BF16_CASE, acco={"enabled": True, "mode": "acco"},
                     extra={"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    bf16 = workers.train(bf16_case)
    _check_low_precision(checks, "precision.bf16", bf16, bf16_case, 1e-2)
    fp16 = workers.train(dict(FP16_CASE, extra={"fp16": FP16}, fp16_on_cpu=device.type == "cpu"))
    _check_fp16(checks, "precision.fp16", fp16)
    return {"fp32_rel_error": fp32, "bf16_param_dtype": bf16["param_dtype"], "fp16_param_dtype": fp16["param_dtype"],
            "fp16_skipped_steps": fp16["skipped_steps"]}


def check_fsdp(checks: Checks, device: torch.device, args) -> dict:
    """ds_acco's FSDP2 adapter on a one-rank mesh of the device (tests/fsdp/fsdp_workers.py's runs)."""
    import fsdp_workers
    fp32 = _check_fp32(checks, "fsdp.fp32", fsdp_workers.run)
    bf16_case = dict(BF16_CASE, mp=True, acco={"enabled": True, "mode": "acco"})
    bf16 = fsdp_workers.run(bf16_case)
    _check_low_precision(checks, "fsdp.bf16", bf16, bf16_case, 3e-2)
    fp16 = fsdp_workers.fp16_run(dict(FP16_CASE, extra={"fp16": FP16}, mp="fp16"))
    _check_fp16(checks, "fsdp.fp16", fp16)
    sharded = _check_fp32(checks, "fsdp.sharded", fsdp_workers.run, sharded=True)
    return {"fp32_rel_error": fp32, "sharded_fp32_rel_error": sharded, "fp16_param_dtype": fp16["param_dtype"],
            "fp16_skipped_steps": fp16["skipped_steps"]}


def check_tp(checks: Checks, device: torch.device, args) -> dict:
    """Tensor parallelism through an ``mpu`` on a one-rank tensor-parallel group (world size 1)."""
    import tp_workers
    from fixtures import batch
    from reference import reference_run
    errors = {}
    for opt in ("sgd", "adamw"):
        case = {"acco": {"enabled": True, "mode": "acco"}, "optimizer": opt, "clip": 0.05, "gas": 4, "steps": 3,
                "tp": 1, "dp": 1}
        got = tp_workers.train_tp(case)["final"]
        want = reference_run(tp_workers.FullNet(seed=0), batch, world=1, gas=4, steps=3, mode="acco",
                             make_optimizer=tp_workers.make_optimizer(opt), clip=0.05)
        errors[opt] = rel_error(tp_workers.gather_full(got, [got]), want)
    checks.expect("tp.reference", all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    return {"rel_error": errors}


# -- 4. peak memory and step time ------------------------------------------------------------------
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


# -- the run -----------------------------------------------------------------------------------------
PART_CHECKS = {"protocol": check_protocol, "trace": check_trace, "precision": check_precision, "fsdp": check_fsdp,
               "memory": check_memory, "tp": check_tp}


def run_parts(parts: Sequence[str], device: torch.device, args, checks: Checks, out: dict,
              save: Callable[[], None] = lambda: None) -> None:
    """Run ``parts`` in order into ``out`` (their measurements) and ``checks``; ``save()`` after each."""
    for part in parts:
        if part in DEVICE_ONLY and device.type != "cuda":
            out[part] = "skipped: needs a CUDA device (its analysis is tested on CPU)"
            continue
        t0 = time.perf_counter()
        try:
            out[part] = PART_CHECKS[part](checks, device, args)
            checks.expect(f"{part}.ran", True, None)
        except Exception as exc:  # noqa: BLE001 -- reported as this part's failure; the other parts still run
            out[part] = {"error": traceback.format_exc()}
            checks.expect(f"{part}.ran", False, None, f"{type(exc).__name__}: {exc}")
        out[f"{part}_s"] = time.perf_counter() - t0
        save()


def protocol_on_cpu(mutations: Sequence[Optional[str]] = (None,)) -> List[Dict[str, dict]]:
    """The ``--cpu`` dry run's protocol part, once per mutation (None: as it is), inside a rank of
    tests/dist.py's ``run_ranks`` (world size 1): each run's check results."""
    out = []
    for mutate in mutations:
        checks = Checks()
        args = parse_args(["--cpu"] + (["--mutate", mutate] if mutate else []))
        run_parts(["protocol"], torch.device("cpu"), args, checks, {})
        out.append(checks.results)
    return out


def init_process_group(cpu: bool, store_dir: str) -> torch.device:
    """World size 1 through a FileStore in ``store_dir``: no port to choose, so none to lose to
    another process."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    store = os.path.join(store_dir, "store")
    backend = "gloo" if cpu else "nccl"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    import deepspeed
    deepspeed.init_distributed(dist_backend=backend)  # DeepSpeed's comm (its loss scaler asks it for ranks)
    return device


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU / gloo with a pretend device")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--mutate", choices=MUTATIONS, default=None,
                    help="remove one wait of the lane's stream protocol in the protocol part (it must then fail)")
    ap.add_argument("--pack-sleep-ms", type=float, default=20.0,
                    help="_sleep on the compute stream before each pack of G into B, protocol part")
    ap.add_argument("--round-sleep-ms", type=float, default=100.0,
                    help="_sleep on the side stream before each round's optimizer step, protocol part")
    ap.add_argument("--trace-sleep-ms", type=float, default=20.0, help="_sleep per micro-batch, trace part")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here; fix: run on the GPU machine, or pass --cpu for the dry run")
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts {','.join(unknown)}: unknown; use some of {','.join(PARTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    store_dir = tempfile.mkdtemp(prefix="gpu_check_")
    device = init_process_group(args.cpu, store_dir)
    import deepspeed
    out = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "deepspeed": deepspeed.__version__, "argv": sys.argv[1:],
           "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    checks = Checks()
    path = os.path.join(args.out, "gpu_check.json")

    def save():
        out.update(checks=checks.results, failed=checks.failed(), wall_s=time.monotonic() - STARTED)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)

    run_parts(args.parts, device, args, checks, out, save)
    if device.type == "cuda":
        wall = time.monotonic() - STARTED
        checks.expect("runtime.total", wall < TIME_LIMIT_S, wall, f"{wall:.0f} s, limit {TIME_LIMIT_S:.0f} s")
    save()
    dist.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)
    failed = checks.failed()
    print(json.dumps({"wall_s": round(out["wall_s"], 1), "checks": len(checks.results), "failed": failed}), flush=True)
    if failed:
        print(f"gpu_check: FAILED {', '.join(failed)} (details: {path})", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
