"""The ACCO / DPU schedule, free of DeepSpeed and FSDP.

``phases`` (what ends a phase), ``buffers`` (G, B, live weights and shards of one parameter
group), ``rounds`` (one round as plain functions), ``schedule`` (the state machine),
``shard_optimizer`` (one step of any torch optimizer, kept or discarded), ``report`` (what each
rank sends along with a round) and ``driver`` (the protocol every adapter speaks).
"""
from .buffers import BufferGroup, FlatBuffers
from .driver import AccoDriver
from .options import ScheduleOptions
from .phases import DynamicPhases, FixedPhases, PhaseKind, SharedPhases, share_by_speed
from .report import RoundReport
from .rounds import NonFiniteGradientError, RoundKind, RoundResult
from .schedule import AccoSchedule
from .shard_optimizer import ShardOptimizer

__all__ = ["AccoDriver", "AccoSchedule", "BufferGroup", "DynamicPhases", "FixedPhases", "FlatBuffers",
           "NonFiniteGradientError", "PhaseKind", "RoundKind", "RoundReport", "RoundResult", "ScheduleOptions",
           "SharedPhases", "ShardOptimizer", "share_by_speed"]
