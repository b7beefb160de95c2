"""The parallelism a DeepSpeed engine runs under, as plain values: what ``refusals.check_layout`` reads."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """The parallelism a DeepSpeed engine runs under: as the engine built it (its groups), or,
    before it exists, as the caller asked for it (its ``mpu``, the config). Each size comes with
    where it was read (``*_from``), which the refusals quote."""

    tensor_parallel: int = 1
    tensor_parallel_from: str = ""
    pipeline_parallel: int = 1
    pipeline_parallel_from: str = ""
    sequence_parallel: int = 1  # DeepSpeed-Ulysses: ZeRO reduces over the sequence-data-parallel group
    sequence_parallel_from: str = ""
    sequence_parallel_params: tuple = ()  # Megatron --sequence-parallel: names of params marked sequence_parallel
    expert_params: tuple = ()  # MoE experts (param.allreduce = False): names
    caller_sets_boundary: bool = False  # Megatron-style caller: its mpu, or a scheduler stepped with increment=
