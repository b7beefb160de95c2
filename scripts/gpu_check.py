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
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

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

# The parts, one module each (scripts/gpu_check_parts/), imported once the checkout is on sys.path.
from scripts.gpu_check_parts.checks import CHECKS, DEVICE_ONLY, MUTATIONS, PARTS, Checks  # noqa: E402,F401
from scripts.gpu_check_parts.memory import check_memory  # noqa: E402
from scripts.gpu_check_parts.precision import check_fsdp, check_precision, check_tp  # noqa: E402
from scripts.gpu_check_parts.protocol import check_protocol  # noqa: E402
from scripts.gpu_check_parts.trace import check_trace  # noqa: E402

TIME_LIMIT_S = 480.0


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
