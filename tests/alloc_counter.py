"""Which tensors did a block of code allocate? A test helper.

``with AllocCounter() as c: ...`` records every tensor *returned by an op* inside the block
whose storage is new, i.e. belongs to none of the op's tensor inputs (``out=`` arguments
included): factory ops (``empty``, ``zeros``, ``clone``, ``_to_copy``, ``cat``), out-of-place
arithmetic (``mul``, ``add``, …). Views and in-place / ``out=`` results share an input's
storage and are not counted.

Scope: the counter sees ops as they reach the dispatcher from Python (a
``TorchDispatchMode``). Scratch memory a kernel allocates internally (e.g. a dtype cast inside
``linalg.vector_norm``) does not pass through it and is not counted; a test that bounds such a
kernel must bound its input size instead.
"""
from __future__ import annotations

import dataclasses
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclasses.dataclass
class Allocation:
    op: str
    numel: int
    dtype: torch.dtype
    nbytes: int  # of the new storage

    @property
    def storage_elems(self) -> int:
        return self.nbytes // max(1, self.dtype.itemsize)


def _storage_ptr(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return None, 0
    return storage.data_ptr(), storage.nbytes()


class AllocCounter(TorchDispatchMode):
    """Records :class:`Allocation`s of the ops run inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.allocations: List[Allocation] = []
        self.paused = 0  # > 0: ops run uncounted (see :meth:`pause`)

    def pause(self, fn):
        """``fn`` wrapped so that what it allocates is not counted (e.g. the wrapped optimizer's
        own step, which stock ZeRO-1 runs too)."""
        def paused(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        inputs = {ptr for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  for ptr in [_storage_ptr(t)[0]] if ptr is not None}
        result = func(*args, **kwargs)
        seen = set()
        for t in tree_flatten(result)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr, nbytes = _storage_ptr(t)
            if ptr is None or nbytes == 0 or ptr in inputs or ptr in seen:
                continue
            seen.add(ptr)
            self.allocations.append(Allocation(str(func), t.numel(), t.dtype, nbytes))
        return result

    # -- summaries ---------------------------------------------------------------------------
    @property
    def largest(self) -> int:
        """Elements of the largest single allocation (0 if none)."""
        return max((a.storage_elems for a in self.allocations), default=0)

    @property
    def total_bytes(self) -> int:
        """Bytes of all allocations together: an upper bound of the block's peak."""
        return sum(a.nbytes for a in self.allocations)

    def above(self, elems: int) -> List[Allocation]:
        """The allocations of more than ``elems`` elements."""
        return [a for a in self.allocations if a.storage_elems > elems]

    def report(self, top: int = 10) -> str:
        rows = sorted(self.allocations, key=lambda a: -a.nbytes)[:top]
        return "\n".join(f"{a.op}: {a.numel} x {a.dtype} ({a.nbytes} B)" for a in rows) or "(none)"
