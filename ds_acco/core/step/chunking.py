"""How a round walks through this rank's shard: the chunk size for a device, and windows of at
most one chunk over a list of tensors.

A round's temporaries (the fp64 copy the gradient norm is summed from, the functional step's
workspace, the drift metric's buffers) are a few chunk-sized buffers, whatever the shard size.
Its kernel count follows the number of windows: every window is one foreach (or fused) kernel per
operation over the pieces of all the tensors it spans, so hundreds of FSDP2 parameter tensors
cost no more kernels than one flat DeepSpeed master of the same size.

:func:`chunk_elements` is the one place that chooses the chunk:

* an explicit ``acco.chunk_elements`` is taken as given;
* CPU: 2 Mi elements, and at most 1/64 of the shard (not below 256 Ki, nor below 64 Ki per rank), so
  small models do not pay the default's megabytes beside the compute lane's activations; the floor is
  gloo's: its all-gather travels through a chunk-sized buffer in pieces of chunk / world elements per
  rank (comm/collectives.py), and pieces of 32 Ki per rank paid a per-call cost (2 ranks, a 16 MB gather
  over 1 Gbit/s: 0.12-0.14 s in 32 Ki-per-rank pieces, 0.07 s in 64-128 Ki, 0.08 s in one call;
  docs/bench/emulation-one-round; measured at 2 ranks only);
* accelerators: launches cost more than bytes there, so 64 Mi elements (a 7B model's shard on 8
  ranks is then 14 windows), or the whole shard when it is smaller.

Every chunk, chosen or given, is at most :data:`MAX_CHUNK_ELEMS` (64 Mi elements): a round's
temporaries are then at most ``WORKSPACE_BYTES_PER_ELEMENT × chunk`` bytes (1.5 GiB), which on an
accelerator the lane's side stream keeps cached between rounds (docs/design.md, "Memory per rank").
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional, Sequence, Union

import torch

CPU_CHUNK_ELEMS = 1 << 21
"""CPU: 2 Mi elements, 8 MiB per fp32 buffer."""
CPU_MIN_CHUNK_ELEMS = 1 << 18
"""CPU: the 1/64-of-the-shard bound never goes below this (1 MiB per fp32 buffer; gloo's gather pieces)."""
GLOO_MIN_PIECE_ELEMS = 1 << 16
"""CPU: nor below this many elements per rank of gloo's gather pieces (the chunk is shared by the ranks)."""
ACCELERATOR_CHUNK_ELEMS = 1 << 26
"""Accelerators: 64 Mi elements (256 MiB per fp32 buffer)."""
MAX_CHUNK_ELEMS = 1 << 26
"""The hard bound of every chunk (``acco.chunk_elements`` above it is refused): 64 Mi elements."""
WORKSPACE_BYTES_PER_ELEMENT = 24
"""The most any round function holds per chunk element at once: DeepSpeedCPUAdam's emulation
(four fp32 buffers and one fp64); torch Adam's estimate holds four fp32 buffers (16), the norm one
fp64 buffer (8), the drift metric two fp32 (8)."""
ALIGN = 64
"""Windows split a tensor only at multiples of this many elements from its start (when the chunk
is at least that large): kernels that treat a tensor's last ``numel % vector width`` elements
apart (torch's CPU fused Adam) then compute every element of a piece as they would in the whole
tensor."""


def chunk_elements(device: Union[torch.device, str], shard_elems: int, requested: Optional[int] = None,
                   world: int = 1) -> int:
    """Elements per chunk for a round over ``shard_elems`` elements on ``device``, at most
    :data:`MAX_CHUNK_ELEMS`.

    ``requested``: the user's ``acco.chunk_elements`` (None: chosen here). A result at least
    ``shard_elems`` means unchunked: buffers are never larger than what a call walks through.
    ``world``: the ranks a round's all-gather spans (CPU: each rank's piece of gloo's gather is
    chunk / world elements, kept at least :data:`GLOO_MIN_PIECE_ELEMS` up to the 2 Mi cap)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or not 1 <= requested <= MAX_CHUNK_ELEMS:
            raise ValueError(f"chunk_elements = {requested!r}: must be an integer from 1 to {MAX_CHUNK_ELEMS} (the "
                             "bound of a round's temporaries); fix: pass such a number of elements, or None to "
                             "choose per device")
        return requested
    shard = max(1, int(shard_elems))
    if torch.device(device).type == "cpu":
        floor = max(CPU_MIN_CHUNK_ELEMS, max(1, int(world)) * GLOO_MIN_PIECE_ELEMS)
        return min(CPU_CHUNK_ELEMS, max(floor, shard // 64))
    return ACCELERATOR_CHUNK_ELEMS  # the whole shard when smaller: buffers are sized min(chunk, what a call walks)


class Piece(NamedTuple):
    """Part of one tensor inside a window."""
    index: int  # which tensor of the list
    start: int  # its first element in that tensor
    n: int  # elements
    at: int  # its first element in the window (where its workspace lies)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, the tensor a round walks through: an FSDP2 DTensor's local shard
    (``to_local()``), any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def windows(numels: Sequence[int], chunk: int) -> Iterator[List[Piece]]:
    """Consecutive windows of at most ``chunk`` elements over the tensors (sizes ``numels``) laid
    end to end, in order: each window is the pieces it holds. A tensor is split only at multiples
    of :data:`ALIGN` from its start (any position when ``chunk < ALIGN``)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    align = ALIGN if chunk >= ALIGN else 1
    window: List[Piece] = []
    used = 0
    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            room = chunk - used
            n = numel - start
            if n > room:
                n = room - room % align
            if n == 0:  # too little room left for an aligned piece: the next window takes it
                yield window
                window, used = [], 0
                continue
            window.append(Piece(index, start, n, used))
            used += n
            start += n
            if used == chunk:
                yield window
                window, used = [], 0
    if window:
        yield window


def window_size(window: Sequence[Piece]) -> int:
    """Elements a window spans (its pieces are packed from 0)."""
    last = window[-1]
    return last.at + last.n


def pieces_of(tensors: Sequence[torch.Tensor], window: Sequence[Piece]) -> List[torch.Tensor]:
    """The window's pieces of flat ``tensors``: a tensor the window holds whole as it is, a part of
    one as a view."""
    out = []
    for p in window:
        t = tensors[p.index]
        out.append(t if p.start == 0 and p.n == t.numel() else t.narrow(0, p.start, p.n))
    return out


def slots_in(buffer: torch.Tensor, window: Sequence[Piece]) -> List[torch.Tensor]:
    """Each piece's place in a window-sized flat ``buffer``, as views."""
    return [buffer.narrow(0, p.at, p.n) for p in window]
