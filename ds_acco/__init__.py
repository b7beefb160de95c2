"""ds_acco: ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1.

    engine, optimizer, loader, scheduler = ds_acco.initialize(model=..., model_parameters=..., config=...)

The ``"acco"`` block of the DeepSpeed config switches it on; without it you get stock ZeRO-1.
DeepSpeed is imported on first use of the names that need it, so ``ds_acco.config`` or
``ds_acco.configs`` stay light.
"""
from __future__ import annotations

import importlib

from .config import AccoConfig
from .install import install, installed, uninstall
from .weights import committed_weights, on_commit

__version__ = "0.1.0"

_LAZY = {
    "initialize": "ds_acco.deepspeed.engine",
    "AccoEngine": "ds_acco.deepspeed.engine",
    "AccoZeroOptimizer": "ds_acco.deepspeed.optimizer",
    "AccoRefusal": "ds_acco.core.checks.refusals",  # the core is imported on first use, as DeepSpeed is
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_acco' has no attribute {name!r}")


__all__ = ["AccoConfig", "AccoEngine", "AccoRefusal", "AccoZeroOptimizer", "committed_weights", "initialize", "install",
           "installed", "on_commit", "uninstall", "__version__"]
