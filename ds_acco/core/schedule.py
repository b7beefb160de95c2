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

import collections
import contextlib
import enum
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Sequence

import torch

from ..comm import collectives
from ..comm.lane import CommLane, RoundHandle
from .shard_optimizer import ShardOptimizer, global_norm_sq


class NonFiniteGradientError(FloatingPointError):
    """A round's global mean gradient had an inf or NaN and ``nonfinite`` is 'raise'."""


class RoundKind(str, enum.Enum):
    ESTIMATE = "estimate"
    COMMIT = "commit"


class PhaseKind(str, enum.Enum):
    BOOTSTRAP = "bootstrap"  # first phase: nothing in flight yet
    ESTIMATE = "estimate"  # an estimate round is in flight; the model is at θ_t
    COMMIT = "commit"  # a commit round is in flight; the model is at θ̃_{t+1} (acco) or θ_{k-1} (dpu)


class FlatGroup:
    """One parameter group as the schedule sees it: where gradients accumulate (G), the
    communication buffer (B: full size, rank-major shards), the live weights, and this rank's
    shard of the optimizer's parameters.

    This default holds everything as flat tensors laid out like B (DeepSpeed's flat groups).
    An adapter whose live weights or shard parameters are not flat views of that layout
    (FSDP2's unsharded parameters and DTensor shards) overrides the packing methods.
    """

    def __init__(self, live: torch.Tensor, grads: torch.Tensor, comm: torch.Tensor, master: torch.Tensor,
                 estimate_dtype: Optional[torch.dtype] = None):
        n = live.numel()
        if grads.numel() != n or comm.numel() != n:
            raise ValueError("live, grads and comm must have the same length")
        self.live, self.grads, self.comm, self.master = live, grads, comm, master
        self._estimate_comm = comm
        if estimate_dtype is not None and estimate_dtype != comm.dtype:
            # A narrower dtype for estimate rounds, in the same storage: the estimate is discarded,
            # so only its precision drops, and it sends fewer bytes.
            if torch.empty(0, dtype=estimate_dtype).element_size() > comm.element_size():
                raise ValueError("the estimate round's dtype cannot be wider than the communication dtype")
            self._estimate_comm = comm.view(torch.uint8)[:n * torch.empty(0, dtype=estimate_dtype).element_size()] \
                .view(estimate_dtype)

    def comm_for(self, kind: "RoundKind") -> torch.Tensor:
        """The buffer a round of ``kind`` reduces and gathers in (B, or a narrower view of it)."""
        return self._estimate_comm if kind is RoundKind.ESTIMATE else self.comm

    @property
    def shard_params(self) -> List[torch.Tensor]:
        """The optimizer's parameters for this rank's shard of the group."""
        return [self.master]

    def split_shard_grad(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """This rank's flat fp32 shard of the mean gradient, as gradients of ``shard_params``."""
        return [flat]

    def read_shard(self, copy: bool = True) -> torch.Tensor:
        """This rank's shard parameters as one flat fp32 tensor (B's layout); with ``copy`` False
        it may be the parameters' own storage (read-only use, before the next step)."""
        return self.master.detach().to(torch.float32, copy=copy)

    def pack_grads(self, clear: bool, kind: "RoundKind" = None) -> None:
        """B ← G (cast to the round's dtype); then G ← 0 if ``clear``."""
        self.comm_for(kind).copy_(self.grads)
        if clear:
            self.grads.zero_()

    def unpack_into_live(self, kind: "RoundKind" = None) -> None:
        """Live weights ← the parameters all-gathered into B by a round of ``kind``."""
        self.live.copy_(self.comm_for(kind))

    def swap_live_and_comm(self) -> None:
        _swap_(self.live, self.comm)

    def zero_grads(self) -> None:
        self.grads.zero_()

    def scale_grads(self, factor: float) -> None:
        """G ← factor · G (a loss-scale change: a power of two, exact)."""
        self.grads.mul_(factor)

    def export_state(self, swapped: bool) -> dict:
        """G, the live weights and B as the compute lane sees them (CPU copies)."""
        live, comm = (self.comm, self.live) if swapped else (self.live, self.comm)
        return {k: t.detach().to("cpu", copy=True) for k, t in (("grads", self.grads), ("live", live),
                                                                 ("comm", comm))}

    def import_state(self, state: dict) -> None:
        with torch.no_grad():
            for k in ("grads", "live", "comm"):
                getattr(self, k).copy_(state[k])

    def layout(self) -> list:
        """What must match for a saved state to be restored here."""
        return [self.comm.numel(), str(self.comm.dtype)]


@dataclass
class Tally:
    """Micro-batches and their weight (1 each, or samples / tokens) summed into a buffer."""
    micro_batches: int = 0
    weight: float = 0.0

    def add(self, other: "Tally") -> "Tally":
        return Tally(self.micro_batches + other.micro_batches, self.weight + other.weight)


@dataclass
class RoundResult:
    """What a finished round reports back to the compute lane."""
    kind: RoundKind
    step: int  # optimizer step t this round belongs to
    local: Tally  # this rank's micro-batches in the round's gradient sum
    per_rank: List[Tally]  # every rank's (gathered in the round: no extra collective)
    grad_norm: float  # norm of the global mean gradient, before clipping
    drift: Optional[float] = None  # commit rounds in mode acco: ‖θ̃_{t+1} − θ_{t+1}‖ / ‖θ_{t+1} − θ_t‖
    peer_report: Optional[torch.Tensor] = None  # (world, k) compute-lane figures each rank sent along
    started_at: float = 0.0
    finished_at: float = 0.0
    wait_s: float = 0.0  # compute-lane time blocked on this round (exposed communication)
    collected_at: float = 0.0
    skipped: bool = False  # non-finite mean gradient: no update (the estimate fell back to θ)

    @property
    def total(self) -> Tally:
        out = Tally()
        for t in self.per_rank:
            out = out.add(t)
        return out

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at


@dataclass
class _InFlight:
    handle: RoundHandle
    kind: RoundKind
    step: int
    result: Optional[RoundResult] = None  # set once waited for
    committed: bool = False  # commit bookkeeping done (at a drain or a swap)
    wait_s: float = 0.0  # how long the compute lane blocked on it


@dataclass(frozen=True)
class FixedPhases:
    """Every phase has exactly ``micro_batches`` micro-batches."""
    micro_batches: int

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        """Why the phase ends after its ``n``-th micro-batch, or None if it goes on."""
        return "fixed" if n >= self.micro_batches else None


@dataclass(frozen=True)
class DynamicPhases:
    """A phase ends once its round has finished (checked every ``check_every`` micro-batches from
    ``min_micro_batches`` on), or at ``max_micro_batches`` (the compute lane then waits)."""
    min_micro_batches: int
    max_micro_batches: int
    check_every: int = 1

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        """Why the phase ends after its ``n``-th micro-batch, or None if it goes on."""
        if n >= self.max_micro_batches:
            return "max"
        if n < self.min_micro_batches or (n - self.min_micro_batches) % self.check_every:
            return None
        return "round_done" if round_done() else None


@dataclass
class PhaseRecord:
    """One finished phase as the compute lane saw it (for metrics and replay)."""
    kind: PhaseKind
    data_step: int  # the optimizer step whose gradients this phase computed
    tally: Tally
    wait_s: float  # blocked at its end, waiting for the round that overlapped it
    ended_at: float
    reason: str  # 'fixed', 'round_done' or 'max' (the phase policy's answer)


class AccoSchedule:
    """Owns the phases, the rounds and the swaps for one set of flat groups.

    Args:
        groups: the flat tensors per parameter group.
        shard_optimizer: steps the master shards (estimate or commit).
        lane: where rounds run.
        group, rank, world: the dedicated process group of the rounds and this rank's place in it.
        mode: 'acco' or 'dpu'.
        phases: when a phase ends (:class:`FixedPhases` or :class:`DynamicPhases`).
        grad_scale: the factor each micro-batch gradient carries in G (DeepSpeed scales the loss
            by 1/A); a round divides the summed gradient by ``global weight * grad_scale``.
        clip_grad: clip the global mean gradient of each round to this norm (0: off).
        nonfinite: 'skip' a round whose global mean gradient is not finite (no update; the
            estimate falls back to θ) or 'raise' :class:`NonFiniteGradientError`.
        loss_scale: returns the loss scale the backward passes use now (fp16 dynamic loss
            scaling; None: 1). G always carries the current scale: when it changes (the caller
            updates its scaler in ``on_commit``), G is rescaled by the ratio, so a round never
            mixes scales; each round divides by the scale G carried when it was packed.
        track_drift: measure the estimate drift in commit rounds (keeps the fp32 estimate shard
            from the estimate round to the commit round).
        report: called on the compute lane at each launch; returns a few floats that travel
            with the round's counts to every rank (``RoundResult.peer_report``).
        on_commit: called on the compute lane once per committed step, after θ_{t+1} is known
            and before the next round is launched (the LR scheduler advances there).
    """

    REPORT_SIZE = 6  # floats each rank may send along with a round (metrics, a stop request)

    def __init__(self, groups: Sequence[FlatGroup], shard_optimizer: ShardOptimizer, lane: CommLane, *, group,
                 rank: int, world: int, mode: str, phases, grad_scale: float = 1.0, clip_grad: float = 0.0,
                 reduce_scatter: bool = False, track_drift: bool = False,
                 report: Optional[Callable[[], Sequence[float]]] = None, history: int = 4096,
                 nonfinite: str = "skip", loss_scale: Optional[Callable[[], float]] = None,
                 on_commit: Optional[Callable[[RoundResult], None]] = None):
        if mode not in ("acco", "dpu"):
            raise ValueError(f"mode must be 'acco' or 'dpu', got {mode!r}")
        self.groups = list(groups)
        self.shard_optimizer = shard_optimizer
        self.lane = lane
        self.group, self.rank, self.world = group, rank, world
        self.mode = mode
        self.phases = phases
        self.grad_scale = grad_scale
        self.clip_grad = clip_grad
        self.reduce_scatter = reduce_scatter
        self.track_drift = track_drift and mode == "acco"
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.report = report
        self.on_commit = on_commit
        self.loss_scale = loss_scale
        self.grads_scale = self._current_loss_scale()  # the scale G's content carries
        self.phase = PhaseKind.BOOTSTRAP
        self.step_index = 0  # t: the optimizer step whose data the compute lane is producing
        self.committed_steps = 0
        self.phase_tally = Tally()  # the current phase
        self.buffer_tally = Tally()  # what G holds since it was last cleared
        self.micro_batches = 0  # all micro-batches ever recorded
        self.history: Deque[PhaseRecord] = collections.deque(maxlen=history)
        self.recent_rounds: Deque[RoundResult] = collections.deque(maxlen=8)
        self._decision: Optional[tuple] = None  # (micro-batch index, phase ends?)
        self._inflight: Optional[_InFlight] = None
        self._estimate_shards: Optional[List[torch.Tensor]] = None  # lane-owned, for the drift
        self._swapped = False  # inside committed_weights: live and comm exchanged
        for g in self.groups:
            g.zero_grads()

    # -- the compute lane's calls ---------------------------------------------------------
    def phase_ends(self, decide: bool = True) -> bool:
        """Whether the phase ends with the micro-batch now being computed.

        With ``decide`` the answer is fixed for this micro-batch (every later caller gets the
        same one); without it, the current answer is returned and nothing is fixed (for callers
        that ask early, e.g. before the backward pass: a later decision sees more rounds done).
        """
        if self._decision is not None and self._decision[0] == self.micro_batches:
            return self._decision[1] is not None
        inflight = self._inflight
        done = (lambda: True) if inflight is None else inflight.handle.done
        reason = self.phases.ends(self.phase_tally.micro_batches + 1, done)
        if decide:
            self._decision = (self.micro_batches, reason)
        return reason is not None

    def before_backward(self) -> None:
        """Called by the adapters before each backward pass: a loss scale set from outside
        (e.g. ``override_loss_scale``) is applied to G before gradients at the new scale land."""
        self._sync_grads_scale()

    def record_micro_batch(self, weight: float = 1.0) -> None:
        """Note one finished backward pass whose gradient now sits in G."""
        one = Tally(1, float(weight))
        self.phase_tally = self.phase_tally.add(one)
        self.buffer_tally = self.buffer_tally.add(one)
        self.micro_batches += 1

    def end_phase(self) -> None:
        """Phase boundary: collect the round in flight, swap, launch the next round."""
        ended, wait_s = self.phase, 0.0
        reason = self._decision[1] if self._decision and self._decision[0] == self.micro_batches - 1 else None
        step = self.step_index
        if self.mode == "dpu":
            if self.phase is not PhaseKind.BOOTSTRAP:
                wait_s = self._collect_into_live()  # model ← θ_k
                self.step_index += 1
            self._launch(RoundKind.COMMIT, clear_grads=True)
            self.phase = PhaseKind.COMMIT
        elif self.phase is PhaseKind.BOOTSTRAP:
            self._launch(RoundKind.ESTIMATE, clear_grads=False)
            self.phase = PhaseKind.ESTIMATE
        elif self.phase is PhaseKind.ESTIMATE:
            wait_s = self._collect_into_live()  # model ← θ̃_{t+1}
            self._launch(RoundKind.COMMIT, clear_grads=True)  # the full batch of step t
            self.phase = PhaseKind.COMMIT
        else:
            wait_s = self._collect_into_live()  # model ← θ_{t+1}
            self.step_index += 1
            self._launch(RoundKind.ESTIMATE, clear_grads=False)  # Σg̃_{t+1}, kept in G
            self.phase = PhaseKind.ESTIMATE
        data_step = step + 1 if ended is PhaseKind.COMMIT else (step if ended is PhaseKind.ESTIMATE else 0)
        self.history.append(PhaseRecord(ended, data_step, self.phase_tally, wait_s, time.perf_counter(),
                                        reason or "forced"))
        self.phase_tally = Tally()

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (if any); a finished commit is booked as committed."""
        if self._inflight is None:
            return None
        return self._wait(self._inflight)

    @contextlib.contextmanager
    def committed_weights(self):
        """Inside: ``live`` holds the newest committed θ; on exit, the live state is restored.

        A commit round in flight is waited for (its θ is the newest); an estimate round is not:
        the live weights already are the committed θ_t and the round may go on.
        """
        inflight = self._inflight
        if inflight is not None and inflight.kind is RoundKind.COMMIT:
            self.drain()
        swap = inflight is not None and inflight.kind is RoundKind.COMMIT
        if swap:  # comm holds θ_{t+1}, live holds θ̃_{t+1} (acco) or θ_t (dpu)
            for g in self.groups:
                g.swap_live_and_comm()
            self._swapped = True
        try:
            yield
        finally:
            if swap:
                for g in self.groups:
                    g.swap_live_and_comm()
                self._swapped = False

    # -- exact resume ----------------------------------------------------------------------
    STATE_VERSION = 1

    def state_dict(self) -> dict:
        """Everything in flight, for an exact resume: the accumulator G, the live weights and the
        communication buffer as the compute lane sees them, the phase position and the finished
        round's result. Drains first (no collective is cut). Tensors are copied to CPU."""
        self.drain()
        inflight = self._inflight

        def cpu(ts):
            return [t.detach().to("cpu", copy=True) for t in ts]

        return {
            "version": self.STATE_VERSION,
            "mode": self.mode,
            "world": self.world,
            "layout": [g.layout() for g in self.groups],
            "phase": self.phase.value,
            "step_index": self.step_index,
            "committed_steps": self.committed_steps,
            "phase_tally": (self.phase_tally.micro_batches, self.phase_tally.weight),
            "buffer_tally": (self.buffer_tally.micro_batches, self.buffer_tally.weight),
            "micro_batches": self.micro_batches,
            "grads_scale": self.grads_scale,
            "groups": [g.export_state(self._swapped) for g in self.groups],
            "inflight": None if inflight is None else {
                "kind": inflight.kind.value, "step": inflight.step, "committed": inflight.committed,
                "result": _result_to_dict(inflight.result)},
            "estimate_shards": None if self._estimate_shards is None else cpu(self._estimate_shards),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same mode, world size and layout)."""
        if self._inflight is not None:
            self.drain()
        mismatch = [k for k, mine in (("version", self.STATE_VERSION), ("mode", self.mode), ("world", self.world),
                                      ("layout", [g.layout() for g in self.groups])) if state.get(k) != mine]
        if mismatch:
            raise ValueError(f"ACCO in-flight state does not fit this run ({', '.join(mismatch)} differ)")
        for g, saved in zip(self.groups, state["groups"]):
            g.import_state(saved)
        self.phase = PhaseKind(state["phase"])
        self.step_index = state["step_index"]
        self.committed_steps = state["committed_steps"]
        self.phase_tally = Tally(*state["phase_tally"])
        self.buffer_tally = Tally(*state["buffer_tally"])
        self.micro_batches = state["micro_batches"]
        self.grads_scale = float(state.get("grads_scale", 1.0))
        self._sync_grads_scale()  # the restored scaler's scale (the same, unless it was replaced)
        self._decision = None
        device = self.groups[0].comm.device
        self._estimate_shards = (None if state["estimate_shards"] is None else
                                 [t.to(device) for t in state["estimate_shards"]])
        info = state["inflight"]
        if info is None:
            self._inflight = None
        else:  # a finished round whose result sits in comm
            result = _result_from_dict(info["result"])
            future: Future = Future()
            future.set_result(result)
            self._inflight = _InFlight(RoundHandle(f"{info['kind']} {info['step']} (restored)", future),
                                       RoundKind(info["kind"]), info["step"], result, info["committed"])

    def reset(self, committed_steps: int) -> None:
        """Forget everything in flight and start a bootstrap phase at the current weights, as after
        ``committed_steps`` optimizer steps (e.g. after loading a stock ZeRO-1 checkpoint)."""
        self.drain()
        self._inflight = None
        self.step_index = self.committed_steps = committed_steps
        self.phase = PhaseKind.BOOTSTRAP
        self.phase_tally = Tally()
        self.buffer_tally = Tally()
        self._decision = None
        self._estimate_shards = None
        self.grads_scale = self._current_loss_scale()
        for g in self.groups:
            g.zero_grads()

    def close(self) -> None:
        """Drain and stop the lane."""
        try:
            self.drain()
        finally:
            self.lane.close()

    # -- internals ------------------------------------------------------------------------
    def _current_loss_scale(self) -> float:
        scale = 1.0 if self.loss_scale is None else float(self.loss_scale())
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scale {scale!r}: must be a finite number > 0")
        return scale

    def _sync_grads_scale(self) -> None:
        """After a loss-scale change: G ← G · new/old, so it carries the scale the next backward
        passes will use (compute lane; the round in flight reads B, not G). G is rescaled even
        when no micro-batch has been recorded yet: a backward may have run before its step()."""
        new = self._current_loss_scale()
        if new != self.grads_scale:
            for g in self.groups:
                g.scale_grads(new / self.grads_scale)
            self.grads_scale = new

    def _launch(self, kind: RoundKind, clear_grads: bool) -> None:
        self._sync_grads_scale()  # a scale set after the last backward: G follows it into B
        scale = self.grads_scale
        for g in self.groups:
            g.pack_grads(clear_grads, kind)
        tally = self.buffer_tally
        if clear_grads:
            self.buffer_tally = Tally()
        step = self.step_index
        report = list(self.report()) if self.report is not None else []
        handle = self.lane.submit(f"{kind.value} {step}", lambda: self._round(kind, step, tally, report, scale))
        self._inflight = _InFlight(handle, kind, step)

    def _wait(self, inflight: _InFlight) -> RoundResult:
        if inflight.result is None:
            t0 = time.perf_counter()
            inflight.result = self.lane.wait(inflight.handle)
            inflight.wait_s += time.perf_counter() - t0
            inflight.result.wait_s = inflight.wait_s
            # The lane's clock covers the whole round as it ran on the lane.
            inflight.result.started_at = inflight.handle.started_at or inflight.result.started_at
            inflight.result.finished_at = inflight.handle.finished_at or inflight.result.finished_at
            inflight.result.collected_at = time.perf_counter()
            self.recent_rounds.append(inflight.result)
        if inflight.kind is RoundKind.COMMIT and not inflight.committed:
            inflight.committed = True
            self.committed_steps += 1
            if self.on_commit is not None:
                self.on_commit(inflight.result)  # may update the loss scaler
            self._sync_grads_scale()
        return inflight.result

    def _collect_into_live(self) -> float:
        inflight = self._inflight
        waited_before = inflight.wait_s
        self._wait(inflight)
        for g in self.groups:
            g.unpack_into_live(inflight.kind)
        self._inflight = None
        return inflight.wait_s - waited_before

    def _round(self, kind: RoundKind, step: int, local: Tally, report: List[float],
               loss_scale: float = 1.0) -> RoundResult:
        """One communication round; runs on the lane. Touches only comm, master and the optimizer."""
        started = time.perf_counter()
        device = self.groups[0].comm.device
        # Counts (and the compute lane's report) of every rank, in one small collective.
        mine = torch.zeros(2 + self.REPORT_SIZE, dtype=torch.float64, device=device)
        mine[0], mine[1] = local.micro_batches, local.weight
        mine[2:2 + len(report)] = torch.tensor(report[:self.REPORT_SIZE], dtype=torch.float64)
        table = torch.empty(self.world * mine.numel(), dtype=torch.float64, device=device)
        collectives.gather_shards(mine, table, self.group)
        table = table.view(self.world, -1).cpu()
        per_rank = [Tally(int(row[0]), float(row[1])) for row in table]
        weight = sum(t.weight for t in per_rank)
        if weight <= 0:
            raise RuntimeError(f"round '{kind.value} {step}': no gradient weight on any rank "
                               f"(micro-batches per rank: {[t.micro_batches for t in per_rank]})")
        denom = weight * self.grad_scale * loss_scale  # G carried ``loss_scale`` when it was packed
        grads = []
        for g in self.groups:
            summed = collectives.reduce_to_shard(g.comm_for(kind), self.rank, self.world, self.group,
                                                 self.reduce_scatter)
            # In place when already fp32: the summed gradient in B is not needed again before the
            # all-gather overwrites B, so no shard-sized copy is made.
            grads.append(summed.to(torch.float32).div_(denom) if summed.dtype != torch.float32 else summed.div_(denom))
        norm_sq = collectives.sum_scalars(global_norm_sq(grads), self.group)
        grad_norm = float(norm_sq.sqrt())  # the same on every rank: so is the skip decision
        if not math.isfinite(grad_norm):
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"round '{kind.value} {step}': the global mean gradient is not finite (norm {grad_norm}); "
                    "set acco.nonfinite to 'skip' to skip such updates instead")
            return self._skip(kind, step, local, per_rank, grad_norm, table, started)
        if self.clip_grad > 0:
            # DeepSpeed's rule: divide by max(1, (norm + 1e-6) / clip).
            factor = max(1.0, (grad_norm + 1e-6) / self.clip_grad)
            if factor > 1.0:
                for gr in grads:
                    gr.mul_(1.0 / factor)
        param_grads = [pg for g, gr in zip(self.groups, grads) for pg in g.split_shard_grad(gr)]

        def read(copy: bool = True):
            return [g.read_shard(copy) for g in self.groups]

        drift = None
        if kind is RoundKind.COMMIT:
            before = read() if self._estimate_shards else None
            # θ_{t+1} is kept: the gather may read the master shards themselves (no copy).
            shards = self.shard_optimizer.commit(param_grads, lambda: read(copy=False))
            if before is not None:
                drift = self._drift(before, shards)
        else:
            shards = self.shard_optimizer.estimate(param_grads, read)
            if self.track_drift:
                self._estimate_shards = [s.clone() for s in shards]
        del grads, param_grads
        for g, shard in zip(self.groups, shards):
            out = g.comm_for(kind)
            collectives.gather_shards(shard.to(out.dtype), out, self.group)
        return RoundResult(kind, step, local, per_rank, grad_norm, drift, table[:, 2:], started,
                           time.perf_counter())

    def _skip(self, kind, step, local, per_rank, grad_norm, table, started) -> RoundResult:
        """No update this round: gather θ itself (the estimate falls back to θ_t, a commit keeps θ_t)."""
        shards = [g.read_shard() for g in self.groups]
        if kind is RoundKind.ESTIMATE and self.track_drift:
            self._estimate_shards = [s.clone() for s in shards]
        if kind is RoundKind.COMMIT:
            self._estimate_shards = None
        for g, shard in zip(self.groups, shards):
            out = g.comm_for(kind)
            collectives.gather_shards(shard.to(out.dtype), out, self.group)
        return RoundResult(kind, step, local, per_rank, grad_norm, None, table[:, 2:], started,
                           time.perf_counter(), skipped=True)

    def _drift(self, before: List[torch.Tensor], after: List[torch.Tensor]) -> float:
        sums = torch.zeros(2, dtype=torch.float64, device=after[0].device)
        for est, old, new in zip(self._estimate_shards, before, after):
            sums[0] += (est.double() - new.double()).pow(2).sum()
            sums[1] += (new.double() - old.double()).pow(2).sum()
        self._estimate_shards = None
        collectives.sum_scalars(sums, self.group)
        step_sq = float(sums[1])
        return float(sums[0].sqrt() / sums[1].sqrt()) if step_sq > 0 else float("nan")


def _result_to_dict(r: RoundResult) -> dict:
    """Plain types only, so checkpoints load without unpickling our classes."""
    return {"kind": r.kind.value, "step": r.step, "local": (r.local.micro_batches, r.local.weight),
            "per_rank": [(t.micro_batches, t.weight) for t in r.per_rank], "grad_norm": r.grad_norm,
            "drift": r.drift, "peer_report": r.peer_report, "started_at": r.started_at,
            "finished_at": r.finished_at, "wait_s": r.wait_s, "collected_at": r.collected_at,
            "skipped": r.skipped}


def _result_from_dict(d: dict) -> RoundResult:
    return RoundResult(RoundKind(d["kind"]), d["step"], Tally(*d["local"]), [Tally(*t) for t in d["per_rank"]],
                       d["grad_norm"], d["drift"], d["peer_report"], d["started_at"], d["finished_at"], d["wait_s"],
                       d["collected_at"], d.get("skipped", False))


def _swap_(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 20) -> None:
    """Exchange the contents of two equal flat tensors with a small temporary."""
    tmp = torch.empty(min(chunk, a.numel()), dtype=a.dtype, device=a.device)
    for start in range(0, a.numel(), chunk):
        n = min(chunk, a.numel() - start)
        x, y, t = a.narrow(0, start, n), b.narrow(0, start, n), tmp.narrow(0, 0, n)
        t.copy_(x)
        x.copy_(y)
        y.copy_(t)
