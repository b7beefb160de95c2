"""The communication lane on its own (no process group): errors, bounds, stopping."""
import threading

import pytest

from ds_acco.comm.lane import CommLane, CommRoundError, CommTimeoutError


def test_a_rounds_own_timeout_error_is_reported_as_that_rounds_failure():
    # gloo reports a collective that timed out as TimeoutError, the same class that Future.result
    # raises when a wait runs out (Python >= 3.11): the lane must tell them apart.
    lane = CommLane(timeout_s=30)

    def round_fn():
        raise TimeoutError("Gloo connectFullMesh timed out")
    with pytest.raises(CommRoundError, match="connectFullMesh"):
        lane.wait(lane.submit("estimate 3", round_fn))
    lane.close()


def test_a_wait_that_runs_out_is_a_timeout_naming_the_setting():
    lane = CommLane(timeout_s=0.2)
    release = threading.Event()
    handle = lane.submit("commit 7", lambda: release.wait(30))
    with pytest.raises(CommTimeoutError, match=r"'commit 7'.*acco\.comm_timeout_s"):
        lane.wait(handle)
    release.set()
    lane.close()


def test_stop_nowait_returns_at_once_and_runs_then_after_the_queued_rounds():
    lane = CommLane(timeout_s=30)
    release = threading.Event()
    order = []
    lane.submit("round 1", lambda: (release.wait(30), order.append("round 1")))
    lane.submit("round 2", lambda: order.append("round 2"))
    thread = lane._thread
    lane.stop_nowait(then=lambda: order.append("then"))
    assert order == [] and thread.is_alive()  # did not wait for the busy worker
    release.set()
    thread.join(30)
    assert not thread.is_alive()
    assert order == ["round 1", "round 2", "then"]


def test_stop_nowait_from_the_lanes_own_thread_does_not_deadlock():
    # The garbage collector may finalise an engine on its own lane's thread, inside a round.
    lane = CommLane(timeout_s=30)
    order, worker = [], []

    def round_fn():
        worker.append(threading.current_thread())
        lane.stop_nowait(then=lambda: order.append("then"))
    lane.wait(lane.submit("round 1", round_fn))
    thread = worker[0]
    thread.join(30)
    assert not thread.is_alive() and order == ["then"]


def test_stop_nowait_without_a_worker_runs_then_here():
    lane = CommLane(synchronous=True)
    order = []
    lane.stop_nowait(then=lambda: order.append("then"))
    assert order == ["then"]


def test_after_a_wait_runs_out_nothing_waits_on_the_lane_again(monkeypatch):
    from ds_acco.comm import lane as lane_module
    lane = CommLane(timeout_s=0.2)
    release = threading.Event()
    stalled = lane.submit("commit 7", lambda: release.wait(30))
    with pytest.raises(CommTimeoutError, match="'commit 7' did not finish"):
        lane.wait(stalled)
    queued = lane.submit("estimate 8", lambda: "θ̃")

    def no_wait(*args, **kwargs):
        raise AssertionError("waited on a lane known broken")
    monkeypatch.setattr(lane_module, "futures", type("NoWaits", (), {"wait": staticmethod(no_wait)}))
    with pytest.raises(CommTimeoutError, match="'estimate 8' is not finished.*'commit 7' already ran out"):
        lane.wait(queued)
    thread = lane._thread
    monkeypatch.setattr(thread, "join", no_wait)
    lane.close()
    assert lane.stuck
    release.set()  # the peers come after all: the queued round still ends, and its result is collected
    monkeypatch.undo()
    thread.join(30)
    assert not thread.is_alive()
    assert lane.wait(queued) == "θ̃"


class _Held:
    """An object only a round's frame holds (stands for its tensors and process group)."""


@pytest.mark.parametrize("synchronous", [False, True])
def test_a_failed_rounds_error_does_not_keep_its_frames_locals_alive(synchronous):
    """The error of a round that failed outlives it (the round in flight, the caller's exception, at
    exit ``sys.last_value``); its frames must not keep what they referenced alive -- a process group
    kept so keeps its gloo threads to interpreter exit, where they may abort the process
    (at_exit.end_groups). Mutation: no ``traceback.clear_frames`` in the lane: the object stays alive."""
    import gc
    import weakref

    box = [_Held()]
    alive = weakref.ref(box[0])

    def round_that_fails():
        group = box.pop()  # the frame's local is the only reference left
        raise RuntimeError(f"collective failed on {type(group).__name__}")

    lane = CommLane(synchronous=synchronous, timeout_s=30)
    handle = lane.submit("failing", round_that_fails)
    with pytest.raises(CommRoundError) as raised:
        lane.wait(handle)
    assert "collective failed on _Held" in str(raised.value)  # the message survives
    gc.collect()
    assert alive() is None
    assert handle.future.exception() is not None  # still held, as the round in flight holds it
    lane.close()


def test_nothing_is_submitted_after_close():
    """After ``close()`` (``destroy()``) or ``stop_nowait()`` (a collected engine) the lane's process
    group is gone: a later round would silently run on the default group (the wrong ranks under
    tensor parallelism or a mesh). It is refused, naming the fix."""
    for end in (lambda lane: lane.close(), lambda lane: lane.stop_nowait()):
        lane = CommLane(timeout_s=30)
        lane.wait(lane.submit("first", lambda: 1))
        end(lane)
        with pytest.raises(RuntimeError, match="submitted after the engine was destroyed.*fix: build a new engine"):
            lane.submit("late", lambda: 2)
