"""How the schedule runs: its options, read once from the ``"acco"`` config and the framework's settings."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from ..round.buffers import BufferGroup
from ..round.rounds import RoundContext
from ..step import chunking
from ..step.delay_compensation import DelayCompensation
from ..step.predict import Predictor
from .phases import DynamicPhases, FixedPhases, SharedPhases


@dataclass(frozen=True)
class AutoPlan:
    """Mode 'auto': ``probe_steps`` stock steps, then one of ``candidates`` ('stock' or a key of ``options``,
    each mode's own options)."""
    probe_steps: int
    candidates: Tuple[str, ...]
    options: Dict[str, "ScheduleOptions"]


@dataclass(frozen=True)
class ScheduleOptions:
    """How the schedule runs; built from the ``"acco"`` config by :meth:`from_config`."""
    mode: str  # 'acco', 'dpu' or 'one_round'
    phases: object  # FixedPhases, DynamicPhases or SharedPhases: when a phase ends
    gas_scale: float = 1.0  # the factor each micro-batch gradient carries in G (DeepSpeed's 1/A)
    clip_grad: float = 0.0  # clip each round's global mean gradient to this norm (0: off)
    sum_ranks: bool = False  # the ranks' gradients summed, not averaged (DeepSpeed's gradient_allreduce_op "sum")
    nonfinite: str = "skip"  # 'skip' or 'raise' on a non-finite global mean gradient
    drift_every: int = 0  # measure the estimate drift in every N-th step's commit (mode acco; 0: never)
    chunk_elems: Optional[int] = None  # a round's window (elements); None: per device (chunking.py)
    history: int = 4096  # phases kept for metrics
    lr_power: float = 0.0  # a round's LR × (its global micro-batches / the fixed-mode count) ** lr_power
    lr_scaling: str = "none"  # the key lr_power comes from (acco.dynamic.lr_scaling)
    nominal_phase: int = 0  # micro-batches per rank of a fixed-mode phase (the count lr_power compares to)
    estimate_lr_scale: float = 1.0  # the estimate's LR × this (acco.estimate.lr_scale; 1: the paper's)
    committed_second_moment: bool = False  # the estimate reuses Adam's committed v (acco.estimate.second_moment)
    delay_compensation: float = 0.0  # λ of the commit's delay compensation (acco.estimate.delay_compensation)
    sync_warmup_steps: int = 0  # the first N steps run stock's synchronous schedule (acco.sync_warmup_steps)
    predictor: str = ""  # mode one_round: 'ef', 'ext' or 'nag' (acco.predictor.name)
    predictor_coef: float = 0.0  # its γ or c (acco.predictor.coef)
    auto: Optional[AutoPlan] = None  # mode 'auto': stock steps, then one of its candidates (auto.py)

    def __post_init__(self):
        if self.mode not in ("acco", "dpu", "one_round"):
            raise ValueError(f"mode must be 'acco', 'dpu' or 'one_round', got {self.mode!r}")
        if (self.mode == "one_round") != bool(self.predictor):
            raise ValueError(f"mode {self.mode!r} with predictor {self.predictor!r}: mode 'one_round' needs one")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.lr_power and self.nominal_phase < 1:
            raise ValueError(f"lr_power {self.lr_power} needs the fixed-mode phase length (nominal_phase >= 1), "
                             f"got {self.nominal_phase}")
        if (self.sync_warmup_steps or self.auto) and self.sync_phases() is None:
            raise ValueError(f"sync_warmup_steps {self.sync_warmup_steps} / auto {self.auto}: need mode 'acco' or "
                             "'one_round' with fixed phases")
        if self.delay_compensation and self.mode != "acco":
            raise ValueError(f"delay_compensation {self.delay_compensation} needs mode 'acco' (an estimate round)")

    def sync_phases(self) -> Optional[FixedPhases]:
        """The phase of stock's step (the synchronous warm-up, mode 'auto''s stock): A micro-batches, where
        fixed phases have A/2 (acco) or A (one_round); None: this mode has none."""
        if not isinstance(self.phases, FixedPhases) or self.mode not in ("acco", "one_round"):
            return None
        return FixedPhases(self.phases.micro_batches * (2 if self.mode == "acco" else 1))

    @classmethod
    def from_config(cls, acco, gradient_accumulation_steps: int, clip_grad: float = 0.0,
                    sum_ranks: bool = False) -> "ScheduleOptions":
        """From the parsed :class:`~ds_acco.config.AccoConfig` the entry point built (handed down: read
        here, never re-parsed) and the framework's accumulation count, clip and reduction
        (``sum_ranks``: summed over the ranks, not averaged)."""
        if acco.mode == "auto":  # the probe runs in its first candidate's schedule (acco's, if a candidate)
            modes = acco.schedule_modes()
            each = {m: cls.from_config(acco.model_copy(update={"mode": m}), gradient_accumulation_steps, clip_grad,
                                       sum_ranks) for m in modes}
            plan = AutoPlan(acco.auto_probe_steps, ("stock",) + modes, each)
            return dataclasses.replace(each[modes[0]], auto=plan)
        gas = gradient_accumulation_steps
        nominal = acco.phase_length(gas)
        dynamic = acco.dynamic_bounds(gas) if acco.accumulation == "dynamic" else None
        if dynamic is not None:  # what ends a phase
            phases = DynamicPhases(dynamic.min_micro_batches, dynamic.max_micro_batches, dynamic.check_every)
        else:
            phases = SharedPhases(nominal) if acco.accumulation == "shared" else FixedPhases(nominal)
        return cls(mode=acco.mode, phases=phases,
                   gas_scale=1.0 / gas, clip_grad=float(clip_grad or 0.0), sum_ranks=sum_ranks,
                   nonfinite=acco.nonfinite, drift_every=acco.metrics.drift_every() if acco.mode == "acco" else 0,
                   chunk_elems=None if acco.chunk_elements == "auto" else acco.chunk_elements,
                   lr_power=dynamic.lr_power if dynamic is not None else 0.0,
                   lr_scaling=dynamic.lr_scaling if dynamic is not None else "none",
                   nominal_phase=nominal,
                   estimate_lr_scale=acco.estimate.lr_scale,
                   committed_second_moment=acco.estimate.second_moment == "committed",
                   delay_compensation=acco.estimate.delay_compensation,
                   sync_warmup_steps=acco.sync_warmup_steps,
                   predictor=acco.predictor_setting().name if acco.mode == "one_round" else "",
                   predictor_coef=acco.predictor_setting().value if acco.mode == "one_round" else 0.0)

    def round_context(self, groups: Sequence[BufferGroup], shard_optimizer, *, process_group, norm_group, rank: int,
                      world: int, reduce_scatter: bool, read_counts_first: bool) -> RoundContext:
        """What these options make of every round of one schedule (see :class:`.schedule.AccoSchedule`'s
        arguments); the rounds' window is the user's, or chosen for the device and the shard (chunking.py).
        A scaled rate needs a rate in every param group: the adapter's check point 2 refused any other
        (core/checks/built.py), before the driver."""
        delay = DelayCompensation(groups, self.delay_compensation) if self.delay_compensation else None
        device = groups[0].comm.device
        chunk_elems = chunking.chunk_elements(device, sum(g.segment for g in groups), self.chunk_elems, world)
        shard_optimizer.chunk_elems = chunk_elems
        return RoundContext(
            groups=groups, shard_optimizer=shard_optimizer, process_group=process_group, norm_group=norm_group,
            rank=rank, world=world, gas_scale=self.gas_scale, clip_grad=self.clip_grad, sum_ranks=self.sum_ranks,
            nonfinite=self.nonfinite, reduce_scatter=reduce_scatter, drift_every=self.drift_every if self.mode == "acco" else 0,
            chunk_elems=chunk_elems, lr_power=self.lr_power, nominal_phase_micro_batches=self.nominal_phase * world,
            commit_phases=2 if self.mode == "acco" else 1, read_counts_first=read_counts_first,
            estimate_lr_scale=self.estimate_lr_scale, committed_second_moment=self.committed_second_moment,
            delay=delay, predictor=Predictor(self.predictor, self.predictor_coef, groups, chunk_elems)
            if self.predictor else None)
