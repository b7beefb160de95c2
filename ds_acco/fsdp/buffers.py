"""FSDP2's parameters as one :class:`~ds_acco.core.round.buffers.BufferGroup` of the shared schedule.

The live weights are FSDP's resident unsharded parameters (one tensor per parameter,
``param_dtype``), the shard parameters are FSDP's sharded DTensor parameters (the ones the user's
optimizer holds), and G is a flat param-major accumulator (``reduce_dtype``) that a
post-accumulate-grad hook adds into.

B is rank-major: rank r's segment is the concatenation, over the parameters, of r's padded dim-0
shard -- the layout of FSDP's own all-gather input -- so a reduce of B and a slice gives this rank
exactly the gradients of its local shards, and an all-gather of the segments gives back every
rank's shards in place. Moving a parameter between its param-major form and B's columns copies
view to view: no temporary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..core.round.buffers import BufferGroup, swap_
from ..core.round.kinds import RoundKind
from . import _torch_internals as fsdp_internals
from ._torch_internals import FSDPParamView


@dataclass(frozen=True)
class Slot:
    """One parameter: where its pieces live in each layout."""
    param: FSDPParamView
    live: torch.Tensor  # the resident unsharded parameter, flattened (a view: writes reach FSDP)
    grad: torch.Tensor  # its gradient in G, flattened (a view)
    offset: int  # start in every rank's segment of B
    padded: int  # elements of one padded dim-0 shard
    local: int  # elements of this rank's (unpadded) shard


class FSDPBuffers(BufferGroup):
    """Maps FSDP2's unsharded / sharded parameters onto the schedule's buffers."""

    _b_holds_params = True  # B also carries the all-gathered parameters (in the model dtype)

    def __init__(self, params: Sequence[FSDPParamView], *, rank: int, world: int, accum_dtype: torch.dtype,
                 live_dtype: torch.dtype, device: torch.device, estimate_dtype: Optional[torch.dtype] = None):
        self.rank, self.world = rank, world
        self.comm_dtype, self.live_dtype = accum_dtype, live_dtype
        self.estimate_dtype = estimate_dtype if estimate_dtype != accum_dtype else None
        self.grads = torch.zeros(sum(p.numel for p in params), dtype=accum_dtype, device=device)  # G, param-major
        slots, offset, start = [], 0, 0
        for p in params:
            live = p.unsharded.detach().view(-1)
            slots.append(Slot(p, live, self.grads.narrow(0, start, p.numel), offset, p.padded_shard_numel,
                              p.local_shard_size.numel()))
            offset += p.padded_shard_numel
            start += p.numel
        self.slots: List[Slot] = slots
        self.segment = offset
        self.comm = self.allocate_comm(world * offset, device, accum_dtype, self.estimate_dtype,
                                       live_dtype if self._b_holds_params else None)

    # -- one parameter between its flat (param-major) form and B's rank-major columns ----------
    def _spans(self, slot: Slot):
        """(rank, start in the flat parameter, length) of each rank's valid rows."""
        n = slot.live.numel()
        for r in range(self.world):
            start = r * slot.padded
            length = max(0, min(slot.padded, n - start))
            yield r, start, length

    def _to_comm(self, slot: Slot, flat: torch.Tensor, comm: torch.Tensor) -> None:
        # Ranks holding a whole shard in one strided copy (Python work per phase stays O(params),
        # not O(params × world)); then at most one partial shard and the empty ones.
        cols = comm.view(self.world, self.segment)
        full = min(self.world, slot.live.numel() // slot.padded) if slot.padded else 0
        if full:
            cols[:full, slot.offset:slot.offset + slot.padded].copy_(flat[:full * slot.padded].view(full, -1))
        for r in range(full, self.world):
            start = r * slot.padded
            length = max(0, min(slot.padded, flat.numel() - start))
            cols[r, slot.offset:slot.offset + length].copy_(flat[start:start + length])
            # keep the padding 0 (another view of B may have left other bytes there)
            cols[r, slot.offset + length:slot.offset + slot.padded].zero_()

    def _from_comm(self, slot: Slot, comm: torch.Tensor, flat: torch.Tensor) -> None:
        cols = comm.view(self.world, self.segment)
        full = min(self.world, slot.live.numel() // slot.padded) if slot.padded else 0
        if full:
            flat[:full * slot.padded].view(full, -1).copy_(cols[:full, slot.offset:slot.offset + slot.padded])
        for r in range(full, self.world):
            start = r * slot.padded
            length = max(0, min(slot.padded, flat.numel() - start))
            if length:
                flat[start:start + length].copy_(cols[r, slot.offset:slot.offset + length])

    # -- BufferGroup ------------------------------------------------------------------------------
    @property
    def shard_params(self) -> List[torch.Tensor]:
        """FSDP's sharded DTensor parameters (what the user's optimizer steps)."""
        return [s.param.sharded for s in self.slots]

    def shard_values(self) -> List[torch.Tensor]:
        return [s.param.sharded.detach().to_local() for s in self.slots]

    def shard_views(self, flat: torch.Tensor, rank: Optional[int] = None) -> List[torch.Tensor]:
        seg = flat.view(self.world, self.segment)[self.rank if rank is None else rank]
        return [seg.narrow(0, s.offset, s.local) for s in self.slots]

    def live_shard_views(self) -> List[torch.Tensor]:
        return [s.live.narrow(0, self.rank * s.padded, s.local) for s in self.slots]

    def param_grads(self, views: List[torch.Tensor]) -> List[torch.Tensor]:
        """This rank's segment of the mean gradient as DTensor gradients with the shards' placements."""
        out = []
        for s, v in zip(self.slots, views):
            local = v.view(s.param.local_shard_size).to(s.param.sharded.dtype)
            out.append(s.param.to_sharded_dtensor(local))
        return out

    def pack_grads(self, kind: RoundKind, clear: bool) -> None:
        comm = self.reduce_view(kind)
        for s in self.slots:
            self._to_comm(s, s.grad, comm)
        if clear:
            self.grads.zero_()

    def unpack_into_live(self) -> None:
        gathered = self.gather_view()
        for s in self.slots:
            self._from_comm(s, gathered, s.live)

    def swap_live_and_gathered(self) -> None:
        cols = self.gather_view().view(self.world, self.segment)
        for s in self.slots:
            for r, start, length in self._spans(s):
                if length:
                    swap_(s.live.narrow(0, start, length), cols[r].narrow(0, s.offset, length))

    def layout(self) -> list:
        return [self.world, self.segment, str(self.comm_dtype), str(self.live_dtype),
                [list(s.param.shape) for s in self.slots]]


class FSDPShardedBuffers(FSDPBuffers):
    """FSDP2 with sharded parameters (``AccoFSDP(..., sharded_params=True)``): FSDP gathers the
    weights layer by layer from the shards for every forward and backward, as it does without ACCO.

    Per rank this holds G (full size, ``reduce_dtype``: FSDP's own no-sync accumulation holds the
    same), B for gradients only (full size, ``reduce_dtype``) and one padded shard E of the
    estimate θ̃ (``param_dtype``, 1/N of the model). No round all-gathers parameters. What the
    forward computes with is chosen by pointing FSDP's all-gather source (``gather_source``) at
    the committed master shards or at E, at phase ends, with no copy in mode ``acco``:

    - an estimate round reads the masters θ_t (FSDP gathers them too: both read) and writes θ̃_{t+1}
      into E; collected, it points FSDP at E for the commit phase;
    - a commit round steps the masters in place (FSDP gathers E meanwhile); collected, it points FSDP
      back at the masters;
    - a commit launched while FSDP gathers the masters (mode ``dpu``: every round is a commit) first
      copies them into E (a shard) and points FSDP at E: the phase computes at θ_t while θ_{t+1} is
      written.
    ``committed_weights`` toggles the source (the masters are committed after the drain).
    """

    _b_holds_params = False
    gathers_params = False

    def __init__(self, params: Sequence[FSDPParamView], **kwargs):
        super().__init__(params, **kwargs)
        # E: every slot's padded shard, in the layout of one rank's segment of B
        self.estimate = torch.zeros(self.segment, dtype=self.live_dtype, device=self.grads.device)
        self._masters = [fsdp_internals.gather_source(s.param) for s in self.slots]
        self.on_estimate = False  # FSDP gathers E (else the masters: FSDP's own source)
        self._packed: Optional[RoundKind] = None  # the kind of the round launched last
        # Called before FSDP's source changes: frees unsharded parameters still resident (FSDP keeps
        # the root's after a forward without backward, e.g. an evaluation) so the next forward
        # gathers from the new source. Set by the adapter.
        self.reshard: Callable[[], None] = lambda: None

    def _padded(self, s: Slot) -> torch.Tensor:
        return self.estimate.narrow(0, s.offset, s.padded)

    def _point_fsdp(self, on_estimate: bool) -> None:
        if on_estimate == self.on_estimate:
            return
        self.reshard()
        for s, master in zip(self.slots, self._masters):
            fsdp_internals.set_gather_source(s.param, self._padded(s) if on_estimate else master)
        self.on_estimate = on_estimate

    def reset(self) -> None:
        super().reset()
        self._packed = None
        self._point_fsdp(False)

    def restore_fsdp(self) -> None:
        """Point FSDP back at the master shards (close): plain FSDP at the committed θ."""
        self._point_fsdp(False)

    def param_outputs(self, kind: RoundKind) -> Optional[List[torch.Tensor]]:
        if kind is RoundKind.COMMIT:
            return None  # the masters are the output; FSDP reads them after the collect
        return [self.estimate.narrow(0, s.offset, s.local) for s in self.slots]

    def live_shard_views(self) -> List[torch.Tensor]:
        """This rank's shard of what the forward computes with now."""
        if self.on_estimate:
            return [self.estimate.narrow(0, s.offset, s.local) for s in self.slots]
        return [v.reshape(-1) for v in self.shard_values()]

    def pack_grads(self, kind: RoundKind, clear: bool) -> None:
        if kind is RoundKind.COMMIT and not self.on_estimate:
            # the commit writes the masters FSDP gathers from: the phase computes at a copy
            torch._foreach_copy_([self._padded(s) for s in self.slots], self._masters)
            self._point_fsdp(True)
        super().pack_grads(kind, clear)
        self._packed = kind

    def unpack_into_live(self) -> None:
        self._point_fsdp(self._packed is RoundKind.ESTIMATE)

    def swap_live_and_gathered(self) -> None:
        self._point_fsdp(not self.on_estimate)

    def gather_view(self) -> torch.Tensor:
        raise RuntimeError("FSDPShardedBuffers: rounds gather no parameters (B carries gradients only)")

    def export_state(self, swapped: bool, gathered_shard: Optional[list] = None) -> dict:
        """G, E (this rank's shard) and which of the two FSDP gathers: no collective. ``gathered_shard``
        (mode one_round's set-aside segment) is always None here: that mode is refused under FSDP."""
        return {"grads": self.grads.detach().to("cpu", copy=True),
                "estimate_shard": self.estimate.detach().to("cpu", copy=True),
                "on_estimate": self.on_estimate != swapped, "packed": None if self._packed is None else self._packed.value}

    def import_state(self, state: dict, gather) -> None:
        with torch.no_grad():
            self.grads.copy_(state["grads"])
            self.estimate.copy_(state["estimate_shard"])
        self._packed = None if state["packed"] is None else RoundKind(state["packed"])
        self._point_fsdp(state["on_estimate"])

    def layout(self) -> list:
        return super().layout() + ["sharded_params"]

