"""How many aten ops did a block of code dispatch? A test helper (as FSDP2's tests count collectives
with ``CommDebugMode``).

``with OpCounter() as c: ...`` counts every op that reaches the dispatcher from Python inside the
block (a ``TorchDispatchMode``), split into views (``slice``, ``view``, ``detach``: metadata only,
no kernel) and the rest, :attr:`kernels` -- what launches a kernel on an accelerator (allocations
included, which launch none: the count is an upper bound). A foreach op over a list of tensors is
one op, as it is one kernel launch (or a few) on CUDA. Ops a kernel calls internally are not seen.
"""
from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the ops run inside the ``with`` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.views = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops)[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        """Ops that are not views."""
        return sum(self.ops.values())

    @property
    def view_count(self) -> int:
        return sum(self.views.values())

    def report(self) -> str:
        return ", ".join(f"{name.replace('aten.', '')} x{n}" for name, n in self.ops.most_common())
