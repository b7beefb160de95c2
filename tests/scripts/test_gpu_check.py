"""scripts/gpu_check.py and its parts (scripts/gpu_check_parts/) without a GPU: their pure analyses
(a profiler trace's overlap, the memory bound, where the race windows were widened), the list of
checks in the script's docstring, and its CPU dry run, whose protocol part must pass as it is and
fail under each wait of the lane removed."""
import json
import os
import re
import subprocess
import sys

import pytest

from dist import run_ranks
from ds_acco.testing.recording import Entry
from scripts import gpu_check
from scripts.gpu_check_parts import memory as memory_part, protocol as protocol_part, trace as trace_part
from timeouts import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANE, MAIN, AUTOGRAD = 4242, 100, 300  # thread ids in the synthetic traces
COMPUTE_STREAM, SIDE_STREAM, NCCL_STREAM = 7, 20, 21


# -- the list of checks -------------------------------------------------------------------------
def test_the_docstring_lists_every_check_the_script_can_make():
    listed = set(re.findall(r"^- ([a-z_0-9<>]+\.[a-z_0-9]+)(?: \([^)]*\))?:", gpu_check.__doc__, re.M))
    ran = {name for name in listed if name.startswith("<part>.")}
    assert ran == {"<part>.ran"}
    names = (listed - ran) | {f"{part}.ran" for part in gpu_check.PARTS}
    assert names == set(gpu_check.CHECKS)


def test_an_unlisted_check_is_refused():
    with pytest.raises(KeyError, match="not in CHECKS"):
        gpu_check.Checks().expect("protocol.typo", True, None)


# -- the trace ----------------------------------------------------------------------------------
class Trace:
    """A chrome trace as torch.profiler writes it: device ops (pid 0, their stream as tid) linked by
    correlation id to the runtime call of the thread that launched them."""

    def __init__(self):
        self.events = []
        self._corr = 0

    def op(self, tid, stream, ts, dur, name="kernel_fn", cat="kernel"):
        self._corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
                            "ts": ts - 5, "dur": 4, "args": {"correlation": self._corr}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                            "args": {"stream": stream, "correlation": self._corr, "device": 0}})
        return self

    def call(self, tid, name, ts):
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts,
                            "dur": 3, "args": {"correlation": 10_000 + len(self.events)}})
        return self

    def micro_batch(self, ts, dur):
        self.events.append({"ph": "X", "cat": "user_annotation", "name": trace_part.MICRO_BATCH, "pid": 1,
                            "tid": MAIN, "ts": ts, "dur": dur, "args": {}})
        # torch.profiler also draws the label on the device's timeline: not a host span
        self.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": trace_part.MICRO_BATCH, "pid": 0,
                            "tid": COMPUTE_STREAM, "ts": ts + 2000, "dur": dur, "args": {}})
        return self


def overlapped_trace():
    """Two micro-batches of compute (a long spin from the main thread, backward from autograd's
    thread), a round's kernels and NCCL's on their own streams while the spin runs."""
    t = Trace().micro_batch(0, 1000).micro_batch(1000, 1000)
    t.op(MAIN, COMPUTE_STREAM, 100, 900, "spin_kernel").op(AUTOGRAD, COMPUTE_STREAM, 1000, 300, "gemm")
    t.op(MAIN, COMPUTE_STREAM, 1300, 600, "spin_kernel")
    t.op(LANE, SIDE_STREAM, 200, 50, "multi_tensor_apply_kernel").op(LANE, SIDE_STREAM, 400, 80, cat="gpu_memcpy",
                                                                    name="Memcpy DtoD")
    t.op(LANE, NCCL_STREAM, 1400, 100, "ncclDevKernel_AllGather_RING_LL")
    t.call(MAIN, "cudaStreamSynchronize", 2500)  # after the last micro-batch: the end of profiling
    return t


def verdict(trace, lane_tids=(LANE,)):
    checks = gpu_check.Checks()
    analysis = trace_part.analyse_trace({"traceEvents": trace.events}, lane_tids)
    trace_part.check_trace_analysis(checks, analysis)
    return {name: r["ok"] for name, r in checks.results.items()}, analysis


def test_rounds_on_their_own_streams_overlapping_compute_pass():
    ok, analysis = verdict(overlapped_trace())
    assert ok == {"trace.threads": True, "trace.side_stream": True, "trace.overlap": True, "trace.compute_syncs": True}
    assert analysis["round_ops"] == 3 and analysis["nccl_kernels"] == 1 and analysis["compute_ops"] == 3
    assert analysis["round_overlap"] == 1.0 and analysis["nccl_overlap"] == 1.0
    assert analysis["compute_streams"] == [COMPUTE_STREAM]


def test_rounds_serialised_with_compute_fail_the_overlap():
    t = Trace().micro_batch(0, 2000)
    t.op(MAIN, COMPUTE_STREAM, 0, 500).op(MAIN, COMPUTE_STREAM, 1000, 500)
    t.op(LANE, SIDE_STREAM, 500, 200).op(LANE, NCCL_STREAM, 700, 300, "ncclDevKernel_ReduceScatter")
    ok, analysis = verdict(t)
    assert analysis["round_overlap"] == 0.0
    assert ok == {"trace.threads": True, "trace.side_stream": True, "trace.overlap": False, "trace.compute_syncs": True}


def test_a_round_mostly_outside_compute_fails_and_an_unoverlapped_nccl_kernel_fails():
    t = Trace().micro_batch(0, 2000).op(MAIN, COMPUTE_STREAM, 0, 100)
    t.op(LANE, SIDE_STREAM, 50, 150)  # a third of it overlaps
    assert verdict(t)[0]["trace.overlap"] is False
    t = overlapped_trace().op(LANE, NCCL_STREAM, 3000, 1000, "ncclDevKernel_AllReduce")  # after compute ended
    ok, analysis = verdict(t)
    assert analysis["round_overlap"] < trace_part.OVERLAP_MIN and ok["trace.overlap"] is False


def test_a_round_op_on_the_compute_stream_fails():
    t = overlapped_trace().op(LANE, COMPUTE_STREAM, 500, 10)
    ok, analysis = verdict(t)
    assert ok["trace.side_stream"] is False and analysis["rounds_on_compute_streams"] == ["kernel_fn"]


def test_a_host_sync_of_the_compute_side_inside_a_micro_batch_fails():
    assert verdict(overlapped_trace().call(AUTOGRAD, "cudaStreamSynchronize", 1500))[0]["trace.compute_syncs"] is False
    assert verdict(overlapped_trace().call(MAIN, "cudaDeviceSynchronize", 50))[0]["trace.compute_syncs"] is False
    # the lane's own read of the host is not the compute side's
    assert verdict(overlapped_trace().call(LANE, "cudaStreamSynchronize", 1500))[0]["trace.compute_syncs"] is True


def test_a_host_sync_inside_the_models_own_forward_is_the_models():
    # transformers' GPT-2 reads a mask value on the host in its forward (seen on an H200, stock too)
    t = overlapped_trace()
    t.events.append({"ph": "X", "cat": "user_annotation", "name": trace_part.MODEL, "pid": 1, "tid": MAIN,
                     "ts": 20, "dur": 60, "args": {}})
    ok, analysis = verdict(t.call(MAIN, "cudaStreamSynchronize", 50))
    assert ok["trace.compute_syncs"] is True and analysis["model_syncs"] == ["cudaStreamSynchronize"]
    ok, analysis = verdict(t.call(MAIN, "cudaDeviceSynchronize", 90))  # after the forward: the engine's
    assert ok["trace.compute_syncs"] is False and analysis["compute_syncs_in_micro_batches"] == ["cudaDeviceSynchronize"]


def test_a_trace_without_the_lanes_launches_fails_every_check():
    ok, analysis = verdict(overlapped_trace(), lane_tids=(9999,))  # e.g. the thread id did not match
    assert analysis["round_ops"] == 0 and not any(ok.values())


def test_trace_ids_of_a_thread_cover_kinetos_and_cuptis():
    class Thread:
        native_id, ident = 123, 0x7F00_8000_0001
    signed = 0x8000_0001 - (1 << 32)
    assert trace_part.trace_tids(Thread) == {123, 0x8000_0001, signed, -signed}


# -- the memory bound ---------------------------------------------------------------------------
def test_memory_within_stock_plus_a_quarter_more_than_one_buffer_passes():
    v = memory_part.memory_verdict({"stock": [1000, 1010], "fixed": [2200], "dpu": [2250]}, 1000)
    assert v["ok"] and v["bound"] == 2250
    assert v["variants"]["fixed"]["over_stock_in_buffers"] == pytest.approx(1.2)


def test_memory_above_the_bound_fails():
    v = memory_part.memory_verdict({"stock": [1000], "fixed": [2251], "dpu": [1500]}, 1000)
    assert not v["ok"] and not v["variants"]["fixed"]["ok"] and v["variants"]["dpu"]["ok"]


def test_memory_bound_is_strict_on_both_sides():
    # the smaller stock run is the baseline, the larger ACCO run is judged
    assert not memory_part.memory_verdict({"stock": [1000, 1100], "fixed": [2300]}, 1000)["ok"]
    assert not memory_part.memory_verdict({"stock": [1000], "fixed": [2000, 2300]}, 1000)["ok"]


@pytest.mark.parametrize("peaks,buffer", [({"stock": [1], "fixed": [2]}, 0), ({"fixed": [2]}, 1),
                                          ({"stock": [1]}, 1), ({"stock": [1], "fixed": []}, 1)])
def test_memory_verdict_refuses_what_it_cannot_judge(peaks, buffer):
    with pytest.raises(ValueError):
        memory_part.memory_verdict(peaks, buffer)


# -- where the race windows are widened -----------------------------------------------------------
def lane(kind, what=""):
    return Entry(kind, "acco-comm", what=what)


def test_widening_counts_spins_and_the_reads_that_would_close_a_window():
    log = [Entry("mark", "MainThread", what=protocol_part.PACK_SPIN), Entry("op", "MainThread", what="aten.copy_"),
           lane("wait"), lane("read", "tolist"), lane("mark", protocol_part.ROUND_SPIN), lane("op"), lane("record"),
           Entry("mark", "MainThread", what=protocol_part.PACK_SPIN),
           lane("wait"), lane("mark", protocol_part.ROUND_SPIN), lane("read", "tolist"), lane("record"),
           lane("wait"), lane("read", "tolist"), lane("mark", protocol_part.ROUND_SPIN), lane("record"),
           Entry("read", "MainThread", what="item")]
    assert protocol_part.widening(log) == {"pack_spins": 2, "round_spins": 3, "reads_after_round_spin": 1}


# -- the CPU dry run --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dry_runs():
    mutations = [None, *gpu_check.MUTATIONS]
    results, = run_ranks(gpu_check.protocol_on_cpu, world=1, timeout=scaled(120), mutations=mutations)
    return dict(zip(mutations, results))


def test_the_dry_runs_protocol_part_passes(dry_runs):
    results = dry_runs[None]
    assert {name for name, r in results.items() if not r["ok"]} == set()
    assert set(results) == {name for name in gpu_check.CHECKS if name.startswith("protocol.")}
    spins = results["protocol.widened"]["measured"]["acco"]
    assert spins["round_spins"] == spins["rounds"] == 2 * protocol_part.PROTOCOL_STEPS


@pytest.mark.parametrize("mutation", gpu_check.MUTATIONS)
def test_the_dry_runs_protocol_part_fails_without_a_wait(dry_runs, mutation):
    results = dry_runs[mutation]
    assert not results["protocol.races"]["ok"], results["protocol.races"]
    assert "are not ordered" in results["protocol.races"]["why"]
    # the pretend device runs kernels at once: the numbers stay right, the recording catches it
    assert results["protocol.reference"]["ok"]


@pytest.mark.slow  # the gpu_check script in fresh interpreters (~5 s)
def test_the_command_line_fails_naming_the_check_and_writes_what_it_measured(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--cpu", "--parts", "protocol",
           "--mutate", "no-done-wait", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL protocol.races" in proc.stderr and "gpu_check: FAILED protocol.races" in proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["failed"] == ["protocol.races"]
    assert report["checks"]["protocol.reference"]["ok"] and report["protocol"]["runs"]["acco"]["rounds"] > 0
