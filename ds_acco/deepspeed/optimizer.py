"""``AccoZeroOptimizer``: DeepSpeed's ZeRO stage-1 optimizer, with ACCO owning the communication.

DeepSpeed builds the flat bit16 groups, the fp32 master partitions and the wrapped torch
optimizer exactly as for stock ZeRO-1; this subclass then maps them onto the core's flat
groups and hands every phase boundary to :class:`~ds_acco.core.schedule.AccoSchedule`.
Stock reduction paths (buckets, gradient hooks) are switched off so their buffers are never
allocated: the only extra full-size tensor is the core's communication buffer.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from ..comm import collectives
from ..comm.lane import CommLane
from ..config import AccoConfig
from ..core.schedule import AccoSchedule, FlatGroup, RoundResult
from ..core.shard_optimizer import ShardOptimizer
from ..metrics import REPORT_FIELDS, StepMetrics

STOP_FIELD = len(REPORT_FIELDS)  # index of the stop request in a round's peer report

ACCO_STATE_KEY = "acco_state"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _adder(view: torch.Tensor):
    """A post-accumulate-grad hook adding the parameter's gradient into its slice of G."""
    def hook(param: torch.Tensor) -> None:
        view.add_(param.grad.view_as(view))
        param.grad = None
    return hook

# Stock knobs that only shape DeepSpeed's own reduction, which ACCO replaces.
_REPLACED_KNOBS = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                   "allgather_bucket_size", "round_robin_gradients")


class AccoZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1 optimizer whose reduce / step / all-gather overlap the next micro-batches (ACCO.md).

    Built by :class:`~ds_acco.deepspeed.engine.AccoEngine`; the engine calls :meth:`step` at
    every phase end (``is_gradient_accumulation_boundary()``).
    """

    def __init__(self, init_optimizer, param_names, *, acco_config: AccoConfig, gradient_accumulation_steps: int,
                 on_commit: Optional[Callable[[RoundResult], None]] = None, comm_dtype: Optional[torch.dtype] = None,
                 **kwargs):
        model_dtype = init_optimizer.param_groups[0]["params"][0].dtype
        # G accumulates in DeepSpeed's gradient-accumulation dtype (bf16 weights may accumulate
        # in fp32); DeepSpeed itself sees model-dtype gradients so it builds no hooks of its own.
        # fp16 always accumulates in fp32: G carries the loss scale across a whole optimizer step
        # (up to 2·A scaled micro-batch gradients) and is rescaled when the scale changes.
        accum_dtype = kwargs.get("gradient_accumulation_dtype") or model_dtype
        if model_dtype == torch.float16:
            accum_dtype = torch.float32
        kwargs["gradient_accumulation_dtype"] = model_dtype
        comm_dtype = comm_dtype or accum_dtype
        kwargs["gradient_accumulation_steps"] = gradient_accumulation_steps
        kwargs["overlap_comm"] = False  # no gradient hooks, no ipg buckets: G is p.grad itself
        kwargs["contiguous_gradients"] = False
        kwargs["round_robin_gradients"] = False
        super().__init__(init_optimizer, param_names, **kwargs)
        self.acco_config = acco_config

        world = dist.get_world_size(group=self.dp_process_group)
        rank = dist.get_rank(group=self.dp_process_group)
        ranks = (dist.get_process_group_ranks(self.dp_process_group)
                 if self.dp_process_group is not None else list(range(dist.get_world_size())))
        # A group of our own: rounds run on another thread, and gloo matches collectives by
        # issue order per group.
        from datetime import timedelta
        self.acco_group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=acco_config.comm_timeout_s))

        estimate_dtype = _DTYPES[acco_config.estimate_comm_dtype] if acco_config.estimate_comm_dtype else None
        if estimate_dtype is not None and estimate_dtype.itemsize > comm_dtype.itemsize:
            raise ValueError(f"acco.estimate_comm_dtype = {acco_config.estimate_comm_dtype!r} is wider than the "
                             f"communication dtype {comm_dtype}; fix: use a narrower one (e.g. 'bf16'), or set "
                             "DeepSpeed's communication_data_type / data_types.grad_accum_dtype to fp32")
        groups = []
        for i, live in enumerate(self.bit16_groups_flat):
            grads = torch.zeros(live.numel(), dtype=accum_dtype, device=live.device)
            comm = torch.empty(live.numel(), dtype=comm_dtype, device=live.device)
            groups.append(FlatGroup(live=live, grads=grads, comm=comm, master=self.single_partition_of_fp32_groups[i],
                                    estimate_dtype=estimate_dtype))
        self.accum_dtype, self.comm_dtype = accum_dtype, comm_dtype
        self._grad_views = []
        for i, params in enumerate(self.round_robin_bit16_groups):
            live, grads = groups[i].live, groups[i].grads
            for p in params:
                offset = p.data.storage_offset() - live.storage_offset()
                self._grad_views.append((p, grads.narrow(0, offset, p.numel()).view_as(p)))
        self._accumulate_hooks = []
        if accum_dtype == model_dtype:
            self._attach_grads()  # autograd accumulates straight into G
        else:
            for p, view in self._grad_views:
                self._accumulate_hooks.append(p.register_post_accumulate_grad_hook(_adder(view)))

        phases = acco_config.phase_policy(gradient_accumulation_steps)
        self.metrics = StepMetrics(acco_config.mode)
        self.schedule = AccoSchedule(
            groups, ShardOptimizer(self.optimizer, [p for g in groups for p in g.shard_params]),
            CommLane(synchronous=acco_config.synchronous, timeout_s=acco_config.comm_timeout_s,
                     accelerator=get_accelerator()),
            group=self.acco_group, rank=rank, world=world, mode=acco_config.mode, phases=phases,
            grad_scale=1.0 / gradient_accumulation_steps, clip_grad=self.clip_grad,
            reduce_scatter=collectives.uses_reduce_scatter(self.acco_group),
            track_drift=acco_config.metrics.estimate_drift, report=self._report,
            nonfinite=acco_config.nonfinite, loss_scale=lambda: self.loss_scale, on_commit=self._on_commit)
        self._engine_on_commit = on_commit
        self.pending_acco_state = None  # set by load_state_dict, applied by the engine after loading
        self.stop_requested = False  # set by a SIGTERM handler; sent to every rank with the next round
        if dist.get_rank() == 0:
            logger.info(f"ACCO: mode={acco_config.mode} accumulation={acco_config.accumulation} phases={phases} "
                        f"weighting={acco_config.weighting} synchronous={acco_config.synchronous} "
                        f"accumulate={accum_dtype} communicate={comm_dtype} estimate_round={estimate_dtype or comm_dtype} "
                        f"reduce={'reduce_scatter' if self.schedule.reduce_scatter else 'all_reduce+slice'}")

    # -- gradients live in G ------------------------------------------------------------------
    def _attach_grads(self) -> None:
        if self._accumulate_hooks:
            return  # gradients go through the hooks into a wider G
        for p, view in self._grad_views:
            if p.grad is not view:
                p.grad = view

    def backward_prologue(self):
        # Someone (module.zero_grad(), a trainer) may have dropped p.grad; autograd must keep
        # accumulating into G.
        self._attach_grads()
        self.schedule.before_backward()
        return super().backward_prologue()

    def reduce_gradients(self, pipeline_parallel=False):
        """No-op: ACCO reduces in its own rounds at phase ends."""

    def zero_grad(self, set_to_none=True):
        """No-op: the schedule clears G itself (clearing it here would lose the first half)."""

    # -- the phase boundary -------------------------------------------------------------------
    def step(self, closure=None):
        """End the current phase (called by the engine at every ACCO phase boundary)."""
        self.overflow = False
        self.schedule.end_phase()

    def _report(self):
        # Travels with each round to every rank: this rank's metrics, then its stop request.
        return self.metrics.report() + [float(self.stop_requested)]

    def stop_requested_by_any_rank(self) -> bool:
        """Whether a round collected so far carried a stop request from some rank."""
        for r in self.schedule.recent_rounds:
            if r.peer_report is not None and r.peer_report.shape[1] > STOP_FIELD and bool(
                    (r.peer_report[:, STOP_FIELD] > 0).any()):
                return True
        return False

    def _on_commit(self, result: RoundResult) -> None:
        self._global_grad_norm = result.grad_norm
        self.overflow = result.skipped
        if self.dynamic_loss_scale and not self.custom_loss_scaler:
            # DeepSpeed's rule, once per optimizer step: halve after an overflow (the step was
            # skipped), double after scale_window clean steps. The schedule then rescales G.
            self._update_scale(result.skipped)
        record = self.metrics.on_commit(result, self.schedule.recent_rounds, self.schedule.history, self.get_lr(),
                                        loss_scale=self.loss_scale if self.dynamic_loss_scale or
                                        self.dtype == torch.float16 else None)
        if self._engine_on_commit is not None:
            self._engine_on_commit(result, record)

    def drain(self):
        """Wait for the round in flight; returns its result (None if nothing was in flight)."""
        return self.schedule.drain()

    def committed_weights(self):
        """Context manager: the model holds the newest committed θ inside (see ds_acco.committed_weights)."""
        return self.schedule.committed_weights()

    # -- checkpoints: DeepSpeed's ZeRO state plus ACCO's in-flight state ------------------------
    def state_dict(self):
        """DeepSpeed's ZeRO-1 state (committed master shards, optimizer state) plus, under
        ``ACCO_STATE_KEY``, this rank's in-flight state. Drains first."""
        acco_state = self.schedule.state_dict()  # drains: masters and optimizer state are committed
        sd = super().state_dict()
        sd[ACCO_STATE_KEY] = acco_state
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        self.schedule.drain()
        super().load_state_dict(state_dict_list, load_optimizer_states=load_optimizer_states,
                                load_from_fp32_weights=load_from_fp32_weights, checkpoint_folder=checkpoint_folder,
                                load_serial=load_serial, param_shapes=param_shapes)
        world = dist.get_world_size(group=self.dp_process_group)
        self.pending_acco_state = None
        if checkpoint_folder is None and load_optimizer_states and len(state_dict_list) == world:
            self.pending_acco_state = state_dict_list[dist.get_rank(group=self.dp_process_group)].get(ACCO_STATE_KEY)

    def destroy(self):
        for h in self._accumulate_hooks:
            h.remove()
        self.schedule.close()
        super().destroy()
