"""The buffers of one parameter group, as the schedule sees them (ACCO.md's G and B).

Per group an adapter hands over:
  G (``grads``)  the local accumulator the backward pass adds into (full size, accumulation dtype);
  B (``comm``)   the one extra buffer ACCO may hold (full size). A round reduces gradients in it
                 and all-gathers the new parameters back into it, so it also carries θ̃ / θ to the
                 next swap. It is raw bytes viewed in two dtypes: the dtype gradients travel in
                 (``reduce_view``) and the model dtype parameters travel in (``gather_view``), so
                 parameters go on the wire in the model dtype (stock ZeRO-1's bytes) even when
                 gradients travel in fp32. Both views start at byte 0; B is as large as the wider.
  live           the weights the compute lane uses (model dtype);
  shards         this rank's parameters of the optimizer (its fp32 master shard θ[r]).

B is rank-major: rank r's segment (``segment`` elements) holds what rank r owns, so a reduce and a
slice gives a rank its shard's gradient and an all-gather of the segments gives every rank every
shard. :class:`BufferGroup` states what the schedule needs; :class:`FlatBuffers` is DeepSpeed's
layout (everything flat, live and B in the same order); the FSDP2 adapter has its own.
"""
from __future__ import annotations

import abc
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .kinds import RoundKind

_SWAP_CHUNK = 1 << 20

ESTIMATE_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes ``acco.estimate_comm_dtype`` names: what an estimate round reduces gradients in
(:attr:`BufferGroup.estimate_dtype`)."""


def estimate_comm_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The :attr:`BufferGroup.estimate_dtype` that ``acco.estimate_comm_dtype = name`` asks for
    (None when it is not set: estimate rounds reduce in ``comm_dtype``)."""
    return ESTIMATE_COMM_DTYPES[name] if name else None


def view_as(storage: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of a uint8 buffer, as ``dtype``."""
    return storage[:numel * torch.empty(0, dtype=dtype).element_size()].view(dtype)


def swap_(a: torch.Tensor, b: torch.Tensor, chunk: int = _SWAP_CHUNK) -> None:
    """Exchange the contents of two equal-length flat tensors through one small temporary."""
    tmp = torch.empty(min(chunk, a.numel()), dtype=a.dtype, device=a.device)
    for start in range(0, a.numel(), chunk):
        n = min(chunk, a.numel() - start)
        x, y, t = a.narrow(0, start, n), b.narrow(0, start, n), tmp.narrow(0, 0, n)
        t.copy_(x)
        x.copy_(y)
        y.copy_(t)


class BufferGroup(abc.ABC):
    """One parameter group's G, B, live weights and shards; subclasses map their framework's
    tensors onto it. Set ``rank``, ``world``, ``segment``, ``grads``, ``comm`` (uint8),
    ``comm_dtype``, ``live_dtype`` and ``estimate_dtype`` (None: ``comm_dtype``)."""

    rank: int
    world: int
    segment: int  # elements of one rank's part of B
    grads: torch.Tensor  # G
    comm: torch.Tensor  # B's bytes
    comm_dtype: torch.dtype
    live_dtype: torch.dtype
    estimate_dtype: Optional[torch.dtype] = None
    # (start, length) runs of this rank's shard that count in the gradient norm (None: all of it).
    # Tensor parallelism: replicated parameters count on tensor-parallel rank 0 only (stock's rule).
    norm_ranges: Optional[List[Tuple[int, int]]] = None
    # Whether rounds all-gather the new parameters into B (False: the framework gathers them from
    # the shards itself, FSDP2 with sharded parameters; B then carries gradients only).
    gathers_params: bool = True

    @staticmethod
    def allocate_comm(numel: int, device, *dtypes: Optional[torch.dtype]) -> torch.Tensor:
        """B: ``numel`` elements of the widest of ``dtypes``, zeroed (FSDP's shard padding stays 0)."""
        width = max(torch.empty(0, dtype=d).element_size() for d in dtypes if d is not None)
        return torch.zeros(numel * width, dtype=torch.uint8, device=device)

    # -- B's two views ------------------------------------------------------------------------
    def reduce_view(self, kind: Optional[RoundKind]) -> torch.Tensor:
        """B as the dtype a round of ``kind`` reduces gradients in (estimate rounds may be narrower)."""
        dtype = self.estimate_dtype if kind is RoundKind.ESTIMATE and self.estimate_dtype else self.comm_dtype
        return view_as(self.comm, dtype, self.world * self.segment)

    def gather_view(self) -> torch.Tensor:
        """B as the model dtype: where rounds all-gather parameters."""
        return view_as(self.comm, self.live_dtype, self.world * self.segment)

    # -- G ---------------------------------------------------------------------------------------
    def zero_grads(self) -> None:
        self.grads.zero_()

    def reset(self) -> None:
        """A fresh bootstrap phase at the committed weights (the schedule's reset): G ← 0; a layout
        that chooses where the forward reads its weights reads the committed ones again."""
        self.zero_grads()

    def scale_grads(self, factor: float) -> None:
        """G ← factor · G (a loss-scale change: a power of two, exact)."""
        self.grads.mul_(factor)

    # -- what the layout defines ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def shard_params(self) -> List[torch.Tensor]:
        """The optimizer's parameters for this rank's shard of the group."""

    @abc.abstractmethod
    def shard_values(self) -> List[torch.Tensor]:
        """The shard parameters' local values (plain tensors, same order), read in place."""

    @abc.abstractmethod
    def shard_views(self, flat: torch.Tensor, rank: Optional[int] = None) -> List[torch.Tensor]:
        """Views of a rank-major flat view of B laid out like this rank's shard values, placed in
        ``rank``'s segment (default: this rank's)."""

    @abc.abstractmethod
    def live_shard_views(self) -> List[torch.Tensor]:
        """Views of the live weights at this rank's shard (read by the drift metric)."""

    def norm_pieces(self, shard_grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The parts of this rank's shard gradients (laid out like ``shard_views``) that count in
        the gradient norm: all of them unless ``norm_ranges`` says otherwise."""
        if self.norm_ranges is None:
            return list(shard_grads)
        raise NotImplementedError(f"{type(self).__name__} has norm_ranges but no norm_pieces")

    def param_outputs(self, kind: RoundKind) -> Optional[List[torch.Tensor]]:
        """Where a round of ``kind`` writes this rank's new parameters (θ̃ or θ, laid out like
        ``shard_values``) for the all-gather: this rank's segment of B's gather view. None: the
        round writes none (the framework reads the committed shards themselves)."""
        return self.shard_views(self.gather_view())

    def param_grads(self, views: List[torch.Tensor]) -> List[torch.Tensor]:
        """Gradients for ``shard_params`` from per-shard tensors (FSDP wraps them as DTensors)."""
        return list(views)

    @abc.abstractmethod
    def pack_grads(self, kind: RoundKind, clear: bool) -> None:
        """B (``reduce_view(kind)``) ← G; then G ← 0 if ``clear``."""

    @abc.abstractmethod
    def unpack_into_live(self) -> None:
        """Live weights ← the parameters a round all-gathered into ``gather_view()``."""

    @abc.abstractmethod
    def swap_live_and_gathered(self) -> None:
        """Exchange the live weights and the gathered parameters in B (``committed_weights``)."""

    @property
    def lends_live(self) -> bool:
        """Whether :meth:`point_live` can move the model between the live weights and B's gathered
        parameters by reference (the parameters are views the adapter re-points)."""
        return False

    def point_live(self, at_gathered: bool) -> None:
        """The model's parameters view B's gathered parameters (``at_gathered``) or the live weights
        again: no copy. After a hold the live weights keep θ for what an export aliased while the
        compute lane runs on the other buffer (see :mod:`.committed`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot re-point its parameters")

    # -- in-flight state for checkpoints: G whole, the rest as this rank's shard ------------------
    def export_state(self, swapped: bool, gathered_shard: Optional[list] = None) -> dict:
        """G, and this rank's shard of the live weights and of B's gathered parameters, as the
        compute lane sees them (CPU copies). Live weights and gathered parameters are the same on
        every rank, so the shards are enough: :meth:`import_state` all-gathers them back. ``swapped``:
        inside ``committed_weights``, where the two hold each other's contents; ``gathered_shard``: B's
        own segment set aside there (mode one_round: B then carries θ)."""
        live, gathered = self.live_shard_views(), self.shard_views(self.gather_view())
        if swapped:
            live, gathered = gathered, live
        if gathered_shard is not None:
            gathered = gathered_shard
        cpu = lambda views: [v.detach().to("cpu", copy=True) for v in views]  # noqa: E731
        return {"grads": self.grads.detach().to("cpu", copy=True), "live_shard": cpu(live),
                "gathered_shard": cpu(gathered)}

    def import_state(self, state: dict, gather: Callable[[torch.Tensor], None]) -> None:
        """Restore :meth:`export_state`'s output. ``gather(flat)`` all-gathers every rank's segment
        of a rank-major flat tensor in place (a collective: every rank imports at once). B carries
        the live weights first, then its own gathered parameters: no other full-size buffer."""
        with torch.no_grad():
            self.grads.copy_(state["grads"])
            flat = self.gather_view()
            for key in ("live_shard", "gathered_shard"):
                for dst, src in zip(self.shard_views(flat), state[key], strict=True):
                    dst.copy_(src)
                gather(flat)
                if key == "live_shard":
                    self.unpack_into_live()

    @abc.abstractmethod
    def layout(self) -> list:
        """What must match for a saved state to be restored here."""


class FlatBuffers(BufferGroup):
    """DeepSpeed's flat layout: live weights, G and B share one element order (padded to
    ``world × segment``), and the shard is one flat fp32 master tensor."""

    def __init__(self, live: torch.Tensor, grads: torch.Tensor, master: torch.Tensor, *, rank: int, world: int,
                 comm_dtype: torch.dtype, estimate_dtype: Optional[torch.dtype] = None):
        n = live.numel()
        if grads.numel() != n or n % world or master.numel() != n // world:
            raise ValueError(f"flat group sizes do not fit: live {n}, grads {grads.numel()}, master {master.numel()}, "
                             f"world {world}")
        self.live, self.grads, self.master = live, grads, master
        self.rank, self.world, self.segment = rank, world, n // world
        self.comm_dtype, self.live_dtype = comm_dtype, live.dtype
        self.estimate_dtype = estimate_dtype if estimate_dtype != comm_dtype else None
        self.comm = self.allocate_comm(n, live.device, comm_dtype, live.dtype, self.estimate_dtype)
        # Called with the new G after G and B swapped storage (pack_grads): the adapter re-points
        # the parameters' gradient views.
        self.on_grads_moved: Optional[Callable[[torch.Tensor], None]] = None
        # Called with a flat tensor laid out like ``live`` (``live`` itself or B's gather view): the
        # adapter re-points the parameters at it (point_live).
        self.on_live_moved: Optional[Callable[[torch.Tensor], None]] = None

    @property
    def shard_params(self) -> List[torch.Tensor]:
        return [self.master]

    def shard_values(self) -> List[torch.Tensor]:
        return [self.master.detach()]

    def shard_views(self, flat: torch.Tensor, rank: Optional[int] = None) -> List[torch.Tensor]:
        r = self.rank if rank is None else rank
        return [flat.narrow(0, r * self.segment, self.segment)]

    def live_shard_views(self) -> List[torch.Tensor]:
        return [self.live.narrow(0, self.rank * self.segment, self.segment)]

    def norm_pieces(self, shard_grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.norm_ranges is None:
            return list(shard_grads)
        (flat,) = shard_grads
        return [flat.narrow(0, start, n) for start, n in self.norm_ranges]

    def set_norm_params(self, offsets: Sequence[Tuple[int, int]]) -> None:
        """Count only the parameters at ``offsets`` ((start, numel) in the flat group) in the norm:
        their runs inside this rank's segment, adjacent runs merged (a handful per layer)."""
        lo, hi = self.rank * self.segment, (self.rank + 1) * self.segment
        runs: List[Tuple[int, int]] = []
        for start, n in sorted(offsets):
            a, b = max(start, lo), min(start + n, hi)
            if a >= b:
                continue
            if runs and runs[-1][0] + runs[-1][1] == a - lo:
                runs[-1] = (runs[-1][0], runs[-1][1] + b - a)
            else:
                runs.append((a - lo, b - a))
        self.norm_ranges = runs

    def swaps_with_g(self, kind: RoundKind) -> bool:
        """Whether B ← G can be an exchange of storage instead of a copy: G is cleared (a commit),
        B is exactly G's bytes and reduces in G's dtype, and an adapter re-points its views."""
        return (self.on_grads_moved is not None and self.reduce_view(kind).dtype == self.grads.dtype
                and self.comm.numel() == self.grads.numel() * self.grads.element_size())

    def pack_grads(self, kind: RoundKind, clear: bool) -> None:
        if clear and self.swaps_with_g(kind):
            # B ← G without a full-size copy: the round gets G's storage, G takes B's (zeroed)
            self.grads, self.comm = self.comm.view(self.grads.dtype), self.grads.view(torch.uint8)
            self.grads.zero_()
            self.on_grads_moved(self.grads)
            return
        self.reduce_view(kind).copy_(self.grads)
        if clear:
            self.grads.zero_()

    def unpack_into_live(self) -> None:
        self.live.copy_(self.gather_view())

    def swap_live_and_gathered(self) -> None:
        swap_(self.live, self.gather_view())

    @property
    def lends_live(self) -> bool:
        return self.on_live_moved is not None

    def point_live(self, at_gathered: bool) -> None:
        self.on_live_moved(self.gather_view() if at_gathered else self.live)

    def layout(self) -> list:
        return [self.world * self.segment, str(self.comm_dtype), str(self.live_dtype)]
