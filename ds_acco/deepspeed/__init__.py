"""The DeepSpeed adapter: an engine subclass and a ZeRO stage-1 optimizer subclass."""
from .engine import AccoEngine, initialize
from .optimizer import AccoZeroOptimizer

__all__ = ["AccoEngine", "AccoZeroOptimizer", "initialize"]
