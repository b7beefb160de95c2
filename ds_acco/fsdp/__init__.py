"""ACCO / DPU for FSDP2 (``fully_shard``) models, on the same core and config block as the
DeepSpeed adapter. See :class:`AccoFSDP`."""
from .adapter import AccoFSDP
from .buffers import FSDPBuffers

__all__ = ["AccoFSDP", "FSDPBuffers"]
