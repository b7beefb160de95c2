"""The committed weights of an ACCO engine, for evaluation and export.

Between micro-batches an ACCO model's parameters are whatever the compute lane runs on next: half
the time the estimate θ̃. Two ways to read the committed θ instead:

* :func:`committed_weights`, a ``with`` block (collective in dynamic mode);
* any ``state_dict()`` of the model or of one of its modules, and so everything built on it
  (``accelerator.get_state_dict``, ``save_pretrained``, ``engine.save_16bit_model``, FSDP2's
  ``get_model_state_dict``): :class:`ExportHooks`, which both adapters install, *hold* θ in place
  (``AccoSchedule.hold_committed_weights``: no copy, no collective) until the next training
  micro-batch puts the live weights back, bit for bit. Between, a forward in eval mode without
  autograd (an evaluation) also runs on θ. The tensors it returns alias the model's weights, as
  stock's do, and keep θ until the next optimizer step, as stock's do (DeepSpeed: training goes on
  in B meanwhile, see ds_acco/core/schedule/committed.py), so a background reader (torch DCP's
  ``async_save``, an upload) that reads before then gets θ.

And :func:`on_commit`, for what averages the weights once per optimizer step (an EMA, SWA): after
``step()`` the parameters are the estimate half the time, so it runs when each committed θ_t is first
in the model instead, without waiting for anything.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle


@contextlib.contextmanager
def committed_weights(engine):
    """Inside, the model holds the newest committed parameters θ (never the estimate θ̃).

    A commit round still in flight is waited for first (it then counts as committed:
    ``engine.global_steps`` and the LR scheduler advance); an estimate round in flight goes on,
    since the live weights already are the committed ones. On exit the live weights are
    restored, so training continues on exactly the trajectory it would have had. Meant for
    evaluation and export of the model's weights: do not run backward passes inside. For a
    stock DeepSpeed engine this is a no-op.
    """
    hook = getattr(engine, "acco_committed_weights", None)  # AccoEngine and AccoFSDP have it
    inner = hook() if hook is not None else contextlib.nullcontext()
    with inner:
        yield engine


def on_commit(engine, fn: Callable[[int], None]) -> RemovableHandle:
    """Call ``fn(t)`` once per committed optimizer step t, in order, when the model's parameters
    first hold θ_t (on the training thread, inside the ``backward()``/``step()`` that ends the
    phase, an export, ``committed_weights`` or ``destroy()`` / ``close()``): an EMA or SWA of the
    weights reads ``model.parameters()`` there and averages exactly the committed θ_1, θ_2, ...,
    as stock's averages its weights after each ``step()``. Costs no wait. Returns a handle whose
    ``remove()`` stops the calls. ``engine``: an ACCO engine or ``AccoFSDP``; a stock engine has no
    estimate: update after its ``step()`` directly.

    ``fn`` runs on each rank at that rank's own moment (an export on rank 0 only calls it there at
    the export, the other ranks at their phase end): it must not run a collective, which would hang.
    ``engine.save_checkpoint`` may call it (the commit in flight reaches the model there), and the
    checkpoint records that, so a resume does not call it again: serialise the average after
    ``save_checkpoint`` returns (docs/api.md)."""
    schedule = getattr(engine, "schedule", None) or getattr(getattr(engine, "optimizer", None), "schedule", None)
    if schedule is None:
        raise TypeError(f"ds_acco.on_commit: {type(engine).__name__} is not an ACCO engine (ds_acco.initialize "
                        "with acco.enabled, or AccoFSDP); fix: with a stock engine update the average after "
                        "engine.step() at each optimizer step, where its weights are the new ones")
    observers = schedule.committed.observers
    handle = RemovableHandle(observers)
    observers[handle.id] = fn
    return handle


class ExportHooks:
    """Every ``state_dict()`` of ``module`` (or of any module inside it) reads the committed θ.

    A state-dict pre-hook on each module holds θ in the live weights (see
    :meth:`~ds_acco.core.schedule.committed.CommittedWeights.hold`). While θ is held, a
    global forward pre-hook waits for the next forward of one of the model's modules that may be
    training (training mode, or autograd recording) and puts the live weights back before it runs;
    the schedule itself does so at the next backward or ``step()``. So an export costs one in-place
    exchange (and, where the adapter re-points its parameters, no second one) and no allocation, and
    training continues on exactly the trajectory it would have had; during training no hook runs at
    all. The tensors a ``state_dict()`` returns share storage with the model, as in PyTorch, and
    keep θ until the next optimizer step (DeepSpeed; FSDP2: until a round steps the master shards).

    ``settle_shards``: the export reads the optimizer's master shards (FSDP2's sharded
    parameters), which an estimate round may step in place; it is then waited for too.
    The hooks hold the schedule weakly and survive neither ``copy.deepcopy`` nor pickling.
    """

    def __init__(self, module: torch.nn.Module, schedule, settle_shards: bool = False):
        self._schedule = weakref.ref(schedule)
        self._settle_shards = settle_shards
        # Only this model's forwards release θ: not another model's, nor a wrapper's (a DeepSpeed
        # engine's own `training` flag never changes: its eval() sets only its module's).
        self._modules = weakref.WeakSet(module.modules())
        hook = _HoldOnStateDict(self)
        self._handles = [m.register_state_dict_pre_hook(hook) for m in self._modules]
        self._forward: Optional[RemovableHandle] = None  # registered while θ is held

    def hold(self, agreed: bool = False) -> None:
        """Hold θ in the live weights until the next training call (``agreed``: every rank calls
        this at the same micro-batch count, e.g. ``model.eval()`` under Megatron, so dynamic mode
        may drain collectively)."""
        schedule = self._schedule()
        if schedule is None:
            return
        schedule.hold_committed_weights(agreed=agreed, settle_shards=self._settle_shards)
        if schedule.holds_committed_weights and self._forward is None:
            self._forward = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def release(self, settle: bool = False) -> None:
        """Put the live weights the schedule runs on back (no-op when nothing is held; ``settle``:
        before a load writes the parameters, see ``CommittedWeights.release``)."""
        schedule = self._schedule()
        if schedule is not None:
            schedule.release_committed_weights(settle)  # not inside a committed_weights() block
        if schedule is None or not schedule.holds_committed_weights:
            self._unregister_forward()

    def remove(self) -> None:
        """Remove every hook (the engine is done: its schedule left θ in the model for good)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._unregister_forward()

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        schedule = self._schedule()
        if schedule is None or not schedule.holds_committed_weights:
            self._unregister_forward()  # released meanwhile (a backward, a step, a close)
        elif module in self._modules and (module.training or torch.is_grad_enabled()):
            self.release()  # a forward of this model that may be training: it runs on the live weights

    def _unregister_forward(self) -> None:
        handle, self._forward = self._forward, None
        if handle is not None:
            handle.remove()


class _HoldOnStateDict:
    """The state-dict pre-hook of :class:`ExportHooks` (a class, so that a copy of the module, by
    ``copy.deepcopy`` or pickling, gets an inert hook, not one that holds the original's θ)."""

    def __init__(self, hooks: ExportHooks):
        self._hooks = weakref.ref(hooks)

    def __call__(self, module, prefix, keep_vars) -> None:
        hooks = self._hooks()
        if hooks is not None:
            hooks.hold()

    def __reduce__(self):
        return (_Inert, ())  # a deep copy or a pickle of the model belongs to no schedule


class _Inert:
    def __call__(self, *args, **kwargs) -> None:
        return None
