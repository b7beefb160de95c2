"""``ds_acco.install()``: make code that calls ``deepspeed.initialize`` itself (HF Trainer,
Accelerate, Lightning's ``DeepSpeedStrategy``, Megatron-style scripts) honour the ``"acco"`` block
of its DeepSpeed config.

    import ds_acco
    ds_acco.install()          # once, before the trainer builds its engine
    trainer = Trainer(..., args=TrainingArguments(..., deepspeed="ds_configs/acco.json"))

Exact scope (everything this module changes, and only while installed):

1. ``deepspeed.initialize`` (the module attribute) becomes a router. A call whose config (a dict,
   a JSON path, or ``args.deepspeed_config``, resolved like DeepSpeed does) holds an ``"acco"``
   block with ``"enabled": true`` goes to :func:`ds_acco.deepspeed.engine.initialize`. Every other
   call -- no config, an unreadable config, no block, ``"enabled": false`` -- goes to the original
   function with the same arguments, unchanged. An invalid ``"acco"`` block raises ds_acco's
   ``ValueError`` naming the key. Callers that look the name up at call time are covered:
   Accelerate (``_prepare_deepspeed`` does ``import deepspeed; deepspeed.initialize(...)``, checked
   with accelerate 1.15) and through it HF ``Trainer`` (transformers 5.x never calls DeepSpeed's
   ``initialize`` directly). A module that did ``from deepspeed import initialize`` *before*
   ``install()`` keeps the original: call ``install()`` first, or use ``ds_acco.initialize``.
2. Once an ACCO engine exists (or at ``install()`` when these modules are already imported),
   three framework methods get a branch that is taken only for an ACCO engine; for any other
   engine they run the original code:

   * ``accelerate.utils.deepspeed.DeepSpeedEngineWrapper.backward``: Accelerate calls
     ``engine.set_gradient_accumulation_boundary(sync_gradients)``, ``engine.backward(loss,
     scale_wrt_gas=False)`` on every micro-batch and ``engine.step()`` only on its sync
     micro-batches. ACCO ends its own phases and counts micro-batches in ``engine.step()``, so for
     an ACCO engine this runs ``engine.backward`` then ``engine.step()`` on every micro-batch and
     skips the boundary call. A loss the caller already scaled by 1/A (``scale_wrt_gas=False``, as
     HF Trainer does) is multiplied back by A, and DeepSpeed's own 1/A scaling is applied: the
     same gradient (exact when A is a power of two).
   * ``transformers.Trainer.evaluation_loop`` and ``transformers.Trainer.save_model`` run inside
     :func:`ds_acco.committed_weights`: at the Trainer's step boundaries ACCO's live weights are the
     estimate θ̃, which must be neither evaluated nor exported.
   * ``transformers.Trainer._maybe_log_save_evaluate``: on a step the Trainer logs, the commit of
     that step is waited for first, and the ``grad_norm`` logged is that step's own, as stock
     logs it (the Trainer reads it right after the ``step()`` that launched the commit, when ACCO
     only knows the previous step's; on the first step, none).
   * ``accelerate.scheduler.AcceleratedScheduler.step`` (the scheduler Accelerate and the HF
     Trainer step after each optimizer step): its step is taken as before and undone if the commit
     it follows turns out skipped (non-finite gradient, fp16 overflow), as stock skips it then
     (``step_was_skipped``); see ``AccoDriver.caller_scheduler_step``.
   * Lightning's evaluation loop (``_EvaluationLoop.run`` of ``lightning.pytorch`` and of
     ``pytorch_lightning``, checked with Lightning 2.6) runs inside :func:`ds_acco.committed_weights`
     when the strategy's model is an ACCO engine (``DeepSpeedStrategy``): validation and test
     evaluate θ even when the module keeps its layers in training mode (an ``on_validation_model_eval``
     override: no ``engine.eval()``). The loop, not a Callback: one place, on every Trainer, and the
     live weights come back even when validation raises.
3. ``deepspeed.runtime.engine.DeepSpeedEngine.__init__`` runs unchanged, then warns on rank 0 (DeepSpeed's
   logger) when it built a stock engine from a config whose ``"acco"`` block is enabled: an
   ``initialize`` looked up before ``install()``, or an engine constructed directly, would otherwise
   train without ACCO silently.

The router itself calls the original ``deepspeed.initialize`` (``ds_acco.initialize`` does), so
a thread-local guard sends nested calls straight to the original. ``install()`` is idempotent,
``uninstall()`` restores every original that is still ours (a name someone re-patched after us
is left alone), and both hold one lock.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Mapping
from typing import Any, Callable, List, Tuple

from . import _routing
from ._routing import installed
from .config import ACCO_KEY, acco_config_of, load_ds_config, note_opt_out, opted_out

_LOCK = threading.RLock()
_ROUTING = threading.local()  # .active: this thread is inside the router (nested calls -> original)
_patches: List[Tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, ours), in patch order
_MISSING = object()  # the patched class only inherited the attribute


def install() -> None:
    """Route later ``deepspeed.initialize`` calls with an enabled ``"acco"`` block to ds_acco, and
    adapt Accelerate / HF Trainer to ACCO engines (see the module docstring for the exact scope).
    Idempotent and thread-safe; undone by :func:`uninstall`."""
    import deepspeed

    with _LOCK:
        if _routing.original_initialize is None:
            original = deepspeed.initialize
            _routing.original_initialize = original
            _patch(deepspeed, "initialize", _make_router(original))
            engine = deepspeed.runtime.engine.DeepSpeedEngine
            _patch(engine, "__init__", _warn_if_stock(engine.__init__))
        _patch_frameworks()


def uninstall() -> None:
    """Undo :func:`install`: every patched name that still holds our function gets its original
    back. Engines built meanwhile keep working. Idempotent and thread-safe."""
    with _LOCK:
        for owner, name, original, ours in reversed(_patches):
            if _current(owner, name) is not ours:
                continue  # someone patched it again after us: theirs stays
            if original is _MISSING:
                delattr(owner, name)  # it was inherited; the class dict gets back to what it was
            else:
                setattr(owner, name, original)
        _patches.clear()
        _routing.original_initialize = None


# -- the router ------------------------------------------------------------------------------------
def _make_router(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if getattr(_ROUTING, "active", False) or not _acco_enabled(signature, args, kwargs):
            return original(*args, **kwargs)
        from .deepspeed.engine import initialize as acco_initialize  # imports deepspeed's engine

        bound = signature.bind(*args, **kwargs)  # ds_acco.initialize takes keywords after `model`
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "accelerate":  # Accelerate, and HF Trainer through it
            _refuse_dynamic_under_accelerate(bound.arguments)
        _ROUTING.active = True
        try:
            out = acco_initialize(**bound.arguments)
        finally:
            _ROUTING.active = False
        with _LOCK:
            if installed():
                _patch_frameworks()  # the caller's framework is imported by now
        return out

    initialize.__ds_acco_router__ = True
    return initialize


def _acco_enabled(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """Whether a ``deepspeed.initialize`` call asks for ACCO. Anything this cannot read is left to
    DeepSpeed, which reports it in its own words; an invalid ``"acco"`` block raises here."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return False
    a = bound.arguments
    config = a.get("config") if a.get("config") is not None else a.get("config_params")
    try:
        raw = load_ds_config(config, a.get("args"))
    except (OSError, ValueError, TypeError):
        return False
    if not isinstance(raw, Mapping) or ACCO_KEY not in raw:
        return False
    return acco_config_of(raw).enabled and not opted_out()  # DS_ACCO=off: stock on purpose


# -- framework adapters ----------------------------------------------------------------------------
def _is_acco_engine(engine) -> bool:
    mod = sys.modules.get("ds_acco.deepspeed.optimizer")  # no ACCO engine can exist before its import
    return mod is not None and isinstance(getattr(engine, "optimizer", None), mod.AccoZeroOptimizer)


def _patch_frameworks() -> None:
    """Adapt Accelerate's engine wrapper and scheduler, HF Trainer and Lightning, if imported (idempotent)."""
    acc = sys.modules.get("accelerate.utils.deepspeed")
    wrapper = getattr(acc, "DeepSpeedEngineWrapper", None)
    if wrapper is not None and not _is_patched(wrapper, "backward"):
        _patch(wrapper, "backward", _accelerate_backward(wrapper.backward))
    scheduler = getattr(sys.modules.get("accelerate.scheduler"), "AcceleratedScheduler", None)
    if scheduler is not None and not _is_patched(scheduler, "step"):
        _patch(scheduler, "step", _undone_if_commit_skipped(scheduler.step))
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer = getattr(trainer_mod, "Trainer", None)
    if trainer is not None:
        for name in ("evaluation_loop", "save_model"):
            if hasattr(trainer, name) and not _is_patched(trainer, name):
                _patch(trainer, name, _on_committed_weights(getattr(trainer, name)))
        name = "_maybe_log_save_evaluate"
        if hasattr(trainer, name) and not _is_patched(trainer, name):
            _patch(trainer, name, _logs_the_steps_own_grad_norm(getattr(trainer, name)))
    for package in ("lightning.pytorch", "pytorch_lightning"):  # the unified package and the standalone one
        loop = getattr(sys.modules.get(f"{package}.loops.evaluation_loop"), "_EvaluationLoop", None)
        if loop is not None and not _is_patched(loop, "run"):
            _patch(loop, "run", _on_committed_weights(loop.run, _lightning_engine))


def _under_accelerate_refusal(accumulation: str) -> ValueError:
    from .core.checks.refusals import under_accelerate  # here: importing ds_acco must not import the core
    return under_accelerate(accumulation)


def _refuse_dynamic_under_accelerate(arguments: dict) -> None:
    """Refused at ``initialize``, before any engine or banner exists (not at the first backward):
    dynamic and shared accumulation."""
    a = arguments
    raw = load_ds_config(a.get("config") if a.get("config") is not None else a.get("config_params"), a.get("args"))
    accumulation = acco_config_of(raw).accumulation
    if accumulation != "fixed":
        raise _under_accelerate_refusal(accumulation)


def _accelerate_backward(original: Callable) -> Callable:
    @functools.wraps(original)
    def backward(self, loss, sync_gradients=True, **kwargs):
        engine = self.engine
        if not _is_acco_engine(engine):
            return original(self, loss, sync_gradients=sync_gradients, **kwargs)
        config = getattr(engine, "_acco_config", None)
        if config is not None and config.accumulation != "fixed":
            raise _under_accelerate_refusal(config.accumulation)
        # ACCO decides its own phase ends from the micro-batches counted in engine.step();
        # Accelerate's sync_gradients (one optimizer step = A micro-batches) is not needed.
        if kwargs.pop("scale_wrt_gas", True) is False:
            loss = loss * engine.gradient_accumulation_steps()
        engine.backward(loss, **kwargs)
        engine.step()

    return backward


def _trainer_engine(trainer):
    return getattr(trainer, "model_wrapped", None)  # HF Trainer: the engine Accelerate built


def _lightning_engine(loop):
    return getattr(getattr(loop.trainer, "strategy", None), "model", None)  # DeepSpeedStrategy: the engine


def _on_committed_weights(original: Callable, engine_of: Callable = _trainer_engine) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        engine = engine_of(self)
        if not _is_acco_engine(engine):
            return original(self, *args, **kwargs)
        from .weights import committed_weights

        with committed_weights(engine):  # collective: the Trainer calls this on every rank
            return original(self, *args, **kwargs)

    return method


def _acco_driver_of(optimizers):
    """The ACCO driver behind Accelerate's optimizer wrappers (``DeepSpeedOptimizerWrapper.optimizer``
    is the engine's optimizer), or None."""
    mod = sys.modules.get("ds_acco.deepspeed.optimizer")
    for opt in optimizers if mod is not None else ():
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, mod.AccoZeroOptimizer):
            return inner.driver
    return None


def _undone_if_commit_skipped(original: Callable) -> Callable:
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        driver = _acco_driver_of(getattr(self, "optimizers", ()))
        if driver is None or not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            return original(self, *args, **kwargs)  # not a step that stock takes only after an applied one
        driver.caller_scheduler_step(self.scheduler, lambda: original(self, *args, **kwargs))

    return step


def _logs_the_steps_own_grad_norm(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        engine = getattr(self, "model_wrapped", None)
        if (_is_acco_engine(engine) and self.control.should_log
                and self.state.global_step > getattr(self, "_globalstep_last_logged", -1)):
            # Every rank logs at the same steps (fixed accumulation only, under the Trainer): the drain
            # waits for the commit launched by this step's last step(), and books its norm.
            _warn_logging_cost(engine, self.args.logging_steps)
            engine.optimizer.drain()
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["grad_norm"] = engine.get_global_grad_norm()
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return method


def _warn_logging_cost(engine, logging_steps) -> None:
    if getattr(engine, "_acco_warned_logging", False):
        return
    engine._acco_warned_logging = True
    every = int(logging_steps) if isinstance(logging_steps, int) else 0
    if 0 < every < 20 and getattr(engine, "global_rank", 0) == 0:
        from deepspeed.utils import logger

        logger.warning(f"ds_acco: the HF Trainer logs every {every} steps (logging_steps); each log waits for that "
                       "step's commit round so that the logged grad_norm is the step's own, as stock logs it: "
                       f"{1 / (2 * every):.0%} of ACCO's communication rounds then do not overlap compute; fix: a "
                       "larger logging_steps (e.g. 50) for throughput runs")


# -- stock engines built from an ACCO config ------------------------------------------------------
def _warn_if_stock(original: Callable) -> Callable:
    """``DeepSpeedEngine.__init__`` unchanged, then a warning when the engine is stock although its
    config enables ACCO: its ``initialize`` was looked up before ``install()``, or it was built directly."""
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            _warn_stock_acco(self)
        except Exception:  # noqa: BLE001 -- a warning never fails an engine that DeepSpeed built
            pass

    return __init__


def _warn_stock_acco(engine) -> None:
    acco_engine = getattr(sys.modules.get("ds_acco.deepspeed.engine"), "AccoEngine", None)
    if acco_engine is not None and isinstance(engine, acco_engine):
        return
    raw = getattr(getattr(engine, "_config", None), "_param_dict", None)
    block = raw.get(ACCO_KEY) if isinstance(raw, Mapping) else None
    if not isinstance(block, Mapping) or block.get("enabled") is not True or getattr(engine, "global_rank", 0) != 0:
        return
    if opted_out():
        return note_opt_out()
    from deepspeed.utils import logger

    logger.warning(
        f"ds_acco: this DeepSpeed config has \"{ACCO_KEY}\": {{\"enabled\": true}} but the engine is a stock "
        f"{type(engine).__name__}: training runs WITHOUT ACCO. Its deepspeed.initialize was looked up before "
        "ds_acco.install() (e.g. `from deepspeed import initialize` in a module imported earlier), or the engine "
        "was constructed directly; fix: call ds_acco.install() before importing the training code (or run it with "
        "`python -m ds_acco run` / DS_ACCO_INSTALL=1), or call ds_acco.initialize")


# -- bookkeeping -----------------------------------------------------------------------------------
def _current(owner, name: str):
    # Class attributes: the raw function from the class dict, not a bound/unbound wrapper.
    return vars(owner).get(name) if inspect.isclass(owner) else getattr(owner, name, None)


def _is_patched(owner, name: str) -> bool:
    current = _current(owner, name)
    return any(o is owner and n == name and ours is current for o, n, _, ours in _patches)


def _patch(owner, name: str, ours) -> None:
    had = name in vars(owner) if inspect.isclass(owner) else hasattr(owner, name)
    original = _current(owner, name) if had else _MISSING
    setattr(owner, name, ours)
    _patches.append((owner, name, original, ours))


__all__ = ["install", "installed", "uninstall"]
