"""The communication lane: runs communication rounds one at a time, beside the compute lane.

A round is a plain function (reduce, sharded optimizer step, all-gather). The lane runs it on
a dedicated worker thread with its own process group, so the thread that computes
micro-batches never blocks on the network until it asks for the result.

On an accelerator with streams (the interface: :mod:`.streams`) the protocol is, with every
stream and event on the lane's device:

1. submit (compute thread): event ``ready`` recorded on the compute stream, after everything
   queued so far (the copy of G into the communication buffer B);
2. the worker issues the round on its side stream, which first waits on ``ready`` (on the
   device); then it records event ``done`` on the side stream and resolves the round. The
   worker does not wait for the kernels: the round reads on the host only what it must (one
   small read per round, see rounds.py);
3. wait (compute thread): the compute stream waits on ``done`` -- on the device, the host does
   not block on the kernels -- before the caller reads what the round wrote (B's all-gathered
   weights). Tensors the round reads that the compute thread allocated (``keep``) are held until
   this wait is queued, so their memory cannot be reused by compute kernels the round races;
4. a round that raises first synchronises its stream, so no kernel of it is pending when the
   error reaches the caller.

A wait that runs out (``timeout_s``, raising :class:`CommTimeoutError`) marks the lane broken: its
worker is stuck in that round's collective. From then on nothing waits on the lane again -- a later
wait for an unfinished round raises at once and :meth:`CommLane.close` does not join the worker --
so the exit path after a timeout (a drain, then the lane's close) adds no second and third
``timeout_s`` to the first.

Tests drive this protocol with :class:`~ds_acco.testing.recording.RecordingAccelerator`, which
checks every cross-stream access for an ordering, and swap in lanes that delay or gate rounds
to check asynchrony structurally.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch


class CommTimeoutError(RuntimeError):
    """A communication round did not finish within ``acco.comm_timeout_s``."""


class CommRoundError(RuntimeError):
    """A communication round failed on the lane (a collective raised, e.g. a peer died)."""


class _Stop:
    """The worker's last item: run ``then`` (if any) and end."""

    def __init__(self, then: Optional[Callable[[], None]]):
        self.then = then


class RoundHandle:
    """A submitted round: poll with :meth:`done`, collect with :meth:`CommLane.wait`."""

    def __init__(self, name: str, future: Future, keep: Sequence[Any] = ()):
        self.name = name
        self.future = future
        self.submitted_at = time.perf_counter()
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.done_event: Any = None  # recorded on the side stream after the round's last kernel
        self.keep: Sequence[Any] = tuple(keep or ())  # alive until the compute stream waits on done_event
        self.waited = False  # the compute stream waits on done_event (once)

    def done(self) -> bool:
        """Whether the round has finished, its kernels included (a query: never blocks)."""
        if not self.future.done():
            return False
        return self.done_event is None or bool(self.done_event.query())


class CommLane:
    """Runs rounds in order on one worker thread (or inline when ``synchronous``).

    ``accelerator``: see :mod:`.streams` (DeepSpeed's accelerator, torch's, or a test's); None or
    a synchronized device (CPU): no stream is used. ``device``: the rank's device, where the side
    stream, the events and the compute stream the protocol uses live.
    """

    def __init__(self, *, synchronous: bool = False, timeout_s: float = 1800.0, accelerator: Any = None,
                 device: Optional[torch.device] = None):
        self.synchronous = synchronous
        self._device = device
        self.timeout_s = timeout_s
        self._accel = accelerator
        self._use_streams = accelerator is not None and not accelerator.is_synchronized_device()
        self._index = None if device is None else device.index
        # On the lane's device, whichever device is current here: an FSDP2 user need not call set_device.
        self._stream = accelerator.Stream(device=device) if self._use_streams else None
        # A daemon thread, not a ThreadPoolExecutor: the executor's workers are joined at
        # interpreter exit, so a round stuck in a collective would keep the process alive.
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()  # re-entrant: cheap insurance should a finaliser run while it is held
        self.rounds_submitted = 0
        self.timed_out: Optional[str] = None  # the round whose wait ran out: the lane is broken (module docstring)

    def submit(self, name: str, fn: Callable[[], Any], keep: Sequence[Any] = ()) -> RoundHandle:
        """Start ``fn`` as the next round and return at once (inline when synchronous).

        ``keep``: objects (tensors the compute thread made) the round reads; held until the
        compute stream has waited for the round (:meth:`wait`). ``fn`` must return host values
        only: device tensors it returned would be read and freed on the compute stream."""
        if self.closed:  # its process group is gone: a round now would run on no group, or the wrong one
            raise RuntimeError(f"ACCO: round '{name}' submitted after the engine was destroyed (its communication "
                               "lane and process group are closed); fix: build a new engine (ds_acco.initialize / "
                               "AccoFSDP) to train, load or step again")
        ready = None
        if self._use_streams:
            ready = self._accel.Event()
            # On the compute stream: everything queued so far, the copy into B included.
            ready.record(self._accel.current_stream(self._index))
        future: Future = Future()
        handle = RoundHandle(name, future, keep)
        self.rounds_submitted += 1

        def run():
            handle.started_at = time.perf_counter()
            try:
                with torch.no_grad():  # rounds never build graphs
                    if self._stream is not None:
                        with self._accel.stream(self._stream):
                            self._stream.wait_event(ready)
                            out = fn()
                            done = self._accel.Event()
                            done.record(self._stream)
                        handle.done_event = done
                    else:
                        out = fn()
            except BaseException as exc:  # handed to the waiting thread
                if self._stream is not None:
                    self._settle()
                handle.finished_at = time.perf_counter()
                # The error outlives the round (held by the round in flight, the caller's error, at
                # exit sys.last_value): its frames' locals must not keep the round's tensors and
                # process group alive (a group kept alive keeps its gloo threads to interpreter exit,
                # see at_exit.end_groups). The traceback's lines stay printable.
                traceback.clear_frames(exc.__traceback__)
                future.set_exception(exc)
                return
            handle.finished_at = time.perf_counter()
            future.set_result(out)

        if self.synchronous:
            run()
        else:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="acco-comm", daemon=True)
                    self._thread.start()
                self._queue.put(run)
        return handle

    def _settle(self) -> None:
        """A failed round: its kernels already queued finish before the error is handed on (the
        caller may free or reuse what they touch). A second failure here is the device's."""
        try:
            self._stream.synchronize()
        except BaseException:  # noqa: BLE001 -- the round's own error is the one to report
            pass

    def _work(self) -> None:
        self._enter_device()
        while True:
            run = self._queue.get()
            if run is None:
                return
            if isinstance(run, _Stop):
                if run.then is not None:
                    try:
                        run.then()
                    except Exception:  # the last act of an abandoned lane: nobody to report to
                        pass
                return
            run()

    def _enter_device(self) -> None:
        """The worker thread makes its rank's device current (a new thread starts on device 0:
        every rank would otherwise create a context there)."""
        if self._use_streams and self._device is not None and self._device.index is not None:
            self._accel.set_device(self._device.index)

    def wait(self, handle: RoundHandle) -> Any:
        """Block until ``handle`` finishes; re-raise its error; bounded by ``timeout_s``."""
        if self.timed_out is not None and not handle.future.done():
            raise CommTimeoutError(
                f"communication round '{handle.name}' is not finished and is not waited for: round "
                f"'{self.timed_out}' already ran out of acco.comm_timeout_s ({self.timeout_s:g} s) on this lane, "
                "whose worker is still stuck in it")
        # Waited for apart from collecting: a round's own TimeoutError (a collective's timeout is
        # one) must be reported as that round's failure, not as this wait running out.
        finished, _ = futures.wait([handle.future], timeout=self.timeout_s)
        if not finished:
            self.timed_out = handle.name
            raise CommTimeoutError(
                f"communication round '{handle.name}' did not finish within {self.timeout_s:g} s "
                "(acco.comm_timeout_s): a peer rank may have died or the network is stalled")
        try:
            out = handle.future.result()
        except torch.OutOfMemoryError:  # the round's own workspace: not a peer's failure
            raise
        except (RuntimeError, OSError, TimeoutError) as exc:  # collectives report peer failures so
            raise CommRoundError(f"communication round '{handle.name}' failed: {exc} -- a peer rank may have "
                                 "died or the network failed; this rank stops here") from exc
        if handle.done_event is not None and not handle.waited:
            # On the device: kernels the caller queues from here on run after the round's.
            self._accel.current_stream(self._index).wait_event(handle.done_event)
        handle.waited, handle.keep = True, ()
        return out

    def close(self) -> None:
        """Stop the worker thread after the round in flight, waiting at most ``timeout_s`` for it
        (not at all once a wait has run out: the worker is stuck in that round): a round stuck in
        a collective (a dead peer) is left to its daemon thread. Later submits raise."""
        with self._lock:
            self.closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if self.timed_out is None:
                thread.join(self.timeout_s)
            self.stuck = thread.is_alive()

    def stop_nowait(self, then: Optional[Callable[[], None]] = None) -> None:
        """Ask the worker to end once the rounds already queued have finished, without waiting
        (a finaliser may run on any thread, this lane's own included). ``then`` runs after the
        last round, on the worker's thread (here at once if the worker never started). Later
        submits raise."""
        with self._lock:
            self.closed = True
            thread, self._thread = self._thread, None
        if thread is None:
            if then is not None:
                then()
            return
        self._stopping = thread
        self._queue.put(_Stop(then))

    def join_stopping(self, timeout: float) -> bool:
        """After :meth:`stop_nowait`: wait at most ``timeout`` seconds for the worker to end (never
        from the worker itself); whether it has ended."""
        thread = self._stopping
        if thread is None or thread is threading.current_thread():
            return thread is None
        if self.timed_out is not None:  # broken: its worker is stuck in that round, waited for once already
            return not thread.is_alive()
        thread.join(timeout)
        return not thread.is_alive()

    closed = False  # close() or stop_nowait() ended the lane: nothing is submitted any more
    stuck = False  # close() left the worker inside a round (its collectives may still use the group)
    _stopping: Optional[threading.Thread] = None  # the worker stop_nowait() asked to end
