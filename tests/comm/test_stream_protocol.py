"""The lane's stream protocol on an asynchronous device, checked on CPU with the recording
accelerator (ds_acco/testing/recording.py): every cross-stream access ordered, waits on the device,
streams on the lane's device, host synchronisations counted."""
import gc
import threading
import weakref

import pytest
import torch

from ds_acco.comm.lane import CommLane, CommRoundError
from ds_acco.testing.recording import RecordingAccelerator
from dist import run_ranks
import stream_workers

CUDA1 = torch.device("cuda", 1)  # a device descriptor only: kernels run on CPU


def _recorder(**kw):
    return RecordingAccelerator(tensor_device=1, **kw)  # the CPU tensors stand for cuda:1's


def _lane(acc, **kw):
    return CommLane(timeout_s=30, accelerator=acc, device=CUDA1, **kw)


def _double(b, c):
    c.copy_(b).mul_(2)


def _round_trip(acc, lane, b, c):
    """compute: B ← G (pack); round: C ← 2·B (reduce/gather stand-in); compute: live ← C (unpack)."""
    with acc.recording():
        b.copy_(torch.arange(8.0))
        handle = lane.submit("round", lambda: _double(b, c))
        lane.wait(handle)
        live = c.clone()
    return live


@pytest.mark.parametrize("synchronous", [False, True])
def test_a_round_is_ordered_after_the_pack_and_before_the_unpack_on_the_device(synchronous):
    acc = _recorder()
    acc.set_device(0)  # the compute thread's current device is not the lane's
    lane = _lane(acc, synchronous=synchronous)
    b, c = torch.zeros(8), torch.zeros(8)
    live = _round_trip(acc, lane, b, c)
    lane.close()
    assert torch.equal(live, torch.arange(8.0) * 2)
    assert acc.races() == []
    # the compute thread waited on the device, never on the host
    assert acc.host_syncs(thread=threading.current_thread().name) == []
    waits = [e for e in acc.log if e.kind == "wait"]
    assert len(waits) == 2  # the side stream on ready, the compute stream on done


@pytest.mark.parametrize("broken", ["ready", "done"])
def test_the_race_check_catches_a_missing_wait(broken):
    # The checker itself: a lane whose side stream (ready) or compute stream (done) skips its wait.
    acc = _recorder()
    lane = _lane(acc)
    if broken == "ready":
        stream_workers._mutate(lane, "no-ready-wait")
    else:
        stream_workers._mutate(lane, "no-done-wait")
    _round_trip(acc, lane, torch.zeros(8), torch.zeros(8))
    lane.close()
    races = acc.races()
    assert races, "a missing wait must show as a race"
    assert ("aten.copy_" in races[0]) or ("aten.clone" in races[0]), races


def test_streams_and_events_live_on_the_lanes_device():
    acc = _recorder()
    acc.set_device(0)
    lane = _lane(acc)
    _round_trip(acc, lane, torch.zeros(8), torch.zeros(8))
    lane.close()
    devices = {e.device for e in acc.log if e.kind in ("stream", "record", "wait")}
    assert devices == {1}, acc.log


def test_what_the_round_reads_stays_alive_until_the_compute_stream_waited():
    acc = _recorder()
    lane = _lane(acc)
    started, release = threading.Event(), threading.Event()
    box = [torch.full((4,), 3.0)]  # made on the compute stream; the round is its only reader
    x = box[0]
    weakref.finalize(x, acc.mark, "x freed")
    out = torch.zeros(4)

    def fn():
        y = box.pop()
        out.copy_(y)
        del y
        started.set()
        release.wait(30)

    with acc.recording():
        handle = lane.submit("round", fn, keep=[x])
        del x
        assert started.wait(30)
        release.set()
        gc.collect()
        lane.wait(handle)
        acc.mark("waited")
    gc.collect()
    lane.close()
    order = [e.what for e in acc.log if e.kind == "mark"]
    wait_at = max(i for i, e in enumerate(acc.log) if e.kind == "wait" and e.thread == threading.current_thread().name)
    freed_at = next(i for i, e in enumerate(acc.log) if e.kind == "mark" and e.what == "x freed")
    assert freed_at > wait_at, order


def test_a_failed_round_synchronises_its_stream_before_the_error_is_handed_on():
    acc = _recorder()
    lane = _lane(acc)
    seen = []
    sync = acc._sync

    def spy(**kw):
        seen.append(handle.future.done())
        sync(**kw)
    acc._sync = spy

    def fn():
        torch.ones(3).mul_(2)
        raise RuntimeError("NCCL error: remote process exited")
    handle = lane.submit("commit 3", fn)
    with pytest.raises(CommRoundError, match="remote process"):
        lane.wait(handle)
    lane.close()
    assert seen == [False]  # synchronised once, before the future resolved


def test_on_a_real_device_host_tensors_are_neither_raced_nor_read():
    # With a real accelerator inside (scripts/gpu_check.py), CPU tensors are host memory: their ops
    # run at once on their thread (no stream to race on) and reading them waits for no kernel.
    class Host:  # what the recording asks of the real accelerator here
        def current_stream(self, index=None):
            return None
    real, pretend = RecordingAccelerator(inner=Host()), RecordingAccelerator()
    for acc in (real, pretend):
        with acc.recording():
            torch.ones(3).add_(1).sum().item()
    assert [e.what for e in real.log if e.kind == "read"] == []
    assert all(e.accesses == () for e in real.log if e.kind == "op")
    assert [e.what for e in pretend.log if e.kind == "read"] == ["item"]
    assert all(e.accesses for e in pretend.log if e.kind == "op")


def test_done_is_a_query_of_the_device():
    acc = _recorder()
    lane = _lane(acc)
    handle = lane.submit("round", lambda: None)
    handle.future.result(30)
    assert handle.done_event is not None
    handle.done_event.query = lambda: False  # kernels still running
    assert not handle.done()
    lane.close()


# -- through the real DeepSpeed engine, 2 gloo ranks ----------------------------------------------
GAS, STEPS = 4, 5


@pytest.fixture(scope="module")
def recorded():
    cases = {"acco": {}, "dpu": {"mode": "dpu"}, "acco-sync": {"synchronous": True},
             "acco-clip": {"clip": 0.5}}
    out = {}
    for name, extra in cases.items():
        out[name] = run_ranks(stream_workers.record_deepspeed, case=dict(gas=GAS, steps=STEPS, **extra))
    return out


@pytest.mark.parametrize("name", ["acco", "dpu", "acco-sync", "acco-clip"])
def test_engine_rounds_have_no_unordered_access(recorded, name):
    for rank in recorded[name]:
        assert rank["races"] == [], rank["races"][:3]


@pytest.mark.parametrize("name", ["acco", "dpu", "acco-clip"])
def test_engine_compute_thread_never_syncs_in_steady_state(recorded, name):
    for rank in recorded[name]:
        steady = rank["compute_syncs"][2 * GAS:]  # after the bootstrap and the first swap
        assert all(s == [] for s in steady), steady


@pytest.mark.parametrize("name", ["acco", "dpu", "acco-clip"])
def test_engine_lane_reads_the_host_once_per_round(recorded, name):
    for rank in recorded[name]:
        assert rank["rounds"] >= STEPS
        assert len(rank["lane_syncs"]) <= rank["rounds"], " ".join(rank["lane_syncs"])


def test_recording_changes_nothing(recorded):
    a, s = recorded["acco"], recorded["acco-sync"]
    for ra, rs in zip(a, s):
        assert ra["losses"] == rs["losses"]
        for k in ra["final"]:
            assert torch.equal(ra["final"][k], rs["final"][k]), k


@pytest.fixture(scope="module")
def recorded_fsdp():
    return run_ranks(stream_workers.record_fsdp, case=dict(gas=GAS, steps=STEPS))


def test_fsdp2_rounds_are_ordered_and_the_compute_thread_never_syncs(recorded_fsdp):
    for rank in recorded_fsdp:
        assert rank["races"] == [], rank["races"][:3]
        assert all(s == [] for s in rank["compute_syncs"][2 * GAS:]), rank["compute_syncs"]
        assert rank["rounds"] >= STEPS and len(rank["lane_syncs"]) <= rank["rounds"], rank["lane_syncs"]


def test_keep_none_still_waits_on_the_device():
    acc = _recorder()
    lane = _lane(acc)
    b, c = torch.zeros(8), torch.zeros(8)
    with acc.recording():
        b.fill_(1.0)
        lane.wait(lane.submit("round", lambda: _double(b, c), keep=None))
        c.clone()
    lane.close()
    assert acc.races() == []
    assert len([e for e in acc.log if e.kind == "wait"]) == 2


def test_out_of_memory_on_the_lane_is_not_blamed_on_the_network():
    lane = _lane(_recorder())

    def fn():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        lane.wait(lane.submit("estimate 2", fn))
    lane.close()


def test_torchs_accelerator_api_is_what_the_adapter_calls():
    # TorchAccelerator (the FSDP2 adapter's streams) needs these; a torch release that renames one
    # fails here, not on a user's GPU.
    from ds_acco.comm.streams import TorchAccelerator
    for name in ("current_stream", "set_stream", "current_device_index", "set_device_index", "current_accelerator"):
        assert callable(getattr(torch.accelerator, name)), name
    for cls, methods in ((torch.Stream, ("wait_event", "synchronize")), (torch.Event, ("record", "query", "synchronize"))):
        for m in methods:
            assert callable(getattr(cls, m)), (cls, m)
    assert TorchAccelerator("cpu").is_synchronized_device()
    assert not TorchAccelerator("cuda").is_synchronized_device()


@pytest.mark.parametrize("waited", [False, True])
def test_the_race_check_catches_a_block_reused_before_the_reader_was_waited_for(waited):
    # A hand-made log (CPU's allocator reuses addresses by chance, a caching allocator by design):
    # compute allocates x, the side stream reads it, compute frees it and allocates at its address.
    acc = _recorder()
    side, compute = acc.Stream(device=1), acc.current_stream(1)
    x = (0x1000, 0, 32)
    acc._op("aten.empty (x)", [x + (True,)], [0x1000], None)
    ready = acc.Event()
    ready.record(compute)
    with acc.stream(side):
        side.wait_event(ready)
        acc._op("aten.copy_ (reads x)", [x + (False,)], [], None)
        done = acc.Event()
        done.record(side)
    if waited:
        compute.wait_event(done)
    acc._op("aten.empty (at x's address)", [x + (True,)], [0x1000], None)
    reused = [r for r in acc.races() if "reused on stream" in r]
    assert bool(reused) != waited, acc.races()


def test_blocking_copies_between_host_and_device_are_host_syncs():
    # On a real device the recorder counts these (meta stands in for the device here).
    from ds_acco.testing.op_recorders import _blocking_transfer
    host, dev = torch.ones(4), torch.empty(4, device="meta")
    to_copy, copy_ = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
    assert _blocking_transfer(to_copy, (host,), {"device": torch.device("meta")}, dev)  # pageable H2D
    assert _blocking_transfer(to_copy, (host,), {"device": torch.device("meta"), "non_blocking": True}, dev)
    assert _blocking_transfer(copy_, (host, dev), {}, host)  # D2H into the host
    assert not _blocking_transfer(copy_, (host, torch.zeros(4)), {}, host)  # host to host
    assert _blocking_transfer(torch.ops.aten.nonzero.default, (dev,), {}, dev)
