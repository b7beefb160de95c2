"""``AccoFSDP``: ACCO / DPU for a model sharded with FSDP2's ``fully_shard``.

FSDP2 cannot carry a reduction past ``backward()`` (PLATFORM_NOTES.md), so it runs here in a
ZeRO-1-like configuration: the unsharded parameters stay resident (no reshard after forward or
backward), FSDP's own gradient sync is off, gradients accumulate unsharded into G, and the shared
core (:class:`~ds_acco.core.schedule.AccoSchedule`, the comm lane, the shard optimizer) owns all
communication. FSDP's sharded DTensor parameters are the shards the user's optimizer steps.

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

import json
import logging
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..comm import collectives
from ..comm.lane import CommLane
from ..config import AccoConfig, acco_config_of, check_schedule_compat, load_ds_config
from ..core.schedule import AccoSchedule, RoundResult
from ..core.shard_optimizer import ShardOptimizer
from ..metrics import StepMetrics, format_line
from .group import FSDPShardGroup

logger = logging.getLogger(__name__)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fsdp_modules(model: torch.nn.Module) -> List[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(module: FSDPModule):
    return list(module._get_fsdp_state()._fsdp_param_groups)


class AccoFSDPOptimizer:
    """The FSDP counterpart of ``AccoZeroOptimizer``: builds the flat group, the dedicated process
    group, the lane and the schedule over FSDP's shards; ``schedule`` is the shared core's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, acco_config: AccoConfig,
                 gradient_accumulation_steps: int, clip_grad: float, on_commit=None, loss_scaler=None):
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.acco_config = acco_config
        modules = _fsdp_modules(model)
        # Root first: its lazy init decides the root and the defaults we then override.
        model._get_fsdp_state()._lazy_init()
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)  # keep the unsharded params resident
            m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)  # grads stay unsharded: ACCO reduces them
        for m in modules:
            m.unshard()  # θ_0 into the resident unsharded params (FSDP's one all-gather)
        self.modules = modules
        self._guard_regather(modules)
        fsdp_params = [fp for m in modules for pg in _param_groups(m) for fp in pg.fsdp_params
                       if fp.sharded_param.requires_grad]
        if not fsdp_params:
            raise ValueError("the model has no trainable FSDP parameters; fix: apply fully_shard to modules "
                             "with parameters that require grad")
        mesh = fsdp_params[0].mesh_info.mesh
        for fp in fsdp_params:
            if fp.mesh_info.mesh != mesh or mesh.ndim != 1:
                raise ValueError("AccoFSDP supports one 1-D device mesh for every fully_shard call (plain FSDP, "
                                 "not HSDP or 2-D meshes); fix: pass the same 1-D mesh to every fully_shard")
            if fp.is_dtensor or fp.fsdp_placement.dim != 0:
                raise ValueError("AccoFSDP shards parameters on dim 0 only, with plain (non-DTensor) module "
                                 "parameters; fix: drop shard_placement_fn / tensor parallelism")
            if fp.offload_to_cpu:
                raise ValueError("CPUOffloadPolicy is not supported by AccoFSDP; fix: remove offload_policy")
        dtypes = {fp.reduce_dtype or fp.param_dtype or fp.orig_dtype for fp in fsdp_params}
        live_dtypes = {fp.param_dtype or fp.orig_dtype for fp in fsdp_params}
        if len(dtypes) != 1 or len(live_dtypes) != 1:
            raise ValueError("AccoFSDP needs one MixedPrecisionPolicy (param_dtype / reduce_dtype) for the whole "
                             "model; fix: pass the same mp_policy to every fully_shard")
        accum_dtype = dtypes.pop()
        live_dtype = live_dtypes.pop()
        if loss_scaler is not None and (live_dtype != torch.float16 or accum_dtype != torch.float32):
            raise ValueError(f"fp16.enabled = true, but the model computes in {live_dtype} and reduces in "
                             f"{accum_dtype}: loss scaling is for fp16 compute with fp32 gradients; fix: "
                             "fully_shard with MixedPrecisionPolicy(param_dtype=torch.float16, "
                             "reduce_dtype=torch.float32), or remove the fp16 block")
        if loss_scaler is None and live_dtype == torch.float16:
            raise ValueError("the model computes in float16 (MixedPrecisionPolicy param_dtype) without loss "
                             "scaling: small gradients would underflow; fix: add \"fp16\": {\"enabled\": true} "
                             "(dynamic loss scaling) to the config, or use bf16")
        estimate_dtype = _DTYPES[acco_config.estimate_comm_dtype] if acco_config.estimate_comm_dtype else None
        if estimate_dtype is not None and estimate_dtype.itemsize > accum_dtype.itemsize:
            raise ValueError(f"acco.estimate_comm_dtype = {acco_config.estimate_comm_dtype!r} is wider than the "
                             f"communication dtype {accum_dtype} (the MixedPrecisionPolicy's reduce_dtype, else "
                             "param_dtype); fix: use a narrower one (e.g. 'bf16') or remove it")

        pg = mesh.get_group()
        ranks = dist.get_process_group_ranks(pg)
        rank, world = dist.get_rank(pg), len(ranks)
        # Our own group: rounds run on the lane's thread, and gloo matches collectives by issue order.
        self.acco_group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=acco_config.comm_timeout_s))
        device = fsdp_params[0]._unsharded_param.device
        self.group = FSDPShardGroup(fsdp_params, rank=rank, world=world, accum_dtype=accum_dtype, device=device,
                                    estimate_dtype=estimate_dtype)
        self._hooks = [s.fsdp_param._unsharded_param.register_post_accumulate_grad_hook(self._accumulate_hook(s))
                       for s in self.group.slots]
        try:
            shard_optimizer = ShardOptimizer(optimizer, self.group.shard_params)
        except ValueError as exc:
            raise ValueError(f"{exc}: the optimizer must hold exactly the FSDP model's trainable parameters; fix: "
                             "build it over model.parameters() after fully_shard and before AccoFSDP") from None

        phases = acco_config.phase_policy(gradient_accumulation_steps)
        self.metrics = StepMetrics(acco_config.mode)
        self._on_commit_cb = on_commit
        self.schedule = AccoSchedule(
            [self.group], shard_optimizer,
            CommLane(synchronous=acco_config.synchronous, timeout_s=acco_config.comm_timeout_s,
                     accelerator=_accelerator(device)),
            group=self.acco_group, rank=rank, world=world, mode=acco_config.mode, phases=phases,
            grad_scale=1.0 / gradient_accumulation_steps, clip_grad=clip_grad,
            reduce_scatter=collectives.uses_reduce_scatter(self.acco_group),
            track_drift=acco_config.metrics.estimate_drift, report=self.metrics.report,
            nonfinite=acco_config.nonfinite, on_commit=self._on_commit,
            loss_scale=None if loss_scaler is None else (lambda: loss_scaler.cur_scale))

    def _guard_regather(self, modules) -> None:
        """FSDP re-gathers the unsharded params from the shards after ``model.state_dict()``,
        ``reshard()`` or ``.to()``; the shards hold the committed θ, not the estimate θ̃ the compute
        lane may be using, and the schedule writes into those tensors. Refuse it loudly instead."""
        self.regather_allowed = False
        self._guarded = [pg for m in modules for pg in _param_groups(m)]
        for pg in self._guarded:
            inner = pg.unshard

            def unshard(async_op: bool = False, _pg=pg, _inner=inner):
                if not _pg.is_unsharded and not self.regather_allowed:
                    raise RuntimeError(
                        "FSDP is about to re-gather parameters that ACCO keeps resident (model.state_dict(), "
                        "reshard() or .to() was called while AccoFSDP is active): the live weights would be "
                        "overwritten by the shards; fix: use acco.save_checkpoint() for checkpoints, "
                        "ds_acco.committed_weights(acco) with model.named_parameters() to read the weights, "
                        "or acco.close() first")
                return _inner(async_op)
            pg.unshard = unshard  # instance attribute: FSDP's own calls go through it

    def _unguard_regather(self) -> None:
        for pg in self._guarded:
            pg.__dict__.pop("unshard", None)
        self._guarded = []

    @staticmethod
    def _accumulate_hook(slot):
        grad = slot.grad

        def hook(p: torch.Tensor) -> None:
            # G += this micro-batch's gradient (cast to the reduce dtype); FSDP then sees no grad.
            grad.view_as(p).add_(p.grad)
            p.grad = None
        return hook

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _on_commit(self, result: RoundResult) -> None:
        scaler = self.loss_scaler
        if scaler is not None and scaler.dynamic:
            scaler.update_scale(result.skipped)  # DeepSpeed's rule, once per optimizer step
        record = self.metrics.on_commit(result, self.schedule.recent_rounds, self.schedule.history, self.get_lr(),
                                        loss_scale=None if scaler is None else scaler.cur_scale)
        if self._on_commit_cb is not None:
            self._on_commit_cb(result, record)

    def committed_weights(self):
        return self.schedule.committed_weights()

    def close(self) -> None:
        """Drain and stop the lane, remove the hooks, and give the model back to plain FSDP at
        the committed θ (the next forward all-gathers it from the shards)."""
        try:
            self.schedule.close()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._unguard_regather()
            for m in self.modules:
                m.reshard()
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)


def _accelerator(device: torch.device):
    """What the lane needs for streams: nothing on CPU; DeepSpeed's accelerator object elsewhere."""
    if device.type == "cpu":
        return None
    from deepspeed.accelerator import get_accelerator  # same Stream/Event interface the lane expects
    return get_accelerator()


class AccoFSDP:
    """ACCO / DPU training of an FSDP2 model (see the module docstring).

    Args:
        model: the model after ``fully_shard`` (applied to the root too).
        optimizer: a torch optimizer over ``model.parameters()`` (FSDP's sharded DTensors), built
            before this object.
        config: a dict or a DeepSpeed-style JSON path; reads ``"acco"``, ``"gradient_accumulation_steps"``
            and ``"gradient_clipping"``.
        lr_scheduler: stepped once per committed optimizer step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Any, *,
                 lr_scheduler: Any = None):
        raw = load_ds_config(config)
        if raw is None:
            raise ValueError("AccoFSDP needs a config (a dict or a JSON path) with an \"acco\" block")
        acco = acco_config_of(raw)
        if not acco.enabled:
            raise ValueError(f"acco.enabled = {acco.enabled}: AccoFSDP always runs ACCO/DPU; fix: set \"acco\": "
                             "{\"enabled\": true, ...}, or train the FSDP model with its own loop for the stock "
                             "baseline")
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
        _check_same_on_all_ranks(acco, gas, clip, raw.get("fp16"))
        self.module = model
        self.acco_config = acco
        self.gradient_accumulation_steps = gas
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.skipped_steps = 0
        self._boundary: Optional[bool] = None
        self._weight = 1.0
        self.loss_scaler = None
        if fp16 is not None:  # DeepSpeed's own scaler, configured by the same "fp16" block
            from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
            self.loss_scaler = CreateLossScaler(torch.float16, fp16.loss_scale, fp16.loss_scale == 0,
                                                fp16.dynamic_loss_scale_args())
        self.optimizer = AccoFSDPOptimizer(model, optimizer, acco_config=acco, gradient_accumulation_steps=gas,
                                           clip_grad=float(clip), on_commit=self._on_commit,
                                           loss_scaler=self.loss_scaler)
        if dist.get_rank() == 0:
            logger.info(f"ACCO (FSDP2): mode={acco.mode} accumulation={acco.accumulation} "
                        f"phases={self.optimizer.schedule.phases} synchronous={acco.synchronous} "
                        f"G/B dtype={self.optimizer.group.comm.dtype}")

    # -- the training loop ------------------------------------------------------------------------
    @property
    def schedule(self) -> AccoSchedule:
        return self.optimizer.schedule

    def backward(self, loss: torch.Tensor, weight: Optional[float] = None, retain_graph: bool = False) -> None:
        """``loss / gradient_accumulation_steps`` backward, accumulated into G. ``weight``: this
        micro-batch's sample or token count, required with ``acco.weighting`` 'sample' / 'token'
        (the loss must then be a sum over those units)."""
        weighting = self.acco_config.weighting
        if weighting == "micro_batch" and weight is not None:
            raise ValueError(f"backward(..., weight={weight!r}) with acco.weighting = 'micro_batch': every "
                             "micro-batch weighs 1; fix: set acco.weighting to 'sample' or 'token', or drop weight")
        if weighting != "micro_batch" and (weight is None or not (float(weight) >= 0)):
            raise ValueError(f"acco.weighting = {weighting!r} needs backward(loss, weight=n) with the "
                             f"micro-batch's {weighting} count n >= 0 (got weight={weight!r}); the loss must be "
                             f"the sum over {weighting}s, not their mean")
        self._weight = 1.0 if weight is None else float(weight)
        self.schedule.before_backward()
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
        if self._boundary is not None:
            return self._boundary
        return self.schedule.phase_ends(decide=False)

    def step(self) -> None:
        """One micro-batch done; at a phase end, hand the phase to the schedule (ACCO.md)."""
        schedule = self.schedule
        self._boundary = schedule.phase_ends()
        schedule.record_micro_batch(self._weight)
        self._weight = 1.0
        try:
            if self._boundary:
                schedule.end_phase()  # a commit collected here calls _on_commit
        finally:
            self._boundary = None

    def _on_commit(self, result: RoundResult, record: dict) -> None:
        if result.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        cfg = self.acco_config.metrics
        if cfg.log_every and record["step"] % cfg.log_every == 0 and dist.get_rank() == 0:
            logger.info(format_line(record))

    # -- metrics, committed weights, teardown ---------------------------------------------------
    @property
    def metrics(self) -> Optional[dict]:
        """The last committed step's metrics, or None before the first commit."""
        return self.optimizer.metrics.last

    @property
    def metrics_history(self) -> List[dict]:
        """The metrics of the last committed steps (oldest first, bounded)."""
        return list(self.optimizer.metrics.records)

    def acco_committed_weights(self):
        """See :func:`ds_acco.committed_weights`."""
        return self.optimizer.committed_weights()

    def drain(self) -> Optional[RoundResult]:
        """Wait for the round in flight (a finished commit counts as committed)."""
        return self.schedule.drain()

    def save_checkpoint(self, path: str) -> None:
        """See :func:`ds_acco.fsdp.checkpoint.save`."""
        from . import checkpoint
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """See :func:`ds_acco.fsdp.checkpoint.load`."""
        from . import checkpoint
        checkpoint.load(self, path)

    def close(self) -> None:
        """Drain, stop the lane and leave the model as plain FSDP at the committed θ."""
        self.optimizer.close()


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


def _check_same_on_all_ranks(acco: AccoConfig, gas: int, clip, fp16=None) -> None:
    """Ranks that disagree on the settings would issue different collectives and hang (or, for
    the fp16 loss-scaling settings, sum gradients carrying different scales)."""
    mine = json.dumps({"acco": acco.model_dump(), "gradient_accumulation_steps": gas,
                       "gradient_clipping": clip, "fp16": fp16}, sort_keys=True, default=str)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(f"the \"acco\" block (or gradient_accumulation_steps / gradient_clipping / fp16) differs "
                         f"between ranks: {lines}; fix: give every rank the same config")
