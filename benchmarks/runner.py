"""The A/B runner: stock ZeRO-1 vs ACCO fixed vs ACCO dynamic vs DPU on one model, data order,
seed and global batch, on the emulated cluster (root) or on loopback.

:func:`run_ab` writes the spec, launches one :mod:`benchmarks.worker` per rank, and turns
the ranks' raw records into a summary (:func:`benchmarks.summary.summarize`, pure: raw dicts in,
numbers out), which :mod:`benchmarks.report` writes as JSON, Markdown and PNG plots. :func:`plan`
is the dry run: what would be launched, resolved and checked.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ds_acco import configs
from . import cluster
from .summary import summarize
from .variants import VARIANTS, check_fsdp_config, is_fsdp, variant_config

DEFAULT_CONFIG = configs.path("zero1.json")  # stock ZeRO-1; each variant replaces its acco block
# What the runner sets for every rank on top of the inherited environment (PYTHONPATH and
# TORCH_EXTENSIONS_DIR, if set, pass through). A fixed mmap threshold: large tensors are always
# mmapped and returned on free, so the peak-RSS delta of a variant counts its own allocations
# (glibc's sliding threshold would let a later variant reuse an earlier one's freed heap).
WORKER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
EMULATED_PORT = 29500
LOOPBACK_NOTE = ("loopback: all ranks share this machine's cores and 127.0.0.1; gloo's copies and reductions are "
                 "CPU-bound and compete with compute for the same cores, so there is no idle network time for "
                 "ACCO to fill and no speed-up can show (run as root for the emulated cluster with shaped links)")


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


def _free_port() -> int:
    """A port for the dry run's listing only: nothing binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec_path(raw_out: str) -> str:
    return os.path.splitext(os.path.abspath(raw_out))[0] + ".spec.json"


def worker_argv(spec_path: str) -> List[str]:
    """One rank's command: the installed worker module under this interpreter."""
    return [sys.executable, "-m", "benchmarks.worker", spec_path]


def rank_launches(spec: ABSpec, argv: Sequence[str], *, cl: Optional[cluster.Cluster] = None,
                  port: Optional[int] = None) -> List[Tuple[List[str], Dict[str, str]]]:
    """Each rank's command and the environment the runner adds: inside ``cl``'s namespaces, or on
    loopback at ``port``."""
    if cl is not None:
        return [(cl.wrap(r, argv), {**WORKER_ENV, **cl.rank_env(r, EMULATED_PORT)}) for r in range(spec.world)]
    return [(list(argv), {**WORKER_ENV, **cluster.loopback_env(r, spec.world, port)}) for r in range(spec.world)]


def check_variant_config(variant: str, cfg: dict) -> None:
    """What each rank would refuse at start-up, found before anything is launched: the acco block,
    and DeepSpeed's own parse (DeepSpeed variants) or the FSDP variants' limits."""
    from ds_acco.config import acco_config_of
    from ds_acco.config_keys import check_deepspeed_compat
    try:
        acco = acco_config_of(cfg)
        if is_fsdp(variant):
            check_fsdp_config(cfg)
            return
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # parsing needs no device
        from deepspeed.runtime.config import DeepSpeedConfig
        ds = DeepSpeedConfig(cfg)
        if acco.enabled:
            check_deepspeed_compat(acco, ds)
    except Exception as exc:  # DeepSpeed's parser raises AssertionError, pydantic errors...
        raise ValueError(f"variant {variant}: {exc}") from exc


def plan(spec: ABSpec, raw_out: str) -> dict:
    """The dry run of :func:`launch_workers`: the resolved base config, each variant's config
    (checked by :func:`check_variant_config`), the network and every rank's command and added
    environment. Launches nothing, builds no namespace, writes nothing."""
    ws = spec.worker_spec(raw_out)
    with open(ws["base_config"]) as f:
        base = json.load(f)
    variants = {v: variant_config(base, v, ws) for v in spec.variants}
    for v, cfg in variants.items():
        check_variant_config(v, cfg)
    network = spec.resolved_network()
    argv = worker_argv(_spec_path(raw_out))
    if network == "emulated":
        cl = cluster.Cluster(spec.world, spec.rates(), prefix=spec.prefix, subnet=spec.subnet, dry_run=True)
        setup, launches = cl.describe(), rank_launches(spec, argv, cl=cl)
    elif network == "loopback":
        setup, launches = LOOPBACK_NOTE, rank_launches(spec, argv, port=_free_port())  # a real run picks its own
    else:
        raise ValueError(f"network {spec.network!r}: use 'auto', 'emulated' or 'loopback'")
    return {"label": spec.name(), "network": network, "setup": setup, "base_config": ws["base_config"],
            "spec_file": _spec_path(raw_out), "worker_spec": ws, "variants": variants,
            "ranks": [{"command": cmd, "env": env} for cmd, env in launches]}


def launch_workers(spec: ABSpec, raw_out: str, out=None) -> dict:
    """Run the workers on the chosen network; return rank 0's raw records and the setup."""
    out = out or sys.stdout
    os.makedirs(os.path.dirname(os.path.abspath(raw_out)), exist_ok=True)
    spec_path = _spec_path(raw_out)
    with open(spec_path, "w") as f:
        json.dump(spec.worker_spec(raw_out), f, indent=1)
    argv = worker_argv(spec_path)
    network = spec.resolved_network()
    if network == "emulated":
        with cluster.Cluster(spec.world, spec.rates(), prefix=spec.prefix, subnet=spec.subnet) as cl:
            setup = cl.describe()
            out.write(f"network: {setup}\n")
            cmds, envs = zip(*rank_launches(spec, argv, cl=cl))
            try:
                cluster.launch(cmds, envs, timeout_s=spec.timeout_s, stream=out)
            finally:
                cluster.sweep_deepspeed_shm(EMULATED_PORT)
    elif network == "loopback":
        setup = LOOPBACK_NOTE
        out.write(f"network: {setup}\n")
        if spec.rate:
            out.write(f"note: --rate {spec.rate} ignored on loopback (shaping needs the emulated cluster)\n")
        with cluster.loopback_store(spec.world) as port:
            cmds, envs = zip(*rank_launches(spec, argv, port=port))
            try:
                cluster.launch(cmds, envs, timeout_s=spec.timeout_s, stream=out)
            finally:
                cluster.sweep_deepspeed_shm(port)
    else:
        raise ValueError(f"network {spec.network!r}: use 'auto', 'emulated' or 'loopback'")
    with open(raw_out) as f:
        raw = json.load(f)
    raw["network"] = network
    raw["setup"] = setup
    return raw


def machine_info() -> dict:
    import platform
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "hostname_hash": abs(hash(platform.node())) % 10 ** 6}


def run_ab(spec: ABSpec, out_dir: str, *, command: str = "", out=None) -> dict:
    """Run one A/B comparison and write its report into ``out_dir``."""
    from . import report, report_quality
    out = out or sys.stdout
    label = spec.name()
    raw_out = os.path.join(out_dir, f"{label}.raw.json")
    t0 = time.time()
    raw = launch_workers(spec, raw_out, out=out)
    raw.update(label=label, rate=spec.rate or "unshaped", cores=os.cpu_count(), machine=machine_info(),
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command=command, wall_s=time.time() - t0)
    with open(raw_out, "w") as f:
        json.dump(raw, f)
    summary = summarize(raw, spec)
    paths = report.write(summary, out_dir, label)
    out.write(f"wrote {', '.join(paths)}\n")
    out.write(report.markdown_table(summary) + "\n")
    if "stock" in summary["variants"] and any(len(v.get("heldout_curve") or []) > 1 for v in summary["variants"].values()):
        ttt = report_quality.time_to_target([summary])
        out.write("\nTime to target (this run):\n\n" + report_quality.time_to_target_markdown(ttt) + "\n")
    return summary


