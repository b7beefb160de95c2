"""The ACCO / DPU schedule, free of DeepSpeed and FSDP: flat buffers, a shard optimizer, a lane."""
from .schedule import AccoSchedule, FlatGroup, PhaseKind, RoundKind, RoundResult
from .shard_optimizer import ShardOptimizer

__all__ = ["AccoSchedule", "FlatGroup", "PhaseKind", "RoundKind", "RoundResult", "ShardOptimizer"]
