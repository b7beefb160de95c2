"""ds_acco: ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1.

    engine, optimizer, loader, scheduler = ds_acco.initialize(model=..., model_parameters=..., config=...)

The ``"acco"`` block of the DeepSpeed config switches it on; without it you get stock ZeRO-1.
"""
from __future__ import annotations

import contextlib

from .config import AccoConfig
from .deepspeed.engine import AccoEngine, initialize
from .deepspeed.optimizer import AccoZeroOptimizer

__version__ = "0.1.0"


@contextlib.contextmanager
def committed_weights(engine):
    """Inside, the model holds the committed parameters θ (never the estimate θ̃).

    In-flight communication is drained first (a commit that finishes there counts as
    committed: ``engine.global_steps`` and the LR scheduler advance). On exit the live
    weights are restored, so training continues on exactly the trajectory it would have had.
    Meant for evaluation and export: do not run backward passes inside. For a stock
    DeepSpeed engine this is a no-op.
    """
    inner = engine.acco_committed_weights() if isinstance(engine, AccoEngine) else contextlib.nullcontext()
    with inner:
        yield engine


__all__ = ["AccoConfig", "AccoEngine", "AccoZeroOptimizer", "committed_weights", "initialize", "__version__"]
