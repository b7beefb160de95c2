"""``AccoEngine`` and ``initialize``: the thin seam between DeepSpeed's engine and the ACCO core.

``deepspeed.initialize`` always builds ``DeepSpeedEngine`` and the engine always builds
``DeepSpeedZeroOptimizer`` (module-level names). We reuse both constructions unchanged and
substitute our subclasses at those two names for the duration of one call, under a lock.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

import deepspeed
import deepspeed.runtime.engine as ds_engine_module
from deepspeed import comm as ds_dist
from deepspeed.runtime.constants import BFLOAT16
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.utils import logger

from ..config import AccoConfig, acco_config_of, check_deepspeed_compat, load_ds_config
from ..metrics import format_line, scalar_items
from . import checkpoint
from .optimizer import _REPLACED_KNOBS, AccoZeroOptimizer

_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _substituted(module, name: str, value):
    with _PATCH_LOCK:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)


class AccoEngine(DeepSpeedEngine):
    """DeepSpeed's engine with ACCO phases: every phase end is an accumulation boundary, and the
    LR scheduler / ``global_steps`` advance once per committed optimizer step."""

    def __init__(self, *args, acco_config: AccoConfig, **kwargs):
        config_class = kwargs.get("config_class")
        if config_class is not None:
            check_deepspeed_compat(acco_config, config_class)
        self._acco_config = acco_config
        self._acco_lr_kwargs = None
        self._acco_boundary = None
        self._acco_weight = 1.0
        super().__init__(*args, **kwargs)
        if not isinstance(self.optimizer, AccoZeroOptimizer):
            raise ValueError(f"acco.enabled = true but DeepSpeed built {type(self.optimizer).__name__}, not a ZeRO "
                             "stage 1 optimizer; fix: use \"zero_optimization\": {\"stage\": 1} with an optimizer "
                             "(client or \"optimizer\" block), or disable acco")
        if acco_config.sigterm != "off":
            self._acco_install_sigterm()
        explicit = self._config._param_dict.get("zero_optimization", {})
        ignored = [k for k in _REPLACED_KNOBS if k in explicit]
        if ignored and self.global_rank == 0:
            logger.warning(f"ACCO owns gradient communication; zero_optimization keys {ignored} have no effect")

    # -- construction seam ----------------------------------------------------------------------
    def _configure_zero_optimizer(self, optimizer):
        cfg = self._acco_config

        comm_dtype = self._config.communication_data_type  # explicit setting only; else G's dtype

        def build(init_optimizer, param_names, **kwargs):
            return AccoZeroOptimizer(init_optimizer, param_names, acco_config=cfg, on_commit=self._acco_on_commit,
                                     comm_dtype=comm_dtype, **kwargs)

        with _substituted(ds_engine_module, "DeepSpeedZeroOptimizer", build):
            return super()._configure_zero_optimizer(optimizer)

    def _do_optimizer_sanity_check(self, basic_optimizer):
        wrapper = super()._do_optimizer_sanity_check(basic_optimizer)
        # DeepSpeed sends bf16 weights with fp32 gradient accumulation to its BF16_Optimizer;
        # ACCO accumulates in fp32 itself, on the ZeRO-1 path.
        return ZERO_OPTIMIZATION if wrapper == BFLOAT16 else wrapper

    # -- phases -----------------------------------------------------------------------------------
    def _acco_schedule(self):
        opt = self.__dict__.get("optimizer")
        return opt.schedule if isinstance(opt, AccoZeroOptimizer) else None

    def is_gradient_accumulation_boundary(self):
        """True when the current micro-batch ends an ACCO phase (fixed: every A/2 micro-batches in
        'acco', every A in 'dpu'). With dynamic accumulation the phase end is decided in
        ``step()``; asked before it, the answer is the forecast if the step were now."""
        schedule = self._acco_schedule()
        if schedule is None:
            return super().is_gradient_accumulation_boundary()
        if self._acco_boundary is not None:
            return self._acco_boundary
        # Outside step() this is a forecast: DeepSpeed asks in forward and backward, and a round
        # that finishes before step() must still end a dynamic phase. step() decides.
        return schedule.phase_ends(decide=False)

    def set_gradient_accumulation_boundary(self, is_boundary):
        raise ValueError("set_gradient_accumulation_boundary() conflicts with ACCO, which ends its own phases; "
                         "fix: call engine.step() after every micro-batch and let ACCO decide (HF Trainer / "
                         "Accelerate: call ds_acco.install() before building the Trainer)")

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, weight=None):
        """DeepSpeed's backward. ``weight``: this micro-batch's sample or token count, required with
        ``acco.weighting`` 'sample' / 'token' (the loss must then be a sum over those units)."""
        schedule = self._acco_schedule()
        if schedule is None:
            if weight is not None:
                raise ValueError("engine.backward(..., weight=...) needs an enabled \"acco\" block with "
                                 "weighting 'sample' or 'token'")
            return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        if not scale_wrt_gas:
            raise ValueError("engine.backward(..., scale_wrt_gas=False) with ACCO: the mean gradient is formed "
                             "from the 1/gradient_accumulation_steps loss scaling; fix: keep scale_wrt_gas=True "
                             "(HF Trainer / Accelerate: call ds_acco.install() before building the Trainer)")
        weighting = self._acco_config.weighting
        if weighting == "micro_batch" and weight is not None:
            raise ValueError(f"engine.backward(..., weight={weight!r}) with acco.weighting = 'micro_batch': every "
                             "micro-batch weighs 1; fix: set acco.weighting to 'sample' or 'token', or drop weight")
        if weighting != "micro_batch":
            if weight is None or not (float(weight) >= 0):
                raise ValueError(f"acco.weighting = {weighting!r} needs engine.backward(loss, weight=n) with the "
                                 f"micro-batch's {weighting} count n >= 0 (got weight={weight!r}); the loss must be "
                                 f"the sum over {weighting}s, not their mean")
        self._acco_weight = 1.0 if weight is None else float(weight)
        return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs=None):
        """One micro-batch done; at a phase end, hand the phase to ACCO (see ACCO.md)."""
        schedule = self._acco_schedule()
        if schedule is None:
            return super().step(lr_kwargs)
        self._acco_boundary = schedule.phase_ends()  # decided once, before the count moves
        schedule.record_micro_batch(self._acco_weight)
        self._acco_weight = 1.0
        try:
            out = super().step(lr_kwargs)
        finally:
            self._acco_boundary = None
        if self.optimizer.stop_requested_by_any_rank():
            self._acco_stop()
        return out

    # -- SIGTERM: every rank stops at the same round --------------------------------------------
    def _acco_install_sigterm(self) -> None:
        import signal
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("acco.sigterm needs the engine to be built on the main thread (signal handlers); "
                             "fix: set \"sigterm\": \"off\"")

        def handler(signum, frame):
            # Only flag it: the request rides along with this rank's next round, so every rank
            # learns it when collecting that same round and stops at the same point.
            self.optimizer.stop_requested = True
        signal.signal(signal.SIGTERM, handler)

    def _acco_stop(self) -> None:
        cfg = self._acco_config
        self._acco_schedule().drain()
        if cfg.sigterm == "checkpoint":
            self.save_checkpoint(cfg.sigterm_checkpoint_dir)
        if self.global_rank == 0:
            logger.info(f"ACCO: stopping on SIGTERM after {self.global_steps} committed steps"
                        + (f", checkpoint in {cfg.sigterm_checkpoint_dir}" if cfg.sigterm == "checkpoint" else ""))
        raise SystemExit(143)

    def _take_model_step(self, lr_kwargs):
        self._acco_lr_kwargs = lr_kwargs
        self.optimizer.step()  # ends the phase; a commit collected here calls _acco_on_commit

    def _acco_on_commit(self, result, record) -> None:
        # Same bookkeeping as DeepSpeedEngine._take_model_step, once per committed step
        # (a skipped step counts in skipped_steps and does not advance the scheduler, as in DeepSpeed).
        self._step_applied = not result.skipped
        if result.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step(**(self._acco_lr_kwargs or {}))
            except TypeError:
                self.lr_scheduler.step(self.train_batch_size())
        if self.steps_per_print() is not None and self.global_rank == 0 and (self.global_steps +
                                                                             1) % self.steps_per_print() == 0:
            self._report_progress(self.global_steps + 1)
        self._global_grad_norm = result.grad_norm
        self.losses = None
        self.global_steps += 1
        total = result.total
        samples = total.weight if self._acco_config.weighting == "sample" else (
            total.micro_batches * self.train_micro_batch_size_per_gpu())
        self.global_samples += int(samples)
        self._acco_emit(record)

    def _acco_emit(self, record) -> None:
        cfg = self._acco_config.metrics
        if self.global_rank != 0:
            return
        if cfg.monitor and self.monitor.enabled:
            self.monitor.write_events([(f"ACCO/{k}", v, self.global_samples) for k, v in scalar_items(record)])
        if cfg.log_every and record["step"] % cfg.log_every == 0:
            logger.info(format_line(record))

    @property
    def acco_metrics(self):
        """The last committed step's metrics (a dict), or None before the first commit."""
        return self.optimizer.metrics.last

    @property
    def acco_metrics_history(self):
        """The metrics of the last committed steps (oldest first, bounded)."""
        return list(self.optimizer.metrics.records)

    # -- committed weights and teardown -----------------------------------------------------------
    def acco_committed_weights(self):
        """See :func:`ds_acco.committed_weights`."""
        return self.optimizer.committed_weights()

    def destroy(self):
        schedule = self._acco_schedule()
        if schedule is not None:
            schedule.close()
        super().destroy()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's save, drained first, with the committed θ as the model weights and ACCO's
        in-flight state beside the optimizer state, published atomically (see checkpoint.py)."""
        schedule = self._acco_schedule()
        schedule.drain()  # may book a commit: the tag then names the step it contains
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        rank = self.local_rank if self.use_node_local_storage() else self.global_rank
        if rank == 0:
            checkpoint.clear_scratch(save_dir, tag)
        with schedule.committed_weights():
            super().save_checkpoint(save_dir, tag=checkpoint.scratch_tag(tag), client_state=client_state,
                                    save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
        if rank == 0:
            checkpoint.publish(save_dir, tag, save_latest)
        ds_dist.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's load; then ACCO's in-flight state is restored when the checkpoint has it
        for this world size, otherwise a fresh phase starts at the loaded (committed) weights."""
        schedule = self._acco_schedule()
        schedule.drain()
        self.optimizer.pending_acco_state = None
        out = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if out[0] is None:
            return out
        state = self.optimizer.pending_acco_state
        self.optimizer.pending_acco_state = None
        restored = False
        if state is not None:
            try:
                schedule.load_state_dict(state)
                restored = True
            except ValueError as exc:
                logger.warning(f"{exc}; starting a fresh ACCO phase at the loaded weights")
        if not restored:
            schedule.reset(self.global_steps)
            if self.global_rank == 0:
                logger.info("ACCO: no usable in-flight state in the checkpoint (stock ZeRO-1 checkpoint, other "
                            "world size, or optimizer states not loaded): starting a fresh phase")
        return out


def _check_same_on_all_ranks(acco: AccoConfig, raw: Optional[dict], kwargs: dict) -> None:
    """Refuse a run whose ranks disagree on the ACCO settings (e.g. enabled on one rank only):
    they would issue different collectives and hang. One small collective at start-up."""
    import json

    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if kwargs.get("dist_init_required") is False and not dist.is_initialized():
        return
    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                             distributed_port=kwargs.get("distributed_port", 29500),
                             dist_init_required=kwargs.get("dist_init_required"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = json.dumps({"acco": acco.model_dump(), "gradient_accumulation_steps":
                       (raw or {}).get("gradient_accumulation_steps"), "fp16": (raw or {}).get("fp16")},
                      sort_keys=True, default=str)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(f"the \"acco\" block (or gradient_accumulation_steps / fp16) differs between ranks: {lines}; "
                         "fix: give every rank the same DeepSpeed config")


def initialize(args: Any = None, model=None, *pos, config: Any = None, config_params: Any = None, **kwargs):
    """Same parameters and return value as ``deepspeed.initialize``.

    With ``"acco": {"enabled": true}`` in the config the engine is an :class:`AccoEngine` and
    ``engine.optimizer`` an :class:`AccoZeroOptimizer`; otherwise this *is*
    ``deepspeed.initialize`` (the A/B switch).
    """
    if pos:
        raise TypeError("ds_acco.initialize takes keyword arguments after 'args' and 'model', like "
                        "deepspeed.initialize")
    raw = load_ds_config(config if config is not None else config_params, args)
    acco = acco_config_of(raw)
    _check_same_on_all_ranks(acco, raw, kwargs)
    if not acco.enabled:
        return deepspeed.initialize(args=args, model=model, config=config, config_params=config_params, **kwargs)
    from deepspeed.runtime.pipe.module import PipelineModule
    if isinstance(model, PipelineModule):
        raise ValueError("acco.enabled = true with a PipelineModule: pipeline engines are not supported by ACCO; "
                         "fix: disable acco or train without pipeline parallelism")

    def build(*a, **kw):
        return AccoEngine(*a, acco_config=acco, **kw)

    with _substituted(deepspeed, "DeepSpeedEngine", build):
        return deepspeed.initialize(args=args, model=model, config=config, config_params=config_params, **kwargs)


