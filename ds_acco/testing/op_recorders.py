"""What a thread issues while a :class:`~ds_acco.testing.recording.RecordingAccelerator` records: a torch
dispatch mode attributing every op's byte ranges read and written, and a torch function mode counting
the host's blocking reads of device values."""
from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class RecordingSink(Protocol):
    """What the recorders report to (``recording.RecordingAccelerator`` provides it; a protocol, so that
    this module does not import the accelerator that imports it)."""

    inner: Any
    _local: Any  # per thread: ``reading`` while a read is being counted
    _host: set  # allocations computed from host tensors only

    def _on_device(self, t: torch.Tensor) -> bool: ...

    def _op(self, what: str, accesses, fresh, device: Optional[int]) -> None: ...

    def is_host(self, t: torch.Tensor) -> bool: ...

    def _read(self, what: str) -> None: ...


# Host reads of a tensor's value: each blocks until the device has produced it.
HOST_READS = frozenset({"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__",
                        "__complex__"})


def byte_span(t: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """(storage address, first byte, end byte) a strided tensor covers, or None (empty, meta, no storage)."""
    if t.numel() == 0 or t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        key = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return key, lo, lo + (last + 1) * size


# c10d's ops carry no alias annotations: which of their tensors a collective writes.
_C10D_WRITES = ("tensors", "output", "output_tensor", "output_tensors", "outputs")


class OpRecorder(TorchDispatchMode):
    """Attributes every op to the thread's current stream, with the bytes it reads and writes."""

    def __init__(self, acc: RecordingSink):
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._note(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 -- recording must never change what runs
            pass
        return out

    def _note(self, func, args, kwargs, out) -> None:
        # a host read counted by ReadRecorder (``tolist`` copies to the host inside): one read
        if self.acc.inner is not None and not getattr(self.acc._local, "reading", False) \
                and _blocking_transfer(func, args, kwargs, out):
            self.acc._read(f"{func} (a blocking copy between host and device)")
        schema = func._schema
        c10d = schema.name.startswith("c10d::")
        accesses, inputs = [], set()
        named = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments
                                                     if a.name in kwargs]
        for arg, value in named:
            write = (arg.name in _C10D_WRITES) if c10d else bool(arg.alias_info is not None and arg.alias_info.is_write)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor) and self.acc._on_device(t):
                    span = byte_span(t)
                    if span is not None:
                        accesses.append(span + (write,))
                        inputs.add(span[0])
        host = bool(inputs) and all(self.acc.is_host(t) for t in tree_flatten((args, kwargs))[0]
                                    if isinstance(t, torch.Tensor))
        if schema.name.startswith("aten::lift_fresh"):
            inputs = set()  # torch.tensor(data): allocated outside the dispatcher, seen first here
        fresh, device = [], None
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
                device = t.device.index
                break
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self.acc._on_device(t):
                span = byte_span(t)
                if span is not None and span[0] not in inputs:
                    fresh.append(span[0])
                    if host:
                        self.acc._host.add(span[0])
                    else:
                        self.acc._host.discard(span[0])
                    accesses.append(span + (True,))
        self.acc._op(str(func), accesses, fresh, device)


_SHAPE_FROM_VALUES = ("aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2")


def _blocking_transfer(func, args, kwargs, out) -> bool:
    """On a real device: an op that makes the host wait for the device -- a copy between host and
    device that is not asynchronous from pinned memory, or an op whose output shape depends on
    device values (``nonzero`` and its kind)."""
    name = func._schema.name
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    if name in _SHAPE_FROM_VALUES:
        return any(t.device.type != "cpu" for t in tensors)
    if name not in ("aten::_to_copy", "aten::copy_"):
        return False
    if not ({t.device.type == "cpu" for t in tensors} >= {True, False}):
        return False  # one side of the copy only
    if not kwargs.get("non_blocking", len(args) > 2 and args[2] is True):
        return True
    return not all(t.is_pinned() for t in tensors if t.device.type == "cpu")


class ReadRecorder(TorchFunctionMode):
    """Counts the host's reads of tensor values (see :data:`HOST_READS`)."""

    def __init__(self, acc: RecordingSink):
        super().__init__()
        self.acc = acc

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and self.acc._on_device(args[0]) \
                and not self.acc.is_host(args[0]):
            if name in HOST_READS or (name == "to" and _to_host(args[1:], kwargs)):
                self.acc._read(name)
                local = self.acc._local
                outer, local.reading = getattr(local, "reading", False), True
                try:
                    return func(*args, **kwargs)
                finally:
                    local.reading = outer
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    try:
        return target is not None and not isinstance(target, (torch.dtype, torch.Tensor)) and \
            torch.device(target).type == "cpu"
    except (TypeError, RuntimeError):
        return False
