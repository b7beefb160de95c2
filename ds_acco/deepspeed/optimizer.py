"""``AccoZeroOptimizer``: DeepSpeed's ZeRO stage-1 optimizer, with ACCO owning the communication.

DeepSpeed builds the flat bit16 groups, the fp32 master partitions and the wrapped torch
optimizer exactly as for stock ZeRO-1; this subclass then maps them onto the core's flat
groups (:class:`~ds_acco.core.round.buffers.FlatBuffers`) and hands every phase boundary to the
core's :class:`~ds_acco.core.driver.AccoDriver`.
Stock reduction paths (buckets, gradient hooks) are switched off so their buffers are never
allocated: the only extra full-size tensor is the core's communication buffer.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..config import AccoConfig
from ..core.driver import AccoDriver
from ..core.round.buffers import FlatBuffers, estimate_comm_dtype
from ..core.step.shard_optimizer import ShardOptimizer
from . import functional  # noqa: F401 -- registers DeepSpeed's Adams' functional estimates with the core
from .host import DeepSpeedHost

ACCO_STATE_KEY = "acco_state"


def _stream_accelerator(device: torch.device):
    """DeepSpeed's accelerator for the lane's streams (None on CPU: no streams). A module-level
    function: tests swap in a recording accelerator here."""
    if device.type == "cpu":
        return None
    from deepspeed.accelerator import get_accelerator
    return get_accelerator()


def _adder(views: list, k: int):
    """A post-accumulate-grad hook adding the parameter's gradient into its slice of G (looked up at
    each call: G moves when it swaps with B)."""
    def hook(param: torch.Tensor) -> None:
        view = views[k][1]
        view.add_(param.grad.view_as(view))
        param.grad = None
    return hook


def _follow(optimizer_ref, group: int, what: str):
    """The groups' callback when G (``what`` = "grads") or the parameters' storage ("live") moves.
    Holds the optimizer weakly: the lane's thread reaches the groups, and a strong reference back
    would keep an abandoned engine alive (never collected)."""
    def moved(flat: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            getattr(optimizer, f"_{what}_moved")(group, flat)
    return moved


class AccoZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1 optimizer whose reduce / step / all-gather overlap the next micro-batches (ACCO.md).

    Built by :class:`~ds_acco.deepspeed.engine.AccoEngine`, which checks what was built (check point 2)
    and then calls :meth:`start` (the driver: rounds group, lane); the engine calls :meth:`step` at
    every phase end (``is_gradient_accumulation_boundary()``).
    """

    def __init__(self, init_optimizer, param_names, *, acco_config: AccoConfig, gradient_accumulation_steps: int,
                 engine, comm_dtype: Optional[torch.dtype] = None, **kwargs):
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
        estimate_dtype = estimate_comm_dtype(acco_config.estimate_comm_dtype)
        groups = []
        for i, live in enumerate(self.bit16_groups_flat):
            grads = torch.zeros(live.numel(), dtype=accum_dtype, device=live.device)
            groups.append(FlatBuffers(live, grads, self.single_partition_of_fp32_groups[i], rank=rank, world=world,
                                      comm_dtype=comm_dtype, estimate_dtype=estimate_dtype))
        self.accum_dtype, self.comm_dtype, self.estimate_dtype = accum_dtype, comm_dtype, estimate_dtype
        self._grad_views = []  # (param, its view in G), rebuilt when G moves (_grads_moved)
        self._grad_entries = [[] for _ in groups]  # per group: (index in _grad_views, offset in the flat group)
        # Tensor parallelism (DeepSpeed's model_parallel_* from the mpu): the norm is summed over the
        # model-parallel group as stock does, tensor-parallel shards counted on every rank and
        # replicated parameters on model-parallel rank 0 only.
        model_parallel = self.model_parallel_world_size > 1
        for i, params in enumerate(self.round_robin_bit16_groups):
            live, grads = groups[i].live, groups[i].grads
            counted = []
            for p in params:
                offset = p.data.storage_offset() - live.storage_offset()
                self._grad_views.append((p, grads.narrow(0, offset, p.numel()).view_as(p)))
                self._grad_entries[i].append((len(self._grad_views) - 1, offset))
                if is_model_parallel_parameter(p):
                    counted.append((offset, p.numel()))
            if model_parallel and self.model_parallel_rank != 0:
                groups[i].set_norm_params(counted)
        self._accumulate_hooks = []
        if accum_dtype == model_dtype:
            self._attach_grads()  # autograd accumulates straight into G
        else:
            for k, (p, _) in enumerate(self._grad_views):
                self._accumulate_hooks.append(p.register_post_accumulate_grad_hook(_adder(self._grad_views, k)))
        for i, g in enumerate(groups):
            g.on_grads_moved = _follow(weakref.ref(self), i, "grads")
            g.on_live_moved = _follow(weakref.ref(self), i, "live")
        self.pending_acco_state = None  # set by load_state_dict, applied by the engine after loading
        device = groups[0].live.device
        self._acco_host = DeepSpeedHost(engine, self, groups, gradient_accumulation_steps,
                                        accelerator=_stream_accelerator(device),
                                        model_parallel_group=self.model_parallel_group if model_parallel else None)
        # what check point 2 reads of the shards (AccoEngine); the driver steps them with it
        self.shard_optimizer = ShardOptimizer(self.optimizer, [p for g in groups for p in g.shard_params])
        self.driver: Optional[AccoDriver] = None  # start(): after the engine checked what was built

    def start(self) -> AccoDriver:
        """The core's driver over what this optimizer built (its rounds group and lane), once the
        engine has checked it (check point 2, ``core/checks/built.py``)."""
        self.driver = AccoDriver(self.acco_config, self._acco_host, self.shard_optimizer)
        return self.driver

    @property
    def schedule(self):
        """The core's schedule (phases, rounds, in-flight state)."""
        return self.driver.schedule

    # -- gradients live in G ------------------------------------------------------------------
    def _attach_grads(self) -> None:
        if self._accumulate_hooks:
            return  # gradients go through the hooks into a wider G
        for p, view in self._grad_views:
            if p.grad is not view:
                p.grad = view

    def _grads_moved(self, group: int, grads: torch.Tensor) -> None:
        """G of ``group`` swapped storage with B at a commit launch: the parameters' views follow
        (the next backward_prologue re-points p.grad anyway; here at once, so a caller reading
        p.grad before it sees the new G, not the round's B)."""
        for k, offset in self._grad_entries[group]:
            p = self._grad_views[k][0]
            view = grads.narrow(0, offset, p.numel()).view_as(p)
            self._grad_views[k] = (p, view)
            if not self._accumulate_hooks:
                p.grad = view

    def _live_moved(self, group: int, flat: torch.Tensor) -> None:
        """The parameters of ``group`` view ``flat`` (the flat live weights, or B's gathered
        parameters while an export keeps θ in the live weights: see core/schedule/committed.py)."""
        for k, offset in self._grad_entries[group]:
            p = self._grad_views[k][0]
            p.data = flat.narrow(0, offset, p.numel()).view_as(p)

    def backward_prologue(self):
        # Someone (module.zero_grad(), a trainer) may have dropped p.grad; autograd must keep
        # accumulating into G.
        self._attach_grads()
        self.driver.before_backward()
        return super().backward_prologue()

    def reduce_gradients(self, pipeline_parallel=False):
        """No-op: ACCO reduces in its own rounds at phase ends."""

    def zero_grad(self, set_to_none=True):
        """No-op: the schedule clears G itself (clearing it here would lose the first half)."""

    # -- the phase boundary -------------------------------------------------------------------
    def step(self, closure=None):
        """End the current phase (called by the engine at every ACCO phase boundary).

        ``overflow`` (DeepSpeed's "the step just taken was skipped") stays False: the commit this
        launches is known skipped only at its collection, a phase later, and Accelerate and the HF
        Trainer read the flag right after ``step()`` to skip *this* step's scheduler step. A commit
        collected here is an earlier step's: its skip must not cancel this step's scheduler step
        (DPU collects one commit and launches the next in the same call). ACCO undoes a skipped
        commit's scheduler steps itself (``AccoDriver.caller_scheduler_step``)."""
        self.overflow = False
        self.driver.end_phase()

    def _acco_update_loss_scale(self, skipped: bool) -> Optional[float]:
        if self.dynamic_loss_scale and not self.custom_loss_scaler:
            # DeepSpeed's rule, once per optimizer step: halve after an overflow (the step was
            # skipped), double after scale_window clean steps. The schedule then rescales G.
            self._update_scale(skipped)
        return float(self.loss_scale) if self.dynamic_loss_scale or self.dtype == torch.float16 else None

    def drain(self):
        """Wait for the round in flight; returns its result (None if nothing was in flight)."""
        return self.driver.drain()

    def committed_weights(self):
        """Context manager: the model holds the newest committed θ inside (see ds_acco.committed_weights)."""
        return self.driver.committed_weights()

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
        # DeepSpeed's restore reads and writes the flat live weights: the parameters must view them
        # (after an export they may view B's gathered parameters: see core/schedule/committed.py).
        self.schedule.release_committed_weights(settle=True)
        self.driver.drain_for_load()  # an LR scheduler step still owed is taken after the load
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
        if self.driver is None:  # refused at check point 2 (or the engine failed first): nothing started
            super().destroy()
            return
        if self.driver.abandoned:
            # From a finaliser: DeepSpeed's destroy() synchronises the device, which waits for the
            # lane's round (a collective) on an accelerator. Only its hooks need removing here.
            for h in getattr(self, "_grad_acc_hooks", []):
                h.remove()
            return
        self.driver.close()
        super().destroy()
