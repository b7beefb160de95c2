"""One communication round as plain functions: exchange counts, reduce, norm, skip, clip, step,
gather. Everything here runs on the communication lane and touches only B, the shards and the
optimizer (and reads the live weights' shard for the drift metric).

Memory: the round works inside B. Gradients are reduced in place (all-reduce + slice on gloo,
an in-place reduce-scatter elsewhere) and divided in place; norms and the drift (in the sampled
commits only, drift.py) are summed window by window through a few chunk-sized buffers (chunking.py); the estimate writes θ̃ straight into
this rank's segment of B's gather view (a functional step for SGD / Adam / AdamW, see
functional_step.py) and the commit copies θ into it, and the all-gather runs in place.
Shard-sized temporaries remain only where stock ZeRO-1 has them too: an fp32 copy of the gradient when gradients travel narrower than fp32 (DeepSpeed's
fp32 gradient partition), and the wrapped optimizer's own step. An optimizer without a
functional step pays a snapshot of the shard and its state for the estimate (shard_optimizer.py).

Kernels: every elementwise pass is one foreach (or fused) kernel per window over all the shard's
tensors, so a round's kernel count follows size / chunk, not the number of parameter tensors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ...comm import collectives
from ..step.shard_optimizer import global_norm_sq
from .drift import drift_and_cosine, drift_sums, sampled
from .kinds import RoundKind, Tally
from .report import DRAIN_ABORT, RoundReport, reports_from_checkpoint

if TYPE_CHECKING:
    from .buffers import BufferGroup
    from ..step.delay_compensation import DelayCompensation
    from ..step.predict import Predictor
    from ..step.shard_optimizer import ShardOptimizer


class NonFiniteGradientError(FloatingPointError):
    """A round's global mean gradient had an inf or NaN and ``nonfinite`` is 'raise'."""


class DrainMismatchError(Exception):
    """Dynamic mode: the ranks did not drain (``committed_weights``, a checkpoint) at the same
    points, so they cannot agree on which rounds to finish. Raised on every rank within one round.
    Not a RuntimeError: the lane reports it as it is, not as a failed collective."""


@dataclass
class RoundResult:
    """What a finished round reports back to the compute lane."""
    kind: RoundKind
    step: int  # optimizer step t this round belongs to
    local: Tally  # this rank's micro-batches in the round's gradient sum
    per_rank: List[Tally]  # every rank's (gathered in the round: no extra collective)
    grad_norm: float  # norm of the global mean gradient, before clipping
    # Mode acco: the previous commit's ‖θ̃_{t+1} − θ_{t+1}‖ / ‖θ_{t+1} − θ_t‖, summed on the device in that
    # commit and read with this round's one host read (a commit reads the host before its step only).
    prev_commit_drift: Optional[float] = None
    peer_report: Optional[List[RoundReport]] = None  # what each rank sent along (by rank; host values)
    started_at: float = 0.0
    finished_at: float = 0.0
    wait_s: float = 0.0  # compute-lane time blocked on this round (exposed communication)
    collected_at: float = 0.0
    skipped: bool = False  # non-finite mean gradient: no update (the estimate fell back to θ)
    lr_factor: float = 1.0  # the learning-rate multiplier the step used (dynamic lr_scaling; × estimate.lr_scale)
    lr: Optional[float] = None  # the first param group's learning rate the step used (× lr_factor)
    # tensor parallelism: some rank of the whole data-parallel × model-parallel grid asked to stop
    # (SIGTERM) with this round; the counts table only carries this data-parallel group's requests
    stop_anywhere: bool = False
    # Mode acco: the previous commit's cosine between the estimate's update θ̃_{t+1} − θ_t and the
    # commit's θ_{t+1} − θ_t (read with prev_commit_drift)
    prev_commit_cos: Optional[float] = None

    @property
    def total(self) -> Tally:
        out = Tally()
        for t in self.per_rank:
            out = out.add(t)
        return out

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def to_dict(self) -> dict:
        """Plain types only, so checkpoints load without unpickling our classes."""
        return {"kind": self.kind.value, "step": self.step, "local": (self.local.micro_batches, self.local.weight),
                "per_rank": [(t.micro_batches, t.weight) for t in self.per_rank], "grad_norm": self.grad_norm,
                "prev_commit_drift": self.prev_commit_drift, "started_at": self.started_at,
                "finished_at": self.finished_at, "wait_s": self.wait_s, "collected_at": self.collected_at,
                "peer_report": None if self.peer_report is None else [r.to_dict() for r in self.peer_report],
                "skipped": self.skipped, "lr_factor": self.lr_factor, "lr": self.lr, "stop_anywhere": self.stop_anywhere,
                "prev_commit_cos": self.prev_commit_cos}

    @classmethod
    def from_dict(cls, d: dict) -> "RoundResult":
        return cls(RoundKind(d["kind"]), d["step"], Tally(*d["local"]), [Tally(*t) for t in d["per_rank"]],
                   d["grad_norm"], d.get("prev_commit_drift"), reports_from_checkpoint(d["peer_report"]),
                   d["started_at"], d["finished_at"], d["wait_s"], d["collected_at"], d.get("skipped", False),
                   d.get("lr_factor", 1.0), d.get("lr"), d.get("stop_anywhere", False), d.get("prev_commit_cos"))


@dataclass(kw_only=True)
class RoundContext:
    """What every round of one schedule shares (fixed at construction; built by keyword)."""
    groups: Sequence["BufferGroup"]
    shard_optimizer: Optional["ShardOptimizer"]  # None only in tests that never step
    process_group: Optional[dist.ProcessGroup]  # the rounds' own group
    # tensor parallelism: the rounds' own copy of the model-parallel group, over which the squared
    # norm is summed after the data-parallel sum (stock's order); None: no model parallelism
    norm_group: Optional[dist.ProcessGroup] = None
    rank: int
    world: int
    gas_scale: float  # the factor each micro-batch gradient carries in G (DeepSpeed's 1/A loss scaling)
    clip_grad: float  # clip the global mean gradient to this norm (0: off)
    sum_ranks: bool = False  # DeepSpeed's gradient_allreduce_op "sum": world x the mean (stock's sum of rank means)
    nonfinite: str  # 'skip' or 'raise'
    reduce_scatter: bool  # reduce with a reduce-scatter (NCCL) rather than all-reduce + slice (gloo)
    drift_every: int  # measure the estimate drift in the commit of every N-th step (0: never; drift.sampled)
    chunk_elems: int  # bound on a round's temporaries (elements)
    lr_power: float = 0.0  # dynamic mode's learning-rate rule (0: off), see lr_factor
    nominal_phase_micro_batches: int = 0  # one fixed-mode phase, all ranks
    commit_phases: int = 1  # phases a commit round's gradients span (2 in mode acco)
    read_counts_first: bool = False  # dynamic mode: read the counts table before the reduce (drain aborts)
    estimate_lr_scale: float = 1.0  # an estimate round's LR × this (acco.estimate.lr_scale)
    committed_second_moment: bool = False  # an estimate round reuses Adam's committed v
    delay: Optional["DelayCompensation"] = None  # the commit's delay compensation (acco.estimate.delay_compensation)
    predictor: Optional["Predictor"] = None  # mode one_round: a commit gathers P_{t+1} in θ's place (predict.py)
    pending_drift: Optional[torch.Tensor] = None  # the last commit's drift sums, on the device, not yet read

    def lr_factor(self, kind: "RoundKind", micro_batches: int) -> float:
        """(the round's global micro-batches / what fixed accumulation gives that round) ** lr_power:
        1.0 in fixed mode and whenever the rule is off."""
        if not self.lr_power:
            return 1.0
        phases = self.commit_phases if kind is RoundKind.COMMIT else 1
        return (micro_batches / (self.nominal_phase_micro_batches * phases)) ** self.lr_power


def exchange_table(ctx: RoundContext, local: Tally, report: RoundReport) -> torch.Tensor:
    """Every rank's counts and report in one small all-gather: a (world, 2 + width) float64 table on
    the device (row r: rank r's micro-batches, weight, packed report). Nothing is read back."""
    row = [float(local.micro_batches), float(local.weight)] + report.pack()
    mine = to_device(row, ctx.groups[0].comm.device)
    table = torch.empty(ctx.world * mine.numel(), dtype=torch.float64, device=mine.device)
    collectives.gather_shards(mine, table, ctx.process_group)
    return table.view(ctx.world, -1)


def to_device(values, device: torch.device) -> torch.Tensor:
    """Host floats as a float64 tensor on ``device`` without a host synchronisation: through pinned
    memory and an asynchronous copy on an accelerator (a pageable copy would synchronise the
    stream); the pinned block is reused only once the copy is done (torch's host allocator)."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def parse_table(rows: Sequence[Sequence[float]], report_type: type = RoundReport):
    """The host copy of :func:`exchange_table`'s table: (per-rank tallies, per-rank reports)."""
    return [Tally(int(row[0]), float(row[1])) for row in rows], report_type.unpack([row[2:] for row in rows])


def exchange_tallies(ctx: RoundContext, local: Tally, report: RoundReport):
    """:func:`exchange_table` read back at once (a drain's probe): (per-rank tallies, reports)."""
    return parse_table(exchange_table(ctx, local, report).tolist(), type(report))


def check_no_drain_abort(reports: Sequence[RoundReport]) -> None:
    """Raise :class:`DrainMismatchError` when a rank filled this slot to report that the ranks'
    drains do not pair up (its own error says which); every rank then stops at this slot."""
    ranks = [r for r, report in enumerate(reports) if report.drain == DRAIN_ABORT]
    if ranks:
        raise DrainMismatchError(
            f"ACCO dynamic mode: rank(s) {ranks} found that the ranks drained (committed_weights, "
            "save_checkpoint, evaluation) a different number of times -- see that rank's error; fix: drain on "
            "every rank at the same micro-batch count (not on rank 0 only, not on a per-rank condition)")


def reduce_mean_grads(ctx: RoundContext, kind: RoundKind, denom) -> List[List[torch.Tensor]]:
    """Sum B's gradients over the ranks and divide this rank's shard by ``denom`` (a float, or a
    0-dim float64 tensor on the device: the same quotients); per group the shard's gradients
    (:func:`shard_mean`)."""
    out = []
    for g in ctx.groups:
        flat = g.reduce_view(kind)
        collectives.reduce_in_place(flat, ctx.rank, ctx.world, ctx.process_group, ctx.reduce_scatter)
        out.append(shard_mean(g.shard_views(flat), denom))
    return out


def shard_mean(views: List[torch.Tensor], denom: float) -> List[torch.Tensor]:
    """This rank's reduced gradient shard ÷ ``denom``, as tensors shaped like ``views``: in place in B
    when gradients travel in fp32, else in one fp32 copy of the shard (the optimizer steps fp32
    masters; stock ZeRO-1 makes the same copy). One foreach kernel per operation, however many
    parameter tensors the shard holds."""
    if not views:
        return []
    if views[0].dtype != torch.float32:
        fp32 = torch.empty(sum(v.numel() for v in views), dtype=torch.float32, device=views[0].device)
        parts = [p.view(v.shape) for p, v in zip(fp32.split([v.numel() for v in views]), views)]
        torch._foreach_copy_(parts, views)
        views = parts
    if torch.is_tensor(denom):  # the list's dtype: foreach's fused path on accelerators (the same quotients)
        denom = denom.to(views[0].dtype)
    torch._foreach_div_(views, denom)
    return views


def clip_(grads: List[torch.Tensor], grad_norm: float, clip_grad: float) -> None:
    """DeepSpeed's rule: divide by max(1, (norm + 1e-6) / clip), in place (one foreach kernel)."""
    factor = max(1.0, (grad_norm + 1e-6) / clip_grad)
    if factor > 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / factor)


def write_shards(ctx: RoundContext, kind: RoundKind = RoundKind.COMMIT) -> None:
    """Where a round of ``kind`` puts new parameters (``param_outputs``: this rank's segment of B's
    gather view) ← this rank's shard values θ[r] (cast to the model dtype)."""
    outs = [(g, g.param_outputs(kind)) for g in ctx.groups]
    srcs = [v.reshape(-1) for g, o in outs if o is not None for v in g.shard_values()]
    if srcs:
        torch._foreach_copy_([v for _, o in outs if o is not None for v in o], srcs)


def write_params(ctx: RoundContext, kind: RoundKind, settings=None, lr_factor: float = 1.0,
                 predictor: Optional["Predictor"] = None) -> None:
    """:func:`write_shards`, or, a commit with ``predictor`` (mode one_round), P_{t+1} in θ_{t+1}'s place."""
    if predictor is None or kind is not RoundKind.COMMIT:
        return write_shards(ctx, kind)
    outs = [v for g in ctx.groups for v in (g.param_outputs(kind) or [])]
    predictor.after_step(outs, ctx.shard_optimizer.optimizer, settings, lr_factor)


def _copy_shards(ctx: RoundContext, dsts: List[torch.Tensor]) -> None:
    """``dsts`` (flat, one per shard tensor of every group) ← the shard values, in one foreach kernel."""
    srcs = [v.reshape(-1) for g in ctx.groups for v in g.shard_values()]
    if srcs:
        torch._foreach_copy_(dsts, srcs)


def gather(ctx: RoundContext) -> None:
    """All-gather every rank's segment of B's gather view, in place (groups whose parameters the
    framework gathers itself, FSDP2 with sharded parameters, have none)."""
    for g in ctx.groups:
        if g.gathers_params:
            collectives.gather_in_place(g.gather_view(), ctx.rank, ctx.world, ctx.process_group, ctx.chunk_elems)


def run_round(ctx: RoundContext, kind: RoundKind, step: int, local: Tally, report: Optional[RoundReport],
              loss_scale: float, exchanged: Optional[tuple] = None,
              settings: Optional[Sequence[dict]] = None, *, sync: bool = False,
              first_half_weight: Optional[float] = None) -> RoundResult:
    """One round (ACCO.md): mean gradient over all ranks, one optimizer step on the shard --
    discarded for an estimate, kept for a commit -- and the new parameters all-gathered into B.
    ``exchanged``: the table of :func:`exchange_tallies`, when this rank's drain probe already
    exchanged it (its peers' rounds did, see core/schedule/drains.py); the round then starts at the reduce.
    ``settings``: the param groups' settings (learning rate, ...) captured when the round was
    launched (ShardOptimizer.settings): the step of round t uses step t's learning rate whatever
    a scheduler does on the compute thread meanwhile (default: the settings when it runs).
    ``sync``: a commit of the synchronous warm-up (its whole batch at θ_t: no drift metric, no delay
    compensation). ``first_half_weight``: a commit's first-half weight over all ranks (the estimate
    round's), for the delay compensation's share (:mod:`.delay_compensation`)."""
    started = time.perf_counter()
    with record_function(f"ACCO::{kind.value}_round"):
        if exchanged is not None:  # the counts are on the host already; the table goes back to the device
            rows = [[float(t.micro_batches), float(t.weight)] + r.pack() for t, r in zip(*exchanged)]
            table = to_device(rows, ctx.groups[0].comm.device)
            per_rank, reports = exchanged
        else:
            table = exchange_table(ctx, local, report)
            per_rank = reports = None
            if ctx.read_counts_first:  # dynamic mode: a drain abort must stop every rank before the reduce
                per_rank, reports = parse_table(table.tolist(), type(report))
        if per_rank is not None:
            _check_counts(kind, step, per_rank, reports)
        # The mean's denominator stays on the device: the round reads the host once, below.
        weight = table[:, 1].sum()
        denom = weight * ctx.gas_scale * loss_scale  # G carried ``loss_scale`` when it was packed
        if ctx.sum_ranks:  # stock sums the ranks' means: the global mean times the number of ranks
            denom = denom / ctx.world
        with record_function("ACCO::reduce"):
            grads = reduce_mean_grads(ctx, kind, denom)
        delay = None if sync else ctx.delay
        if delay is not None:  # before the norm: the commit clips the compensated mean
            with record_function("ACCO::delay_compensation"):
                if kind is RoundKind.ESTIMATE:
                    delay.weigh(grads)
                elif first_half_weight is not None:
                    delay.compensate(grads, ctx.shard_optimizer.optimizer, settings,
                                     (delay.lam * first_half_weight) / weight, ctx.chunk_elems)
        flat_grads = [t for gs in grads for t in gs]
        counted = [p for g, gs in zip(ctx.groups, grads) for p in g.norm_pieces(gs)]
        device = ctx.groups[0].comm.device
        local_sq = (global_norm_sq(counted, ctx.chunk_elems) if counted  # a shard of replicated parameters only
                    else torch.zeros((), dtype=torch.float64, device=device))
        del counted
        if ctx.norm_group is not None:
            # Tensor parallelism: the norm and the stop requests of every data-parallel group, summed
            # over the data-parallel group then the model-parallel one (stock's order for the norm)
            stop = bool(report.stop) if report is not None else any(r.stop for r in (reports or ()))
            sums = torch.stack([local_sq, torch.tensor(float(stop), dtype=torch.float64, device=device)])
            sums = collectives.sum_scalars(collectives.sum_scalars(sums, ctx.process_group), ctx.norm_group)
        else:
            sums = collectives.sum_scalars(local_sq.reshape(1), ctx.process_group)
        # The round's one host read (fixed mode): the squared norm (and the stop requests), the
        # previous commit's drift sums and the counts table together. What the host decides (skip,
        # clip factor, learning-rate factor) follows from it.
        parts = [sums]
        pending, ctx.pending_drift = ctx.pending_drift, None
        if pending is not None:
            parts.append(pending)
        if per_rank is None:
            parts.append(table.reshape(-1))
        host = torch.cat(parts).tolist()
        head = sums.numel()
        stop_anywhere = head > 1 and host[1] > 0
        prev_drift = prev_cos = None
        if pending is not None:
            prev_drift, prev_cos = drift_and_cosine(*host[head:head + 3])
        if per_rank is None:
            width, first = table.shape[1], len(host) - table.numel()
            per_rank, reports = parse_table([host[first + r * width:first + (r + 1) * width]
                                             for r in range(ctx.world)], type(report))
            _check_counts(kind, step, per_rank, reports)
        grad_norm = math.sqrt(host[0]) if host[0] >= 0 else float("nan")  # the same on every rank: so is the skip
        skipped = not math.isfinite(grad_norm)
        lr_factor = 1.0
        predictor = None if sync else ctx.predictor  # stock's step (sync): θ_{t+1} itself, no prediction
        if predictor is not None and kind is RoundKind.COMMIT:
            predictor.before_step()  # the shards still hold θ_t
        if skipped:
            if ctx.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"round '{kind.value} {step}': the global mean gradient is not finite (norm {grad_norm}); "
                    "set acco.nonfinite to 'skip' to skip such updates instead")
            write_params(ctx, kind, settings, predictor=predictor)  # no update: an estimate falls back to θ_t
            if delay is not None and kind is RoundKind.ESTIMATE:
                delay.clear()  # no compensation from a non-finite first half
        else:
            if ctx.clip_grad > 0:
                clip_(flat_grads, grad_norm, ctx.clip_grad)
            param_grads = [pg for g, gs in zip(ctx.groups, grads) for pg in g.param_grads(gs)]
            lr_factor = ctx.lr_factor(kind, sum(t.micro_batches for t in per_rank))
            with record_function(f"ACCO::{kind.value}_step"):
                if kind is RoundKind.COMMIT:
                    before = None if sync else _keep_shards_for_drift(ctx, step)
                    ctx.shard_optimizer.commit(param_grads, lr_scale=lr_factor, settings=settings)
                    if before is not None:
                        ctx.pending_drift = drift_sums(ctx.groups, before, ctx.chunk_elems, ctx.process_group)
                    write_params(ctx, kind, settings, lr_factor, predictor)
                else:
                    outs = [v for g in ctx.groups for v in g.param_outputs(kind)]
                    lr_factor *= ctx.estimate_lr_scale
                    ctx.shard_optimizer.estimate_into(param_grads, outs, lr_scale=lr_factor, settings=settings,
                                                      committed_second_moment=ctx.committed_second_moment)
        del grads, flat_grads
        if delay is not None and kind is RoundKind.COMMIT:
            with record_function("ACCO::delay_compensation"):
                delay.refresh(ctx.chunk_elems)  # D ← θ̃_{t+1} − θ_{t+1}, the next step's lead
        with record_function("ACCO::all_gather"):
            gather(ctx)
    lr = settings[0].get("lr") if settings else None
    return RoundResult(kind, step, local, per_rank, grad_norm, prev_drift, reports, started, time.perf_counter(),
                       skipped=skipped, lr_factor=lr_factor,
                       lr=float(lr) * lr_factor if isinstance(lr, (int, float)) else None, stop_anywhere=stop_anywhere,
                       prev_commit_cos=prev_cos)


def _check_counts(kind: RoundKind, step: int, per_rank: Sequence[Tally], reports) -> None:
    check_no_drain_abort(reports)
    if sum(t.weight for t in per_rank) <= 0:
        raise RuntimeError(f"round '{kind.value} {step}': no gradient weight on any rank "
                           f"(micro-batches per rank: {[t.micro_batches for t in per_rank]})")


def _keep_shards_for_drift(ctx: RoundContext, step: int) -> Optional[List[torch.Tensor]]:
    """θ_t, kept for the drift metric in another rank's segment of B (free until the all-gather:
    this rank only needs its own segment), so no shard-sized copy is allocated; None when the
    commit of ``step`` is not sampled (:func:`.drift.sampled`). Needs world > 1."""
    if not sampled(step, ctx.drift_every) or ctx.world < 2:
        return None
    other = (ctx.rank + 1) % ctx.world
    kept = [v for g in ctx.groups for v in g.shard_views(g.reduce_view(RoundKind.COMMIT), rank=other)]
    _copy_shards(ctx, kept)
    return kept
