"""An A/B run's spec (ABSpec): the cluster, the model, the variants and the schedule one run of
the A/B runner needs, checked on construction; the runner launches it, the summary reads it."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Union

from ds_acco import configs
from . import cluster
from .variants import VARIANTS

DEFAULT_CONFIG = configs.path("zero1.json")  # stock ZeRO-1; each variant replaces its acco block


@dataclasses.dataclass
class ABSpec:
    """Everything one A/B run needs; written to ``spec.json`` for the workers."""
    world: int = 2
    rate: Optional[str] = None  # '1gbit', '100mbit', None (unshaped); or per node 'a,b,...'
    network: str = "auto"  # 'auto' (emulated when root), 'emulated', 'loopback'
    gas: int = 4
    micro_batch: int = 4
    seq_len: int = 32
    steps: int = 6  # committed steps per variant, warm-up included
    warmup: int = 1
    variants: Sequence[str] = ("stock", "fixed", "dynamic", "dpu")
    repeat: int = 1
    n_embd: int = 384
    n_layer: int = 6
    n_head: int = 6
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 4
    slow_rank: int = -1
    slow_factor: float = 1.0
    slow_jitter: float = 0.0  # σ of the slow rank's lognormal per-micro-batch factor (mean 1)
    transient: Optional[dict] = None  # {'factor', 'fraction', 'start'}: the slow rank slower for part of the run
    dynamic_min: Optional[int] = None
    dynamic_max: Optional[int] = None
    overlap_bucket_size: Optional[int] = None  # stock_overlap's reduce_bucket_size (None: hidden size squared)
    base_config: str = DEFAULT_CONFIG  # a path, or the name of a shipped config (ds_acco.configs)
    target_loss: Optional[float] = None
    timeout_s: float = 3600.0
    prefix: str = "accob"
    subnet: int = 0
    label: Optional[str] = None
    # Accelerator emulation (bench/emulation.py): seconds of waiting per training micro-batch
    # (one value, or one per rank) and the parameter count the rounds carry. None: real compute.
    emulate_compute_s: Optional[Union[float, Sequence[float]]] = None
    emulate_params: Optional[int] = None
    # Memory measurement: the one variant first in fresh processes, no warm-up run, probe after.
    memory: bool = False

    def __post_init__(self):
        self.variants = tuple(self.variants)
        if (self.emulate_compute_s is None) != (self.emulate_params is None):
            raise ValueError("accelerator emulation needs both emulate_compute_s (--emulate-compute-s) and "
                             f"emulate_params (--emulate-params); got {self.emulate_compute_s!r} and "
                             f"{self.emulate_params!r}")
        if (self.slow_jitter or self.transient) and self.slow_rank < 0:
            raise ValueError("slow_jitter / transient slow down the slow rank: name it (--slow-rank R); got "
                             f"slow_jitter={self.slow_jitter!r}, transient={self.transient!r}")
        if self.slow_jitter < 0:
            raise ValueError(f"slow_jitter = {self.slow_jitter!r}: a lognormal sigma, >= 0")
        if self.transient is not None:
            t = dict(self.transient)
            bad = set(t) - {"factor", "fraction", "start"}
            if bad or not (t.get("factor", 0) >= 1 and 0 < t.get("fraction", 0) <= 1 and 0 <= t.get("start", 0.4) < 1):
                raise ValueError(f"transient = {self.transient!r}: expected factor >= 1, 0 < fraction <= 1 and "
                                 "0 <= start < 1 (e.g. --transient 3,0.2: 3x slower for 20% of the steps)")
        if self.memory and (len(self.variants) != 1 or self.repeat != 1):
            raise ValueError(f"memory = true measures one variant per launch (got {list(self.variants)} x "
                             f"{self.repeat}): in one process a later run reuses the heap an earlier one freed; "
                             "fix: one --variants value and --repeat 1 per launch (scripts/memory_bench.sh loops)")
        if isinstance(self.emulate_compute_s, (list, tuple)) and len(self.emulate_compute_s) != self.world:
            raise ValueError(f"emulate_compute_s has {len(self.emulate_compute_s)} values for {self.world} ranks; "
                             "fix: one per rank, or one for all")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"variants {bad}: unknown; use any of {', '.join(VARIANTS)} (or 'all', 'fsdp' on the "
                             "command line)")

    def resolved_network(self) -> str:
        if self.network == "auto":
            return "emulated" if cluster.is_root() else "loopback"
        return self.network

    def rates(self):
        if self.rate and "," in self.rate:
            return self.rate.split(",")
        return self.rate

    def name(self) -> str:
        if self.label:
            return self.label
        rate = (self.rate or "unshaped").replace(",", "-")
        slow = f"-slow{self.slow_rank}x{self.slow_factor:g}" if self.slow_rank >= 0 else ""
        slow += f"-jitter{self.slow_jitter:g}" if self.slow_jitter else ""
        slow += (f"-transient{self.transient['factor']:g}x{self.transient['fraction']:g}" if self.transient else "")
        emu = "-emulated" if self.emulate_params is not None else ""
        return f"w{self.world}-{rate}-gas{self.gas}{slow}{emu}"

    def worker_spec(self, raw_out: str) -> dict:
        return {"world": self.world, "gas": self.gas, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "steps": self.steps, "variants": list(self.variants), "repeat": self.repeat, "seed": self.seed,
                "model": {"n_embd": self.n_embd, "n_layer": self.n_layer, "n_head": self.n_head},
                "eval_every": self.eval_every, "eval_batches": self.eval_batches, "slow_rank": self.slow_rank,
                "slow_factor": self.slow_factor, "slow_jitter": self.slow_jitter, "transient": self.transient,
                "dynamic_min": self.dynamic_min, "dynamic_max": self.dynamic_max,
                "overlap_bucket_size": self.overlap_bucket_size,
                "base_config": os.path.abspath(configs.resolve(self.base_config)), "raw_out": os.path.abspath(raw_out),
                "threads": 1,
                "memory": self.memory,
                # a memory run's probe (after the measured peak) feeds only its advice line: keep it short
                # and small (collectives timed on <= 16M elements, scaled to the model)
                **({"probe_micro_batches": 2, "probe_comm_reps": 1, "probe_comm_elements": 1 << 24}
                   if self.memory else {}),
                "emulate": None if self.emulate_params is None else {
                    "params": int(self.emulate_params), "compute_s": self.emulate_compute_s}}
