"""FSDP2's parameters as one :class:`~ds_acco.core.schedule.FlatGroup` of the shared schedule.

The live weights are FSDP's resident unsharded parameters (``FSDPParam._unsharded_param``,
one tensor per parameter, ``param_dtype``), the shard parameters are FSDP's sharded DTensor
parameters (``FSDPParam.sharded_param``, the ones the user's optimizer holds), and G is a flat
param-major accumulator (``reduce_dtype``) that a post-accumulate-grad hook adds into.

B (``comm``) is rank-major: rank r's segment is the concatenation, over the parameters, of
r's padded dim-0 shard -- the layout of FSDP's own all-gather input -- so a reduce of B and a
slice gives this rank exactly the gradients of its local shards, and an all-gather of the
segments gives back every rank's shards in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..core.schedule import FlatGroup, RoundKind


@dataclass(frozen=True)
class Slot:
    """One parameter: where its pieces live in each layout."""
    fsdp_param: object  # torch's FSDPParam
    live: torch.Tensor  # the resident unsharded parameter, flattened (a view: writes reach FSDP)
    grad: torch.Tensor  # its gradient in G, flattened (a view)
    offset: int  # start in every rank's segment of B
    padded: int  # elements of one padded dim-0 shard
    local: int  # elements of this rank's (unpadded) shard


class FSDPShardGroup(FlatGroup):
    """Maps FSDP2's unsharded / sharded parameters onto the schedule's flat buffers."""

    def __init__(self, fsdp_params: Sequence, *, rank: int, world: int, accum_dtype: torch.dtype,
                 device: torch.device, estimate_dtype: Optional[torch.dtype] = None):
        self.rank, self.world = rank, world
        numels = [fp._orig_size.numel() for fp in fsdp_params]
        self.grads = torch.zeros(sum(numels), dtype=accum_dtype, device=device)  # G, param-major
        slots, offset, start = [], 0, 0
        for fp, n in zip(fsdp_params, numels):
            padded = fp.padded_sharded_param_size.numel()
            live = fp._unsharded_param.detach().view(-1)
            slots.append(Slot(fp, live, self.grads.narrow(0, start, n), offset, padded, fp.sharded_size.numel()))
            offset += padded
            start += n
        self.slots: List[Slot] = slots
        self.segment = offset  # S: one rank's share of B
        # zeros: the padding of every shard stays 0 through every reduce and gather
        self.comm = torch.zeros(world * offset, dtype=accum_dtype, device=device)
        self._estimate_comm = self.comm
        if estimate_dtype is not None and estimate_dtype != accum_dtype:
            # estimate rounds travel narrower, in B's own storage (same element layout)
            self._estimate_comm = self.comm.view(torch.uint8)[:self.comm.numel() * estimate_dtype.itemsize] \
                .view(estimate_dtype)
        self.master = None  # the shard parameters are FSDP's DTensors, see shard_params
        self.live = None  # not flat: the unsharded parameters, see slots

    # -- moving one parameter between its flat (param-major) form and B's rank-major columns --
    def _spans(self, slot: Slot):
        """(rank, start in the flat parameter, length) of each rank's valid rows."""
        n = slot.live.numel()
        for r in range(self.world):
            start = r * slot.padded
            length = max(0, min(slot.padded, n - start))
            if length:
                yield r, start, length

    def _to_comm(self, slot: Slot, flat: torch.Tensor, comm: torch.Tensor) -> None:
        cols = comm.view(self.world, self.segment)
        full = slot.live.numel() // slot.padded if slot.padded else 0  # ranks with a whole shard
        if full:
            cols[:full, slot.offset:slot.offset + slot.padded].copy_(flat[:full * slot.padded].view(full, -1))
        for r in range(full, self.world):
            start = r * slot.padded
            length = max(0, min(slot.padded, flat.numel() - start))
            cols[r, slot.offset:slot.offset + length].copy_(flat[start:start + length])
            # keep the padding 0 (a narrower estimate round may have left other bytes there)
            cols[r, slot.offset + length:slot.offset + slot.padded].zero_()

    def _from_comm(self, slot: Slot, comm: torch.Tensor, flat: torch.Tensor) -> None:
        cols = comm.view(self.world, self.segment)
        full = slot.live.numel() // slot.padded if slot.padded else 0
        if full:
            flat[:full * slot.padded].view(full, -1).copy_(cols[:full, slot.offset:slot.offset + slot.padded])
        for r, start, length in self._spans(slot):
            if r >= full:
                flat[start:start + length].copy_(cols[r, slot.offset:slot.offset + length])

    # -- FlatGroup ---------------------------------------------------------------------------
    @property
    def shard_params(self) -> List[torch.Tensor]:
        """FSDP's sharded DTensor parameters (what the user's optimizer steps)."""
        return [s.fsdp_param.sharded_param for s in self.slots]

    def split_shard_grad(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """This rank's segment of the mean gradient as DTensor gradients with the shards' placements."""
        out = []
        for s in self.slots:
            fp = s.fsdp_param
            local = flat.narrow(0, s.offset, s.local).view(fp.sharded_size).to(fp.sharded_param.dtype)
            out.append(fp.to_sharded_dtensor(local))
        return out

    def read_shard(self, copy: bool = True) -> torch.Tensor:
        seg = torch.zeros(self.segment, dtype=torch.float32, device=self.comm.device)
        for s in self.slots:
            local = s.fsdp_param.sharded_param.to_local()
            seg.narrow(0, s.offset, s.local).copy_(local.reshape(-1))
        return seg

    def comm_for(self, kind: Optional[RoundKind]) -> torch.Tensor:
        return self._estimate_comm if kind is RoundKind.ESTIMATE else self.comm

    def pack_grads(self, clear: bool, kind: Optional[RoundKind] = None) -> None:
        comm = self.comm_for(kind)
        for s in self.slots:
            self._to_comm(s, s.grad, comm)
        if clear:
            self.grads.zero_()

    def unpack_into_live(self, kind: Optional[RoundKind] = None) -> None:
        comm = self.comm_for(kind)
        for s in self.slots:
            self._from_comm(s, comm, s.live)

    def swap_live_and_comm(self) -> None:
        for s in self.slots:
            held = torch.empty(s.live.numel(), dtype=self.comm.dtype, device=self.comm.device)
            self._from_comm(s, self.comm, held)
            self._to_comm(s, s.live, self.comm)
            s.live.copy_(held)

    def zero_grads(self) -> None:
        self.grads.zero_()

    def _live_flat(self) -> torch.Tensor:
        return torch.cat([s.live for s in self.slots]).cpu()

    def _comm_as_live(self) -> torch.Tensor:
        out = torch.empty(self.grads.numel(), dtype=self.slots[0].live.dtype, device=self.comm.device)
        start = 0
        for s in self.slots:
            self._from_comm(s, self.comm, out.narrow(0, start, s.live.numel()))
            start += s.live.numel()
        return out.cpu()

    def _live_as_comm(self) -> torch.Tensor:
        out = self.comm.clone()
        for s in self.slots:
            self._to_comm(s, s.live, out)
        return out.cpu()

    def export_state(self, swapped: bool) -> dict:
        """G (param-major), the live weights (param-major, model dtype) and B (rank-major), as the
        compute lane sees them."""
        if swapped:  # inside committed_weights: the two hold each other's contents
            live, comm = self._comm_as_live(), self._live_as_comm()
        else:
            live, comm = self._live_flat(), self.comm.detach().to("cpu", copy=True)
        return {"grads": self.grads.detach().to("cpu", copy=True), "live": live, "comm": comm}

    def import_state(self, state: dict) -> None:
        with torch.no_grad():
            self.grads.copy_(state["grads"])
            self.comm.copy_(state["comm"])
            start = 0
            for s in self.slots:
                s.live.copy_(state["live"].narrow(0, start, s.live.numel()))
                start += s.live.numel()

    def layout(self) -> list:
        return [self.world, self.segment, str(self.comm.dtype), str(self.slots[0].live.dtype),
                [list(s.fsdp_param._orig_size) for s in self.slots]]
