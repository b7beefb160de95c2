"""ds_acco: ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1.

    engine, optimizer, loader, scheduler = ds_acco.initialize(model=..., model_parameters=..., config=...)

The ``"acco"`` block of the DeepSpeed config switches it on; without it you get stock ZeRO-1.
DeepSpeed is imported on first use of the names that need it, so ``ds_acco.data`` or
``ds_acco.config`` stay light.
"""
from __future__ import annotations

import contextlib
import importlib

from .config import AccoConfig
from .install import install, installed, uninstall

__version__ = "0.1.0"

_LAZY = {
    "initialize": "ds_acco.deepspeed.engine",
    "AccoEngine": "ds_acco.deepspeed.engine",
    "AccoZeroOptimizer": "ds_acco.deepspeed.optimizer",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_acco' has no attribute {name!r}")


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


__all__ = ["AccoConfig", "AccoEngine", "AccoZeroOptimizer", "committed_weights", "initialize", "install",
           "installed", "uninstall", "__version__"]
