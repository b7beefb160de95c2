"""One step of any torch optimizer on this rank's fp32 master shards, kept or discarded.

``Opt(θ, S, g)`` of ACCO.md. The commit keeps the result; the estimate restores the shards,
the per-parameter state and the param-group settings bit for bit afterwards, whatever the
optimizer keeps there (moments, step counters, momentum buffers), so no optimizer is
special-cased.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Sequence, TypeVar

import torch

_GROUP_PARAMS = "params"
T = TypeVar("T")


class ShardOptimizer:
    """Drives ``optimizer`` whose parameters are exactly ``params`` (this rank's shards: DeepSpeed's
    fp32 master partitions, or FSDP's sharded parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], chunk_elems: int = 1 << 21):
        self.optimizer = optimizer
        self.chunk_elems = chunk_elems
        self.masters = list(params)
        owned = {id(p) for g in optimizer.param_groups for p in g[_GROUP_PARAMS]}
        if owned != {id(m) for m in self.masters}:
            raise ValueError("the optimizer must own exactly the shard parameters")

    functional = False  # estimate_into needs no snapshot (a functional step of a known optimizer)

    def commit(self, grads: Sequence[torch.Tensor]) -> None:
        """θ, S ← Opt(θ, S, g), kept."""
        self._step(grads)

    def estimate_into(self, grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """outs ← Opt(θ, S, g)'s parameters (cast to their dtype); θ and S are left as they were."""
        saved = self._snapshot()
        try:
            self._step(grads)
            for out, m in zip(outs, self.masters):
                local = m.to_local() if hasattr(m, "to_local") else m
                out.copy_(local.detach().reshape(-1))
        finally:
            self._restore(saved)

    def estimate(self, grads: Sequence[torch.Tensor], read: Callable[[], T]) -> T:
        """Returns ``read()`` called right after Opt(θ, S, g); θ and S are then restored exactly."""
        saved = self._snapshot()
        try:
            self._step(grads)
            return read()
        finally:
            self._restore(saved)

    def _step(self, grads: Sequence[torch.Tensor]) -> None:
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            self.optimizer.step()
        finally:
            for m in self.masters:
                m.grad = None

    # -- snapshot / restore of everything a step may change ------------------------------
    def _snapshot(self):
        state = {}
        for m in self.masters:
            entries = self.optimizer.state.get(m)
            state[m] = None if entries is None else {
                k: (v, v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                for k, v in entries.items()
            }
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != _GROUP_PARAMS}
                  for g in self.optimizer.param_groups]
        masters = [m.detach().clone() for m in self.masters]
        return state, groups, masters

    def _restore(self, saved) -> None:
        state, groups, masters = saved
        with torch.no_grad():
            for m, value in zip(self.masters, masters):
                m.copy_(value)
        for m, entries in state.items():
            if entries is None:
                self.optimizer.state.pop(m, None)
                continue
            restored = {}
            for k, (orig, value) in entries.items():
                if torch.is_tensor(orig):
                    # Keep the original tensor objects: other code (DeepSpeed's hp-param links)
                    # may hold references to them.
                    with torch.no_grad():
                        orig.copy_(value)
                    restored[k] = orig
                else:
                    restored[k] = value
            self.optimizer.state[m] = restored
        for g, values in zip(self.optimizer.param_groups, groups):
            for k in [k for k in g if k != _GROUP_PARAMS and k not in values]:
                del g[k]
            g.update(values)


def global_norm_sq(grads: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of this rank's shard gradients (fp64 for a stable all-reduce)."""
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        total += g.double().pow(2).sum()
    return total
