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
from deepspeed.runtime.constants import BFLOAT16
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.utils import logger

from ..config import AccoConfig, acco_config_of
from ..config_deepspeed import configured_lr_warmup, load_ds_config, requested_layout
from ..config_keys import check_deepspeed_compat, check_requested_lr_warmup, replaced_keys
from ..config_routing import note_opt_out, opted_out
from ..core.checks.built import check_built
from ..core.checks.refusals import check_layout, refuse, under_caller_boundary
from ..core.schedule.phases import FixedPhases
from ..weights import ExportHooks
from . import checkpoint
from .layout import built_by, built_layout, check_ranks_agree
from .optimizer import AccoZeroOptimizer
from .step_figures import stamped_monitor, unsynchronise_timers

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
    LR scheduler / ``global_steps`` advance once per committed optimizer step. The protocol itself
    is the core's :class:`~ds_acco.core.driver.AccoDriver` (``engine.optimizer.driver``); this
    class only routes DeepSpeed's calls to it."""

    def __init__(self, *args, acco_config: AccoConfig, **kwargs):
        # acco_config: the block :func:`initialize` parsed and checked (check point 1); what this engine
        # built is checked once, before the driver starts (check point 2: check_built below).
        self._acco_config = acco_config
        self._acco_layout = None  # the layout DeepSpeed's groups form (_configure_distributed_model)
        self._acco_client_mpu = kwargs.get("mpu")  # AutoTP replaces engine.mpu with DeepSpeed's groups module
        self._acco_lr_kwargs = None
        self._acco_weight = 1.0
        # Megatron-style callers set the accumulation boundary themselves and call step() once per
        # A micro-batches: then backward() counts micro-batches and ends phases (see backward()).
        self._acco_caller_boundary: Optional[bool] = None  # None: the caller never set it
        self._acco_pending = False  # a backward whose micro-batch step() has not counted yet
        self._acco_window_skipped = False  # a commit skipped since the last step() (caller-boundary mode)
        self._acco_warned_boundary = False
        # While DeepSpeed's step() runs after its model step: whether an optimizer step ended there
        # (a commit was launched), what its per-step figures count (step_figures.py).
        self._acco_step_ended: Optional[bool] = None
        self._acco_commits_at_step = 0  # commits launched when the caller's last step() returned
        self._acco_exports = None  # ExportHooks: every state_dict() of the model reads the committed θ
        super().__init__(*args, **kwargs)
        check_built(self._acco_config, built_by(self, self._acco_layout, AccoZeroOptimizer))  # before rounds, lane
        driver = self.optimizer.start()
        driver.install_sigterm(save=self.save_checkpoint)
        self._acco_exports = ExportHooks(self.module, driver.schedule)
        ignored = replaced_keys(self._config._param_dict)
        if ignored and self.global_rank == 0:
            logger.warning(f"ACCO owns gradient communication; keys {ignored} have no effect (ds_acco/config_keys.py)")
        unsynchronise_timers(self)
        self.monitor = stamped_monitor(self, driver)  # DeepSpeed's per-step events, stamped at each commit's booking

    # -- construction seam ----------------------------------------------------------------------
    def _configure_distributed_model(self, model):
        super()._configure_distributed_model(model)
        # DeepSpeed's groups exist now, however they were built (a user mpu, AutoTP, tp_model_init, a
        # mesh): what check point 2 reads of them.
        self._acco_layout = built_layout(self, model, self._acco_client_mpu, self.client_lr_scheduler)

    def _configure_zero_optimizer(self, optimizer):
        warmup = configured_lr_warmup(self._config, self.client_lr_scheduler)  # family defaults, "lr_warmup"
        cfg = self._acco_config = self._acco_config.for_optimizer(optimizer, lr_warmup_steps=warmup)
        comm_dtype = self._config.communication_data_type  # explicit setting only; else G's dtype

        def build(init_optimizer, param_names, **kwargs):
            return AccoZeroOptimizer(init_optimizer, param_names, acco_config=cfg, engine=self, comm_dtype=comm_dtype,
                                     **kwargs)

        with _substituted(ds_engine_module, "DeepSpeedZeroOptimizer", build):
            return super()._configure_zero_optimizer(optimizer)

    def _do_optimizer_sanity_check(self, basic_optimizer):
        wrapper = super()._do_optimizer_sanity_check(basic_optimizer)
        # DeepSpeed sends bf16 weights with fp32 gradient accumulation to its BF16_Optimizer;
        # ACCO accumulates in fp32 itself, on the ZeRO-1 path.
        return ZERO_OPTIMIZATION if wrapper == BFLOAT16 else wrapper

    # -- phases -----------------------------------------------------------------------------------
    def _acco_driver(self):
        opt = self.__dict__.get("optimizer")
        return opt.driver if isinstance(opt, AccoZeroOptimizer) else None

    def is_gradient_accumulation_boundary(self):
        """True when the current micro-batch ends an ACCO phase (fixed: every A/2 micro-batches in
        'acco', every A in 'dpu'). With dynamic accumulation the phase end is decided in
        ``step()``; asked before it, the answer is the forecast if the step were now. Inside
        ``step()``, after the phase end: whether an optimizer step ended (a commit was launched), so
        DeepSpeed's throughput timer and monitor count optimizer steps as stock does."""
        driver = self._acco_driver()
        if driver is None:
            return super().is_gradient_accumulation_boundary()
        return driver.is_boundary() if self._acco_step_ended is None else self._acco_step_ended

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Megatron-DeepSpeed's protocol (``forward_backward_no_pipelining`` + ``train_step``): the
        caller marks the last of its A micro-batches and calls ``step()`` once per iteration. ACCO
        then counts each ``backward()`` as one micro-batch and ends its phases inside it, at the same
        micro-batches as with one ``step()`` per micro-batch (ACCO.md, "Who ends a phase"); the
        per-iteration ``step(lr_kwargs)`` only records ``lr_kwargs`` and what ``was_step_applied()``
        answers. The caller's flag itself is advisory: the phase ends are ACCO's."""
        if self._acco_driver() is None:
            return super().set_gradient_accumulation_boundary(is_boundary)
        if self._acco_config.accumulation != "fixed":
            raise under_caller_boundary(self._acco_config.accumulation)
        self._acco_caller_boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's ``no_sync()``. ACCO owns gradient communication (it never reduces inside
        ``backward``) and ends its phases at its own micro-batch counts, so for an ACCO engine this
        context changes nothing: a micro-batch inside it is counted like any other. Accelerate's
        ``accumulate()`` enters it on every micro-batch but the last of a step (ZeRO stage < 2),
        and ACCO's ``step()`` runs inside it; DeepSpeed's own would refuse that step."""
        if self._acco_driver() is None:
            with super().no_sync():
                yield
            return
        yield

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, weight=None):
        """DeepSpeed's backward. ``weight``: this micro-batch's sample or token count, required with
        ``acco.weighting`` 'sample' / 'token' (the loss must then be a sum over those units)."""
        driver = self._acco_driver()
        if driver is None:
            if weight is not None:
                raise refuse("weight_unweighted", f"engine.backward(..., weight={weight!r}) without an enabled "
                                                  "\"acco\" block")
            return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        if not scale_wrt_gas:
            raise refuse("unscaled_backward", "engine.backward(..., scale_wrt_gas=False) with ACCO")
        self._acco_leave_committed_weights()  # a backward after eval() without train(): back on the live weights
        self._acco_weight = driver.check_weight(weight, "engine.backward")
        out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        if self._acco_caller_boundary is None:
            self._acco_pending = True  # counted by the step() that follows
            return out
        # The caller sets the boundary itself (Megatron): this backward is the micro-batch.
        weight, self._acco_weight = self._acco_weight, 1.0
        # The LR scheduler step owed for a commit launched here waits for the caller's step(lr_kwargs).
        with driver.micro_batch(weight, step_lr_scheduler=False) as ends:
            self._acco_check_caller_boundary(driver)
            if ends:
                self.optimizer.step()  # ends the phase; a commit collected here is booked now
        return out

    def _acco_check_caller_boundary(self, driver) -> None:
        phases = driver.options.phases
        if self._acco_warned_boundary or not isinstance(phases, FixedPhases):
            return  # dynamic / shared phases: no fixed relation to the caller's batches (refused there)
        at_step_end = driver.schedule.micro_batches % self.gradient_accumulation_steps() == 0
        if at_step_end != self._acco_caller_boundary and self.global_rank == 0:
            self._acco_warned_boundary = True
            logger.warning(f"ACCO: the caller set the accumulation boundary to {self._acco_caller_boundary} at "
                           f"micro-batch {driver.schedule.micro_batches}, but gradient_accumulation_steps="
                           f"{self.gradient_accumulation_steps()}: ACCO keeps counting A micro-batches per "
                           "optimizer step; fix: make the caller's micro-batches per step equal "
                           "gradient_accumulation_steps")

    def step(self, lr_kwargs=None):
        """One micro-batch done; at a phase end, hand the phase to ACCO (see ACCO.md)."""
        driver = self._acco_driver()
        if driver is None:
            return super().step(lr_kwargs)
        self._acco_leave_committed_weights()
        if self._acco_caller_boundary is not None and not self._acco_pending:
            # Once per iteration of a caller that sets the boundary: the micro-batches were counted
            # (and phases ended) in backward(); DeepSpeed's step() counts the optimizer step launched
            # since the last step() and takes its scheduler step (_take_model_step).
            self._acco_step_ended = driver.commits_launched != self._acco_commits_at_step
            try:
                super().step(lr_kwargs)
            finally:
                self._acco_step_ended = None
                self._acco_commits_at_step = driver.commits_launched
            self._step_applied = not self._acco_window_skipped
            self._acco_window_skipped = False
            return None
        self._acco_pending = False
        weight, self._acco_weight = self._acco_weight, 1.0
        with driver.micro_batch(weight):
            try:
                return super().step(lr_kwargs)  # at a phase end: _take_model_step -> optimizer.step()
            finally:
                self._acco_step_ended = None

    def _take_model_step(self, lr_kwargs):
        self._acco_lr_kwargs = lr_kwargs
        driver = self._acco_driver()
        if self._acco_step_ended is None:  # not under a caller-set boundary: this micro-batch ends a phase
            launched = driver.commits_launched
            self.optimizer.step()  # ends the phase; a commit collected here runs the driver's bookkeeping
            self._acco_step_ended = driver.commits_launched != launched
        driver.step_lr_scheduler_owed()  # where stock steps it: the LR read after step() is stock's

    # -- commit bookkeeping (the driver counts global/skipped steps and logs) ----------------------
    def _acco_step_lr_scheduler(self):
        """Stock's scheduler step; returns its inverse under Megatron's protocol, whose
        ``step(increment=n)`` adds n to the scheduler's count (``step(increment=-n)`` takes it back;
        its ``load_state_dict()`` adds the loaded count instead of restoring it)."""
        if self.lr_scheduler is None:
            return None
        kwargs = dict(self._acco_lr_kwargs or {})
        scheduler = self.lr_scheduler
        try:
            scheduler.step(**kwargs)
        except TypeError:
            scheduler.step(self.train_batch_size())
            return None
        increment = kwargs.get("increment")
        if isinstance(increment, (int, float)) and not isinstance(increment, bool):
            return lambda: scheduler.step(**{**kwargs, "increment": -increment})
        return None

    def _acco_book_step(self, event) -> None:
        # What DeepSpeedEngine._take_model_step does besides the scheduler and the step counters, once
        # per committed step (DeepSpeedHost.on_commit: between skipped_steps and global_steps).
        self._step_applied = not event.skipped
        self._acco_window_skipped = self._acco_window_skipped or event.skipped
        if self.steps_per_print() is not None and self.global_rank == 0 and (self.global_steps +
                                                                             1) % self.steps_per_print() == 0:
            self._report_progress(self.global_steps + 1)
        self._global_grad_norm = event.grad_norm
        self.losses = None
        self.global_samples += event.samples(self.train_micro_batch_size_per_gpu())
        self.monitor.booked(self.global_samples)

    @property
    def acco_metrics(self):
        """The last committed step's metrics (a dict), or None before the first commit."""
        return self.optimizer.driver.metrics.last

    @property
    def acco_metrics_history(self):
        """The metrics of the last committed steps (oldest first, bounded)."""
        return list(self.optimizer.driver.metrics.records)

    # -- committed weights, exports and teardown ----------------------------------------------------
    def acco_committed_weights(self):
        """See :func:`ds_acco.committed_weights`."""
        return self.optimizer.committed_weights()

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's, on the committed θ: with AutoTP (``accelerator.get_state_dict`` calls it) it
        gathers the parameters themselves, not a ``state_dict()``, so the export hook is not asked."""
        exports = self.__dict__.get("_acco_exports")
        if exports is not None:
            exports.hold()
        return super()._consolidated_16bit_state_dict(exclude_frozen_parameters)

    def was_step_applied(self) -> bool:
        """DeepSpeed's answer. With a caller that sets the accumulation boundary (Megatron): True
        unless a commit collected during the iteration that the last ``step()`` closed was skipped
        (non-finite gradients) -- also True for the first iterations, before any commit."""
        return super().was_step_applied()

    # -- evaluation on committed weights (ds_acco.install(): Megatron's evaluate()) ----------------
    def eval(self):
        """DeepSpeed's ``eval()``. While :func:`ds_acco.install` is in effect, it also puts the
        newest committed θ into the model until ``train()`` (or the next forward in training mode,
        ``backward`` or ``step``): Megatron's ``evaluate()`` calls ``model.eval()`` ...
        ``model.train()`` on every rank around its forward-only passes, so it never evaluates the
        estimate θ̃. Collective in dynamic mode (a drain): call it on every rank, as Megatron does."""
        super().eval()
        self._acco_enter_eval_weights()

    def train(self, mode=True):
        if mode:
            self._acco_leave_committed_weights()
        super().train(mode)
        if not mode:
            self._acco_enter_eval_weights()

    def _acco_enter_eval_weights(self) -> None:
        from .._routing import installed
        exports = self.__dict__.get("_acco_exports")
        if exports is not None and installed():
            exports.hold(agreed=True)

    def _acco_leave_committed_weights(self, settle: bool = False) -> None:
        """Back on the live weights after a hold (``eval()``, an export's ``state_dict()``);
        ``settle``: before a load, the parameters view the flat live weights again."""
        exports = self.__dict__.get("_acco_exports")
        if exports is not None:
            exports.release(settle)

    def destroy(self):
        """ACCO's drain, then DeepSpeed's destroy -- always, even when the drain raises (a round
        that failed): its error reaches the caller after DeepSpeed has released what it holds."""
        driver = self._acco_driver()
        try:
            if driver is not None:
                if self.__dict__.get("_acco_finalising"):
                    driver.finalised()  # no drain: see __del__
                else:
                    try:
                        driver.close()  # leaves the committed θ in the model: exports after destroy() read it
                    finally:
                        exports, self._acco_exports = self.__dict__.get("_acco_exports"), None
                        if exports is not None:
                            exports.remove()
        finally:
            super().destroy()

    def __del__(self):
        # DeepSpeed's finaliser calls destroy(). For ACCO that would drain: wait for the round in
        # flight, and in dynamic mode agree on it with every rank. The garbage collector may run
        # this on any thread at any time, this engine's own lane thread included (a self-wait) or
        # while the peers build the next engine (a cross-rank hang). So a collected engine lets go
        # without waiting or communicating; destroy() is the orderly end.
        self.__dict__["_acco_finalising"] = True  # no nn.Module machinery: __init__ may not have finished
        super().__del__()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's save, drained first, with the committed θ as the model weights and ACCO's
        in-flight state beside the optimizer state, published atomically (:func:`.checkpoint.save`)."""
        return checkpoint.save(self, super().save_checkpoint, save_dir, tag=tag, client_state=client_state,
                               save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's load; then ACCO's in-flight state is restored when the checkpoint has it
        for this world size, otherwise a fresh phase starts at the loaded (committed) weights
        (:func:`.checkpoint.load`)."""
        return checkpoint.load(self, super().load_checkpoint, load_dir, tag=tag, **kwargs)


def initialize(args: Any = None, model=None, *pos, config: Any = None, config_params: Any = None, **kwargs):
    """Same parameters and return value as ``deepspeed.initialize``.

    With ``"acco": {"enabled": true}`` in the config the engine is an :class:`AccoEngine` and
    ``engine.optimizer`` an :class:`AccoZeroOptimizer`; otherwise (or with ``DS_ACCO=off`` in the
    environment) this *is* ``deepspeed.initialize`` (the A/B switch).
    """
    if pos:
        raise TypeError("ds_acco.initialize takes keyword arguments after 'args' and 'model', like "
                        "deepspeed.initialize")
    raw = load_ds_config(config if config is not None else config_params, args)
    acco = acco_config_of(raw)  # parsed once, here; everything below receives this object
    if acco.enabled and opted_out():  # DS_ACCO=off: one config shared by stock and ACCO runs, this one stock
        note_opt_out()
        acco = acco.model_copy(update={"enabled": False})
    _check_requested(acco, raw, model, kwargs)
    if not acco.enabled:
        return deepspeed.initialize(args=args, model=model, config=config, config_params=config_params, **kwargs)

    def build(*a, **kw):
        # Check point 1, the rest: the same config as DeepSpeed parsed it (every key classified in
        # config_keys), before the engine is built. deepspeed.initialize always passes config_class.
        if kw.get("config_class") is not None:
            check_deepspeed_compat(acco, kw["config_class"], kw.get("lr_scheduler"))
        return AccoEngine(*a, acco_config=acco, **kw)

    with _substituted(deepspeed, "DeepSpeedEngine", build):
        return deepspeed.initialize(args=args, model=model, config=config, config_params=config_params, **kwargs)


def _check_requested(acco: AccoConfig, raw, model, kwargs: dict) -> None:
    """Check point 1 (docs/design.md, "One path for the config"): the refusal table against what the
    caller passed, before any process group or engine exists -- the parallel layout it asks for, the
    ranks' agreement on the block, a PipelineModule. ``AccoEngine`` checks what DeepSpeed built
    (check point 2: the layout of its groups, its optimizer)."""
    check_layout(acco, requested_layout(raw, kwargs.get("mpu"), model, kwargs.get("lr_scheduler"),
                                        kwargs.get("mesh_param")))
    check_requested_lr_warmup(acco, raw, kwargs.get("lr_scheduler"))  # before the ranks' agreement starts a group
    check_ranks_agree(acco, raw, kwargs)
    if not acco.enabled:
        return
    from deepspeed.runtime.pipe.module import PipelineModule
    if isinstance(model, PipelineModule):
        raise refuse("pipeline_module", "acco.enabled = true with a PipelineModule")
