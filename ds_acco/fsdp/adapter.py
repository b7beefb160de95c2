"""``AccoFSDP``: ACCO / DPU for a model sharded with FSDP2's ``fully_shard``.

FSDP2 cannot carry a reduction past ``backward()`` (PLATFORM_NOTES.md): FSDP's own gradient sync is
off, gradients accumulate unsharded into G, and the shared core
(:class:`~ds_acco.core.schedule.machine.AccoSchedule`, the comm lane, the shard optimizer) owns their
reduction. FSDP's sharded DTensor parameters are the shards the user's optimizer steps. Two layouts:

- default (ZeRO-1-like): the unsharded parameters stay resident (no reshard after forward or
  backward) and each round all-gathers the new parameters into B, unpacked at the phase end;
- ``sharded_params=True``: parameters stay sharded between uses and FSDP's own per-layer
  all-gather (and prefetch) gathers them for every forward and backward; rounds only reduce and
  step, and the phase-end swap points FSDP's all-gather at the committed shards or at one shard of
  the estimate θ̃ (:class:`~ds_acco.fsdp.buffers.FSDPShardedBuffers`). No resident unsharded copy,
  no parameter half of B.

    model = ...; fully_shard(block) for each block; fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    acco = AccoFSDP(model, optimizer, "ds_config.json", lr_scheduler=sched)
    for x, y in loader:
        acco.backward(model(x, y))
        acco.step()
    with ds_acco.committed_weights(acco):
        evaluate(model)
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..config import acco_config_of
from ..config_deepspeed import load_ds_config
from ..core.checks.built import Built, check_built
from ..core.checks.refusals import check_lockstep, check_schedule_compat, refuse
from ..core.driver import AccoDriver, check_same_on_all_ranks
from ..core.round.buffers import estimate_comm_dtype
from ..core.round.rounds import RoundResult
from ..core.schedule.machine import AccoSchedule
from ..core.step.shard_optimizer import ShardOptimizer
from ..weights import ExportHooks
from . import _torch_internals as fsdp_internals
from .buffers import FSDPBuffers, FSDPShardedBuffers
from .host import FSDPHost, micro_batch_size

_RESET_REFUSED = (
    "FSDP is about to reset its sharded parameters (model.to(), .float() or model.load_state_dict() was called while "
    "AccoFSDP(sharded_params=True) is active): it would re-point the all-gather ACCO directs between the committed "
    "shards and the estimate's, with a round in flight; fix: acco.load_checkpoint() to load weights, or acco.close() "
    "first")
_REGATHER_REFUSED = (
    "FSDP is about to re-gather parameters that ACCO keeps resident (reshard(), .to() or load_state_dict() was "
    "called while AccoFSDP is active): the live weights would be overwritten by the shards; fix: use "
    "acco.save_checkpoint() / acco.load_checkpoint() for checkpoints, model.state_dict() or "
    "ds_acco.committed_weights(acco) with model.named_parameters() to read the committed weights, or acco.close() "
    "first")


class AccoFSDP:
    """ACCO / DPU training of an FSDP2 model (see the module docstring).

    Args:
        model: the model after ``fully_shard`` (applied to the root too).
        optimizer: a torch optimizer over ``model.parameters()`` (FSDP's sharded DTensors), built
            before this object.
        config: a dict or a DeepSpeed-style JSON path; reads ``"acco"``, ``"gradient_accumulation_steps"``,
            ``"gradient_clipping"``, ``"fp16"`` and, for ``global_samples``, ``"train_micro_batch_size_per_gpu"``
            (or ``"train_batch_size"``).
        lr_scheduler: stepped once per committed optimizer step.
        sharded_params: keep the parameters sharded between micro-batches (FSDP gathers them per
            layer, with its prefetch); default: resident unsharded parameters (see the module).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Any, *,
                 lr_scheduler: Any = None, sharded_params: bool = False):
        raw = load_ds_config(config)
        if raw is None:
            raise ValueError("AccoFSDP needs a config (a dict or a JSON path) with an \"acco\" block")
        acco = acco_config_of(raw)
        if not acco.enabled:
            raise refuse("fsdp_disabled", f"acco.enabled = {acco.enabled}")
        acco = acco.for_optimizer(optimizer)  # the estimate's default lr_scale by the optimizer's family
        gas = raw.get("gradient_accumulation_steps", 1)
        if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
            raise ValueError(f"gradient_accumulation_steps = {gas!r}: must be an integer >= 1")
        fp16 = _fp16_config(raw)
        check_schedule_compat(acco, gas, fp16)
        clip = raw.get("gradient_clipping", 0.0) or 0.0
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
            raise ValueError(f"gradient_clipping = {clip!r}: must be a number >= 0 (0: off)")
        if not isinstance(model, FSDPModule):
            raise ValueError(f"AccoFSDP needs a model sharded with fully_shard (the root included), got "
                             f"{type(model).__name__}; fix: call fully_shard(model, ...) after sharding its blocks")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; fix: init_process_group before fully_shard")
        check_same_on_all_ranks({"acco": acco.model_dump(), "gradient_accumulation_steps": gas,
                                 "gradient_clipping": clip, "fp16": raw.get("fp16")},
                                "the \"acco\" block (or gradient_accumulation_steps / gradient_clipping / fp16)",
                                group=_mesh_group(model))
        micro = micro_batch_size(raw, gas, dist.get_world_size(_mesh_group(model)))  # before FSDP is taken over
        self.module = model
        self.optimizer = optimizer
        self.acco_config = acco
        self.gradient_accumulation_steps = gas
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0  # all ranks' samples in the committed steps, as DeepSpeed's engine counts them
        self._weight = 1.0
        self.loss_scaler = None
        if fp16 is not None:  # DeepSpeed's own scaler, configured by the same "fp16" block
            from deepspeed import comm as ds_comm
            from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
            if not ds_comm.is_initialized():  # its scale changes log through deepspeed.comm.get_rank(): wrap
                ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # torch's group, no new one
            self.loss_scaler = CreateLossScaler(torch.float16, fp16.loss_scale, fp16.loss_scale == 0,
                                                fp16.dynamic_loss_scale_args())
        if not isinstance(sharded_params, bool):
            raise ValueError(f"sharded_params = {sharded_params!r}: must be True or False")
        if sharded_params:
            check_lockstep(acco, "AccoFSDP(sharded_params=True) (FSDP all-gathers every micro-batch's parameters "
                                 "over the data-parallel mesh)")
        self.sharded_params = sharded_params
        self.buffers = self._take_over_fsdp(model, acco)  # checked there (check point 2), before the driver
        self.driver = AccoDriver(acco, FSDPHost(self, self._mesh_group, gas, float(clip), micro))
        # Every model.state_dict() (and get_model_state_dict, DCP) reads the committed θ: the
        # sharded parameters FSDP puts in a state dict are the master shards, settled first.
        self._exports = ExportHooks(model, self.driver.schedule, settle_shards=True)
        self._remove_guard = _chain(self._exports.remove, self._remove_guard)  # close() undoes all of it
        self.driver.install_sigterm(save=self.save_checkpoint, checkpoint_dir=self.sigterm_checkpoint_dir)

    def _take_over_fsdp(self, model: FSDPModule, acco) -> FSDPBuffers:
        """FSDP's gradient sync off and gradients into G through hooks; by default FSDP2 in a
        ZeRO-1-like configuration (resident unsharded parameters, FSDP's re-gather guarded), with
        ``sharded_params`` FSDP's own resharding and per-layer all-gathers. The user's FSDP settings
        are noted first and put back by :meth:`close`, or at once if the take-over refuses the model
        (a caller that falls back to plain FSDP must not train with gradient sync off)."""
        modules = fsdp_internals.fsdp_modules(model)
        fsdp_internals.lazy_init(model)  # root first: it decides the defaults we then override
        self.modules = modules
        self.buffers = None
        self._hooks = []
        self._remove_guard = lambda: None
        self._restore_user_settings = fsdp_internals.keep_user_settings(modules)
        try:
            return self._configure_fsdp(modules, acco)
        except BaseException:
            self._give_back_to_fsdp()
            raise

    def _configure_fsdp(self, modules: List[FSDPModule], acco) -> FSDPBuffers:
        for m in modules:
            if not self.sharded_params:
                m.set_reshard_after_forward(False, recurse=False)  # keep the unsharded params resident
                m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)  # grads stay unsharded: ACCO reduces them
        for m in modules:
            m.unshard()  # θ_0 into the unsharded params (this creates them: the hooks go on them)
            if self.sharded_params:
                m.reshard()  # one module's parameters unsharded at a time
        self.regather_allowed = False
        self._remove_guard = (lambda: None) if self.sharded_params else _chain(
            fsdp_internals.guard_regather(modules, lambda: self.regather_allowed, _REGATHER_REFUSED),
            fsdp_internals.state_dict_keeps_resident(modules))  # state_dict() frees nothing ACCO keeps
        params = fsdp_internals.trainable_params(modules)
        if not params:
            raise ValueError("the model has no trainable FSDP parameters; fix: apply fully_shard to modules "
                             "with parameters that require grad")
        estimate_dtype = estimate_comm_dtype(acco.estimate_comm_dtype)
        owned = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if owned != {id(p.sharded) for p in params}:
            raise ValueError("the optimizer must own exactly the shard parameters: the optimizer must hold exactly "
                             "the FSDP model's trainable parameters; fix: build it over model.parameters() after "
                             "fully_shard and before AccoFSDP")
        # Check point 2: what was taken over, once, before any buffer, rounds group or lane (a refusal
        # gives the model back to FSDP: _take_over_fsdp).
        check_built(acco, Built(
            shard_optimizer=ShardOptimizer(self.optimizer, [p.sharded for p in params]),  # its capabilities
            fsdp=dict(one_mesh=all(p.mesh == params[0].mesh for p in params),
                      reduce_dtypes=[p.reduce_dtype for p in params], param_dtypes=[p.param_dtype for p in params],
                      loss_scaling=self.loss_scaler is not None, estimate_comm_dtype=acco.estimate_comm_dtype,
                      estimate_dtype=estimate_dtype, post_forward_mesh=self.sharded_params and any(
                          fsdp_internals.resharded_after_forward_to_a_smaller_mesh(p) for p in params)),
            needs_functional="fsdp_sharded_params_optimizer" if self.sharded_params else None,
            needs_functional_found=f"AccoFSDP(sharded_params=True) with {type(self.optimizer).__name__}"))
        accum_dtype, live_dtype = params[0].reduce_dtype, params[0].param_dtype
        self._mesh_group = params[0].mesh.get_group()
        world = dist.get_world_size(self._mesh_group)
        layout = FSDPShardedBuffers if self.sharded_params else FSDPBuffers
        buffers = layout(params, rank=dist.get_rank(self._mesh_group), world=world, accum_dtype=accum_dtype,
                         live_dtype=live_dtype, device=params[0].unsharded.device, estimate_dtype=estimate_dtype)
        self._hooks = [s.param.unsharded.register_post_accumulate_grad_hook(_accumulate_into(s.grad))
                       for s in buffers.slots]
        self.buffers = buffers
        if isinstance(buffers, FSDPShardedBuffers):
            buffers.reshard = lambda: [m.reshard() for m in modules]
            self._remove_guard = fsdp_internals.guard_reset(params, _RESET_REFUSED)
        return buffers

    # -- the training loop ------------------------------------------------------------------------
    @property
    def schedule(self) -> AccoSchedule:
        return self.driver.schedule

    def backward(self, loss: torch.Tensor, weight: Optional[float] = None, retain_graph: bool = False) -> None:
        """``loss / gradient_accumulation_steps`` backward, accumulated into G. ``weight``: this
        micro-batch's sample or token count, required with ``acco.weighting`` 'sample' / 'token'
        (the loss must then be a sum over those units)."""
        self._weight = self.driver.check_weight(weight, "backward")
        self.driver.before_backward()
        if self.loss_scaler is not None:  # G carries the loss scale; each round divides it out
            loss = loss.float() * self.loss_scaler.cur_scale
        (loss / self.gradient_accumulation_steps).backward(retain_graph=retain_graph)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the backward passes use now (1 without fp16)."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.cur_scale)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends an ACCO phase (decided in ``step()``; asked
        before it, the forecast if the step were now)."""
        return self.driver.is_boundary()

    def step(self) -> None:
        """One micro-batch done; at a phase end, hand the phase to the schedule (ACCO.md)."""
        weight, self._weight = self._weight, 1.0
        with self.driver.micro_batch(weight) as ends:
            if ends:
                self.driver.end_phase()  # a commit collected here runs the driver's bookkeeping

    # -- metrics, committed weights, teardown ---------------------------------------------------
    @property
    def acco_metrics(self) -> Optional[dict]:
        """The last committed step's metrics, or None before the first commit."""
        return self.driver.metrics.last

    @property
    def acco_metrics_history(self) -> List[dict]:
        """The metrics of the last committed steps (oldest first, bounded)."""
        return list(self.driver.metrics.records)

    def acco_committed_weights(self):
        """See :func:`ds_acco.committed_weights`."""
        return self.driver.committed_weights()

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (a finished commit counts as committed)."""
        return self.driver.drain()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The process group of the 1-D mesh the model is sharded over (the ranks that build this
        adapter: the whole world or a subset of it). Checkpoints are collective over it alone."""
        return self._mesh_group

    @property
    def sigterm_checkpoint_dir(self) -> Optional[str]:
        """Where ``acco.sigterm: "checkpoint"`` saves (None without it): ``acco.sigterm_checkpoint_dir``
        itself when the data-parallel mesh spans the whole world; else its subdirectory
        ``dp-group-<g>``, ``g`` the global rank of the mesh's rank 0, so that meshes sharing one
        config (the data-parallel groups of a 2-D mesh) never write into one directory."""
        from . import checkpoint
        root = self.acco_config.sigterm_checkpoint_dir
        return None if root is None else checkpoint.mesh_path(root, self._mesh_group)

    def save_checkpoint(self, path: str) -> None:
        """See :func:`ds_acco.fsdp.checkpoint.save`."""
        from . import checkpoint
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """See :func:`ds_acco.fsdp.checkpoint.load`."""
        from . import checkpoint
        checkpoint.load(self, path)

    def close(self) -> None:
        """Drain, stop the lane, remove the hooks, and give the model back to plain FSDP at the
        committed θ (the next forward all-gathers it from the shards) with the user's own FSDP
        settings (``reshard_after_forward``, ``reshard_after_backward``, gradient sync)."""
        try:
            self.driver.close()
        finally:
            self._give_back_to_fsdp()

    def _give_back_to_fsdp(self) -> None:
        """Plain FSDP again, as the user configured it: hooks and guards off, FSDP gathering from
        the committed shards, parameters sharded, the user's settings back."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._remove_guard()
        if isinstance(self.buffers, FSDPShardedBuffers):
            self.buffers.restore_fsdp()  # FSDP gathers the committed shards again
        for m in self.modules:
            m.reshard()
        self._restore_user_settings()


    def __del__(self):
        # Collected without close(): let go without waiting or communicating (AccoDriver.abandon);
        # the model's hooks hold this adapter, so the model is being collected too.
        driver = self.__dict__.get("driver")
        if driver is not None:
            driver.finalised()


def _mesh_group(model: torch.nn.Module):
    """The process group of the 1-D mesh the model is sharded over: the ranks that build this
    adapter (the mesh may span a subset of the world). None (the default group) for any other
    mesh; the take-over refuses those."""
    from torch.distributed.tensor import DTensor
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    return mesh.get_group() if mesh is not None and mesh.ndim == 1 else None


def _chain(*undo):
    """One function calling each of ``undo`` in turn (what ``close()`` undoes of the take-over)."""
    def run() -> None:
        for fn in undo:
            fn()
    return run


def _accumulate_into(grad: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        # G += this micro-batch's gradient (cast to the reduce dtype); FSDP then sees no grad.
        grad.view_as(p).add_(p.grad)
        p.grad = None
    return hook


def _fp16_config(raw: dict):
    """The config's ``"fp16"`` block parsed by DeepSpeed's own model (None when off)."""
    block = raw.get("fp16")
    if not block or not block.get("enabled", False):
        return None
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    try:
        return DeepSpeedFP16Config(**block)
    except Exception as exc:  # pydantic's ValidationError names the field
        raise ValueError(f"fp16 block {block!r}: {exc}") from None
