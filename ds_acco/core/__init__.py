"""The ACCO / DPU schedule, free of DeepSpeed and FSDP, in rooms that import only downward:

``step`` (one optimizer step on a shard, kept or discarded) < ``checks`` (the refusal table) <
``round`` (one round as plain functions over buffer groups) < ``schedule`` (the state machine and
its parts) < ``lifecycle`` (LR bookkeeping, the host protocol, metrics, checkpoints, exit) <
``driver`` (the protocol every adapter speaks). docs/design.md has the code map.
"""
from .driver import AccoDriver
from .round.buffers import BufferGroup, FlatBuffers
from .round.report import RoundReport
from .round.rounds import NonFiniteGradientError, RoundKind, RoundResult
from .schedule.machine import AccoSchedule
from .schedule.options import ScheduleOptions
from .schedule.phases import DynamicPhases, FixedPhases, PhaseKind, SharedPhases, share_by_speed
from .step.shard_optimizer import ShardOptimizer

__all__ = ["AccoDriver", "AccoSchedule", "BufferGroup", "DynamicPhases", "FixedPhases", "FlatBuffers",
           "NonFiniteGradientError", "PhaseKind", "RoundKind", "RoundReport", "RoundResult", "ScheduleOptions",
           "SharedPhases", "ShardOptimizer", "share_by_speed"]
