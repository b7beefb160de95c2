"""The ACCO / DPU schedule of ACCO.md, on flat buffers. No DeepSpeed or FSDP imports.

Per parameter group an adapter hands over three full-size flat tensors and one shard:
  ``live``   the weights the compute lane uses (model dtype),
  ``grads``  ``G``: the local accumulator the backward pass adds into,
  ``comm``   ``B``: the one extra buffer; a round reduces gradients out of it and all-gathers
             the new parameters back into it, so it also carries θ̃ / θ to the next swap,
  ``master`` this rank's fp32 master shard θ[r] (the optimizer's parameter).

Phases and rounds (mode 'acco'):
  bootstrap -- compute at θ_0 into G ---------------------------------------> B ← G, round E_0
  phase E_t -- compute g_t at θ_t into G (G still holds Σg̃_t) ---- round E_t: θ̃_{t+1}, discarded S
  swap      -- model ← θ̃_{t+1}; B ← G (full batch); G ← 0; round C_t
  phase C_t -- compute g̃_{t+1} at θ̃_{t+1} into G ------------------ round C_t: θ_{t+1}, S_{t+1} kept
  swap      -- model ← θ_{t+1}; commit callback (LR scheduler); B ← G (Σg̃_{t+1}); round E_{t+1}
Mode 'dpu' has only commit rounds: at each phase end, model ← θ_k, B ← G, G ← 0, round k.
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from ..comm import collectives
from ..comm.lane import CommLane, RoundHandle
from .shard_optimizer import ShardOptimizer, global_norm_sq


class RoundKind(str, enum.Enum):
    ESTIMATE = "estimate"
    COMMIT = "commit"


class PhaseKind(str, enum.Enum):
    BOOTSTRAP = "bootstrap"  # first phase: nothing in flight yet
    ESTIMATE = "estimate"  # an estimate round is in flight; the model is at θ_t
    COMMIT = "commit"  # a commit round is in flight; the model is at θ̃_{t+1} (acco) or θ_{k-1} (dpu)


@dataclass
class FlatGroup:
    """The flat tensors of one parameter group (see the module docstring)."""
    live: torch.Tensor
    grads: torch.Tensor
    comm: torch.Tensor
    master: torch.Tensor

    def __post_init__(self):
        n = self.live.numel()
        if self.grads.numel() != n or self.comm.numel() != n:
            raise ValueError("live, grads and comm must have the same length")


@dataclass
class RoundResult:
    """What a finished round reports back to the compute lane."""
    kind: RoundKind
    step: int  # optimizer step t this round belongs to
    local_count: float
    global_count: float
    grad_norm: float  # norm of the global mean gradient, before clipping
    started_at: float = 0.0
    finished_at: float = 0.0


@dataclass
class _InFlight:
    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)


@dataclass
class ScheduleEvents:
    """Counters a test or a metrics reader may look at (no synchronisation involved)."""
    micro_batches: int = 0
    rounds: List[RoundResult] = field(default_factory=list)
    wait_s: float = 0.0  # time the compute lane spent blocked on rounds


class AccoSchedule:
    """Owns the phases, the rounds and the swaps for one set of flat groups.

    Args:
        groups: the flat tensors per parameter group.
        shard_optimizer: steps the master shards (estimate or commit).
        lane: where rounds run.
        group, rank, world: the dedicated process group of the rounds and this rank's place in it.
        mode: 'acco' or 'dpu'.
        micro_batches_per_phase: A/2 for acco, A for dpu (fixed accumulation).
        grad_scale: the factor each micro-batch gradient carries in G (DeepSpeed scales the loss
            by 1/A); the round divides by ``count * grad_scale`` to get the mean.
        clip_grad: clip the global mean gradient of each round to this norm (0: off).
        on_commit: called on the compute lane once per committed step, after θ_{t+1} is known
            and before the next round is launched (the LR scheduler advances there).
    """

    def __init__(self, groups: Sequence[FlatGroup], shard_optimizer: ShardOptimizer, lane: CommLane, *, group,
                 rank: int, world: int, mode: str, micro_batches_per_phase: int, grad_scale: float = 1.0,
                 clip_grad: float = 0.0, reduce_scatter: bool = False,
                 on_commit: Optional[Callable[[RoundResult], None]] = None):
        if mode not in ("acco", "dpu"):
            raise ValueError(f"mode must be 'acco' or 'dpu', got {mode!r}")
        self.groups = list(groups)
        self.shard_optimizer = shard_optimizer
        self.lane = lane
        self.group, self.rank, self.world = group, rank, world
        self.mode = mode
        self.micro_batches_per_phase = micro_batches_per_phase
        self.grad_scale = grad_scale
        self.clip_grad = clip_grad
        self.reduce_scatter = reduce_scatter
        self.on_commit = on_commit
        self.phase = PhaseKind.BOOTSTRAP
        self.step_index = 0  # t: the optimizer step whose data the compute lane is producing
        self.committed_steps = 0
        self.phase_micro_batches = 0  # micro-batches in the current phase
        self.accumulated = 0.0  # micro-batches summed into G since it was last cleared
        self._inflight: Optional[_InFlight] = None
        self.events = ScheduleEvents()
        for g in self.groups:
            g.grads.zero_()

    # -- the compute lane's calls ---------------------------------------------------------
    def record_micro_batch(self, count: float = 1.0) -> None:
        """Note one finished backward pass whose gradient now sits in G."""
        self.phase_micro_batches += 1
        self.accumulated += count
        self.events.micro_batches += 1

    def phase_ends(self, micro_batches_done: Optional[int] = None) -> bool:
        """Whether the phase ends after the micro-batch now being computed (fixed accumulation)."""
        done = self.phase_micro_batches if micro_batches_done is None else micro_batches_done
        return done + 1 >= self.micro_batches_per_phase

    def end_phase(self) -> None:
        """Phase boundary: collect the round in flight, swap, launch the next round."""
        if self.mode == "dpu":
            self._end_phase_dpu()
        elif self.phase is PhaseKind.BOOTSTRAP:
            self._launch(RoundKind.ESTIMATE, clear_grads=False)
            self.phase = PhaseKind.ESTIMATE
        elif self.phase is PhaseKind.ESTIMATE:
            self._collect_into_live()  # model ← θ̃_{t+1}
            self._launch(RoundKind.COMMIT, clear_grads=True)  # the full batch of step t
            self.phase = PhaseKind.COMMIT
        else:
            self._collect_into_live()  # model ← θ_{t+1}
            self.step_index += 1
            self._launch(RoundKind.ESTIMATE, clear_grads=False)  # Σg̃_{t+1}, kept in G
            self.phase = PhaseKind.ESTIMATE
        self.phase_micro_batches = 0

    def _end_phase_dpu(self) -> None:
        if self.phase is not PhaseKind.BOOTSTRAP:
            self._collect_into_live()
            self.step_index += 1
        self._launch(RoundKind.COMMIT, clear_grads=True)
        self.phase = PhaseKind.COMMIT

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (if any); a finished commit is booked as committed."""
        if self._inflight is None:
            return None
        return self._wait(self._inflight)

    @contextlib.contextmanager
    def committed_weights(self):
        """Inside: ``live`` holds the newest committed θ; on exit, the live state is restored."""
        self.drain()
        inflight = self._inflight
        swap = inflight is not None and inflight.kind is RoundKind.COMMIT
        if swap:  # comm holds θ_{t+1}, live holds θ̃_{t+1} (acco) or θ_t (dpu)
            for g in self.groups:
                _swap_(g.live, g.comm)
        try:
            yield
        finally:
            if swap:
                for g in self.groups:
                    _swap_(g.live, g.comm)

    def close(self) -> None:
        """Drain and stop the lane."""
        try:
            self.drain()
        finally:
            self.lane.close()

    # -- internals ------------------------------------------------------------------------
    def _launch(self, kind: RoundKind, clear_grads: bool) -> None:
        for g in self.groups:
            g.comm.copy_(g.grads)
            if clear_grads:
                g.grads.zero_()
        count = self.accumulated
        if clear_grads:
            self.accumulated = 0.0
        step = self.step_index
        handle = self.lane.submit(f"{kind.value} {step}", lambda: self._round(kind, step, count))
        self._inflight = _InFlight(handle, kind, step)

    def _wait(self, inflight: _InFlight) -> RoundResult:
        if inflight.result is None:
            t0 = time.perf_counter()
            inflight.result = self.lane.wait(inflight.handle)
            self.events.wait_s += time.perf_counter() - t0
            self.events.rounds.append(inflight.result)
        if inflight.kind is RoundKind.COMMIT and not inflight.committed:
            inflight.committed = True
            self.committed_steps += 1
            if self.on_commit is not None:
                self.on_commit(inflight.result)
        return inflight.result

    def _collect_into_live(self) -> None:
        self._wait(self._inflight)
        for g in self.groups:
            g.live.copy_(g.comm)
        self._inflight = None

    def _round(self, kind: RoundKind, step: int, local_count: float) -> RoundResult:
        """One communication round; runs on the lane. Touches only comm, master and the optimizer."""
        started = time.perf_counter()
        device = self.groups[0].comm.device
        counts = collectives.sum_scalars(torch.tensor([local_count], dtype=torch.float64, device=device), self.group)
        global_count = float(counts[0])
        if global_count <= 0:
            raise RuntimeError(f"round '{kind.value} {step}': no micro-batch on any rank")
        denom = global_count * self.grad_scale
        grads = []
        for g in self.groups:
            summed = collectives.reduce_to_shard(g.comm, self.rank, self.world, self.group, self.reduce_scatter)
            grads.append(summed.to(torch.float32).div_(denom) if summed.dtype != torch.float32 else summed / denom)
        norm_sq = collectives.sum_scalars(global_norm_sq(grads), self.group)
        grad_norm = float(norm_sq.sqrt())
        if self.clip_grad > 0:
            # DeepSpeed's rule: divide by max(1, (norm + 1e-6) / clip).
            factor = max(1.0, (grad_norm + 1e-6) / self.clip_grad)
            if factor > 1.0:
                for gr in grads:
                    gr.mul_(1.0 / factor)
        outs = [torch.empty(g.master.numel(), dtype=g.comm.dtype, device=g.comm.device) for g in self.groups]
        if kind is RoundKind.COMMIT:
            self.shard_optimizer.commit(grads, outs)
        else:
            self.shard_optimizer.estimate(grads, outs)
        del grads
        for g, out in zip(self.groups, outs):
            collectives.gather_shards(out, g.comm, self.group)
        return RoundResult(kind, step, local_count, global_count, grad_norm, started, time.perf_counter())


def _swap_(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 20) -> None:
    """Exchange the contents of two equal flat tensors with a small temporary."""
    tmp = torch.empty(min(chunk, a.numel()), dtype=a.dtype, device=a.device)
    for start in range(0, a.numel(), chunk):
        n = min(chunk, a.numel() - start)
        x, y, t = a.narrow(0, start, n), b.narrow(0, start, n), tmp.narrow(0, 0, n)
        t.copy_(x)
        x.copy_(y)
        y.copy_(t)
