"""The GPU check's named assertions (Checks, the list CHECKS) and what its parts share: the
distance to the float64 reference and a spin queued on the device's current stream."""
from __future__ import annotations

import sys
from typing import Callable, Dict, List

import torch

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
EXACT = 1e-5  # fp32 against the float64 reference (tests/deepspeed/test_reference.py's bound)


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
