"""A recording accelerator: the lane's stream protocol made checkable without a GPU.

:class:`RecordingAccelerator` implements the lane's accelerator interface (:mod:`.streams`). On
its own it runs on CPU as if it were an asynchronous device: kernels execute at once, but every
stream, event record / wait and host synchronisation is logged, and every op a thread issues
while recording is attributed to that thread's current stream with the byte ranges it reads and
writes. With ``inner`` (a real accelerator: DeepSpeed's or :class:`.streams.TorchAccelerator`) it
delegates and records the same log on the real device (``scripts/gpu_check.py``); there host (CPU)
tensors are left out: their ops run on the issuing thread at once (no stream to race on) and reading
them waits for no kernel.

From the log:

* :meth:`RecordingAccelerator.races` replays the log with vector clocks -- a stream's kernels run
  in order; ``wait_event`` orders a stream after the event's record; a host synchronisation
  orders what the host issues afterwards -- and reports every pair of accesses to the same bytes
  of the same allocation, on different streams, at least one a write, that nothing orders: on a
  real device, a data race. Deleting any wait of the lane's protocol makes one appear.
* :meth:`RecordingAccelerator.host_syncs` lists the host's blocking reads of device values
  (``.item()``, ``.cpu()``, ``.tolist()``, ``float()``, ...; counted with a torch function mode)
  and the stream / event / device synchronisations, per thread.

Recording is per thread: the compute thread records inside ``with acc.recording():``, the lane's
thread whenever it issues on one of this accelerator's streams while recording is on.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .op_recorders import OpRecorder, ReadRecorder, byte_span


@dataclass
class Entry:
    """One line of the log."""
    kind: str  # stream | record | wait | sync | op | read | mark
    thread: str
    stream: Optional[int] = None
    event: Optional[int] = None
    what: str = ""
    accesses: Tuple = ()  # (storage key, start, end, write) per tensor of an op
    fresh: Tuple = ()  # storage keys an op allocated
    device: Optional[int] = None


class _Stream:
    """A stream of the recording accelerator (``real``: the inner accelerator's stream, if any)."""

    def __init__(self, acc: "RecordingAccelerator", device_index: Optional[int], real: Any = None):
        self._acc = acc
        self.id = next(acc._ids)
        self.device_index = device_index
        self.real = real

    @property
    def device(self):
        return self.real.device if self.real is not None else torch.device(self._acc.device_type, self.device_index)

    def wait_event(self, event: "_Event") -> None:
        self._acc._wait(self, event)
        if self.real is not None:
            self.real.wait_event(event.real)

    def synchronize(self) -> None:
        self._acc._sync(stream=self)
        if self.real is not None:
            self.real.synchronize()

    def record_event(self, event: Optional["_Event"] = None) -> "_Event":
        event = event or self._acc.Event()
        event.record(self)
        return event


class _Event:
    def __init__(self, acc: "RecordingAccelerator", real: Any = None):
        self._acc = acc
        self.id = next(acc._ids)
        self.real = real
        self.stream: Optional[_Stream] = None  # recorded on
        self.clock: Optional[Dict[int, int]] = None

    def record(self, stream: Optional[_Stream] = None) -> None:
        stream = stream or self._acc.current_stream()
        self._acc._record(self, stream)
        if self.real is not None:
            self.real.record(stream.real)

    def wait(self, stream: Optional[_Stream] = None) -> None:
        (stream or self._acc.current_stream()).wait_event(self)

    def query(self) -> bool:
        return True if self.real is None else bool(self.real.query())

    def synchronize(self) -> None:
        self._acc._sync(event=self)
        if self.real is not None:
            self.real.synchronize()


class RecordingAccelerator:
    """See the module docstring. ``tensor_device``: see ``__init__``. ``exclude_reads(tensor)``: True
    for host tensors whose reads are not device synchronisations (e.g. torch Adam's ``step`` counts,
    CPU tensors by design), which on CPU cannot be told apart from the pretend device's; a tensor
    an op computed from such tensors alone is a host tensor too."""

    def __init__(self, inner: Any = None, device_type: str = "cuda", tensor_device: Optional[int] = None,
                 exclude_reads: Optional[Callable[[torch.Tensor], bool]] = None):
        self.inner = inner
        self.device_type = device_type
        # The device index CPU tensors stand for (their kernels go to its current stream); None:
        # the issuing thread's current device. A real device's tensors carry their own.
        self.tensor_device = tensor_device
        self.exclude_reads = exclude_reads or (lambda t: False)
        self.log: List[Entry] = []
        self.recording_on = False
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._local = threading.local()  # per thread: current device, current streams, recording depth
        self._defaults: Dict[Optional[int], _Stream] = {}
        self._host: set = set()  # allocations computed from host tensors only (their reads are no syncs)
        self._streams: Dict[int, _Stream] = {}

    # -- the accelerator interface ------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return False

    def Stream(self, device=None, **kwargs):  # noqa: N802
        index = _index(device) if device is not None else self._device()
        real = self.inner.Stream(device=device, **kwargs) if self.inner is not None else None
        s = _Stream(self, index, real)
        with self._lock:
            self._streams[s.id] = s
            self.log.append(Entry("stream", _thread(), stream=s.id, device=index))
        return s

    def Event(self, **kwargs):  # noqa: N802
        return _Event(self, self.inner.Event(**kwargs) if self.inner is not None else None)

    @contextlib.contextmanager
    def stream(self, stream: _Stream):
        current = self._currents()
        before = current.get(stream.device_index)
        current[stream.device_index] = stream
        real = self.inner.stream(stream.real) if self.inner is not None else contextlib.nullcontext()
        try:
            with real, (self._record_here() if self.recording_on else contextlib.nullcontext()):
                yield
        finally:
            current[stream.device_index] = before

    def current_stream(self, device_index: Optional[int] = None) -> _Stream:
        index = self._device() if device_index is None else device_index
        s = self._currents().get(index)
        return s if s is not None else self._default(index)

    def set_device(self, index: int) -> None:
        self._local.device = index
        if self.inner is not None:
            self.inner.set_device(index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        self._sync(device=self._device() if device_index is None else device_index)
        if self.inner is not None:
            self._local.forwarding = True  # the inner accelerator may be one watching() patched
            try:
                self.inner.synchronize(device_index)
            finally:
                self._local.forwarding = False

    @contextlib.contextmanager
    def watching(self, accelerator: Any) -> Iterator[None]:
        """Also log ``accelerator.synchronize()`` -- a device-wide synchronisation outside the lane's
        interface, e.g. DeepSpeed's own accelerator called by its timers -- as the calling thread's
        ``device.synchronize``: on a device it waits for the lane's side stream too."""
        real = accelerator.synchronize

        def synchronize(*args, **kwargs):
            if self.recording_on and not getattr(self._local, "forwarding", False):
                self._sync(what=f"device.synchronize ({type(accelerator).__name__})")
            return real(*args, **kwargs)
        accelerator.synchronize = synchronize  # instance attribute: every caller resolves it at call time
        try:
            yield
        finally:
            accelerator.__dict__.pop("synchronize", None)

    # -- recording ----------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator["RecordingAccelerator"]:
        """Record this thread's ops and host reads (and, meanwhile, the lane thread's)."""
        self.recording_on = True
        try:
            with self._record_here():
                yield self
        finally:
            self.recording_on = False

    def mark(self, what: str) -> None:
        """A marker in the log (e.g. a micro-batch's end), to count between."""
        with self._lock:
            self.log.append(Entry("mark", _thread(), what=what))

    @contextlib.contextmanager
    def _record_here(self):
        depth = getattr(self._local, "depth", 0)
        if depth:  # already recording on this thread
            yield
            return
        self._local.depth = 1
        try:
            with OpRecorder(self), ReadRecorder(self):
                yield
        finally:
            self._local.depth = 0

    # -- queries ------------------------------------------------------------------------
    def host_syncs(self, thread: Optional[str] = None, between: Optional[Tuple[str, str]] = None) -> List[Entry]:
        """Host reads and synchronisations, of ``thread`` (a thread name) if given, between two
        marks if given (the first mark named ``between[0]`` and the next named ``between[1]``)."""
        entries = self.log
        if between is not None:
            start = next(i for i, e in enumerate(entries) if e.kind == "mark" and e.what == between[0])
            end = next(i for i, e in enumerate(entries) if i > start and e.kind == "mark" and e.what == between[1])
            entries = entries[start:end]
        return [e for e in entries if e.kind in ("read", "sync") and (thread is None or e.thread == thread)]

    def streams(self) -> List[_Stream]:
        return list(self._streams.values())

    def events(self) -> List[Entry]:
        return [e for e in self.log if e.kind in ("record", "wait")]

    def races(self, limit: int = 20) -> List[str]:
        """Unordered conflicting accesses (see the module docstring), at most ``limit``."""
        clocks: Dict[int, Dict[int, int]] = {}  # stream → vector clock
        host: Dict[str, Dict[int, int]] = {}  # thread → what it has synchronised with
        events: Dict[int, Dict[int, int]] = {}
        gens: Dict[int, int] = {}
        seen: Dict[Tuple[int, int], List[Tuple]] = {}  # (storage, generation) → accesses
        allocated_on: Dict[Tuple[int, int], int] = {}  # (storage, generation) → the stream that allocated it
        out: List[str] = []
        for e in self.log:
            if e.kind == "record":
                events[e.event] = dict(_issue(clocks, host, e))
            elif e.kind == "wait":
                _join(clocks.setdefault(e.stream, {}), events.get(e.event, {}))
            elif e.kind == "sync":
                mine = host.setdefault(e.thread, {})
                if e.stream is not None:
                    _join(mine, clocks.get(e.stream, {}))
                elif e.event is not None:
                    _join(mine, events.get(e.event, {}))
                else:  # the whole device
                    for c in clocks.values():
                        _join(mine, c)
            elif e.kind == "op":
                clock = _issue(clocks, host, e, tick=True)
                tick = clock[e.stream]
                for key in e.fresh:
                    old = (key, gens.get(key, 0))
                    # A caching allocator hands a freed block again to the stream that allocated it
                    # only: reused here while another stream's access to it may still be pending,
                    # it was freed too early (e.g. a round's input not kept alive until the wait).
                    if allocated_on.get(old) == e.stream:
                        for (s, t, a, b, w, name) in seen.get(old, ()):
                            if s != e.stream and clock.get(s, 0) < t and len(out) < limit:
                                out.append(f"allocation {key:#x} reused on stream {e.stream} by {e.what} while "
                                           f"{name} on stream {s} may still {'write' if w else 'read'} it (freed "
                                           "before the stream using it was waited for)")
                    seen.pop(old, None)
                    gens[key] = old[1] + 1
                    allocated_on[(key, gens[key])] = e.stream
                for key, lo, hi, write in e.accesses:
                    slot = seen.setdefault((key, gens.get(key, 0)), [])
                    for (s, t, a, b, w, name) in slot:
                        if s != e.stream and (w or write) and a < hi and lo < b and clock.get(s, 0) < t:
                            if len(out) < limit:
                                out.append(f"{name} on stream {s} and {e.what} on stream {e.stream} "
                                           f"({'write' if w else 'read'}/{'write' if write else 'read'} of bytes "
                                           f"[{max(a, lo)}, {min(b, hi)}) of allocation {key:#x}) are not ordered")
                    # What this access covers makes older accesses of its stream redundant.
                    slot[:] = [x for x in slot if not (x[0] == e.stream and lo <= x[2] and x[3] <= hi
                                                       and (write or not x[4]))]
                    slot.append((e.stream, tick, lo, hi, write, e.what))
        return out

    # -- internals ----------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is device memory: every tensor when pretending, else the non-CPU ones."""
        return self.inner is None or t.device.type != "cpu"

    def _device(self) -> Optional[int]:
        return getattr(self._local, "device", None)

    def _currents(self) -> Dict[Optional[int], _Stream]:
        current = getattr(self._local, "streams", None)
        if current is None:
            current = self._local.streams = {}
        return current

    def _default(self, index: Optional[int]) -> _Stream:
        with self._lock:
            s = self._defaults.get(index)
            if s is None:
                real = self.inner.current_stream(index) if self.inner is not None else None
                s = self._defaults[index] = _Stream(self, index, real)
                self._streams[s.id] = s
                self.log.append(Entry("stream", _thread(), stream=s.id, device=index, what="default"))
            return s

    def _record(self, event: _Event, stream: _Stream) -> None:
        with self._lock:
            event.stream = stream
            self.log.append(Entry("record", _thread(), stream=stream.id, event=event.id, device=stream.device_index))

    def _wait(self, stream: _Stream, event: _Event) -> None:
        with self._lock:
            self.log.append(Entry("wait", _thread(), stream=stream.id, event=event.id, device=stream.device_index,
                                  what="" if event.stream is None else f"recorded on {event.stream.id}"))

    def _sync(self, stream: Optional[_Stream] = None, event: Optional[_Event] = None, device=None,
              what: str = "") -> None:
        what = what or ("stream.synchronize" if stream is not None else "event.synchronize" if event is not None else
                        "device.synchronize")
        with self._lock:
            self.log.append(Entry("sync", _thread(), stream=None if stream is None else stream.id,
                                  event=None if event is None else event.id, what=what, device=device))

    def _op(self, what: str, accesses, fresh, device: Optional[int]) -> None:
        stream = self.current_stream(self.tensor_device if device is None else device)
        with self._lock:
            self.log.append(Entry("op", _thread(), stream=stream.id, what=what, accesses=tuple(accesses),
                                  fresh=tuple(fresh)))

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on the host: excluded, or computed from excluded tensors only."""
        if self.exclude_reads(t):
            return True
        span = byte_span(t)
        return span is not None and span[0] in self._host

    def _read(self, what: str) -> None:
        with self._lock:
            self.log.append(Entry("read", _thread(), what=what))


def _thread() -> str:
    return threading.current_thread().name


def _index(device) -> Optional[int]:
    if isinstance(device, int):
        return device
    return torch.device(device).index


def _join(into: Dict[int, int], other: Dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _issue(clocks, host, e: Entry, tick: bool = False) -> Dict[int, int]:
    """Something issued on ``e.stream`` by ``e.thread``: after what that thread synchronised with."""
    clock = clocks.setdefault(e.stream, {})
    _join(clock, host.get(e.thread, {}))
    if tick:
        clock[e.stream] = clock.get(e.stream, 0) + 1
    return clock


