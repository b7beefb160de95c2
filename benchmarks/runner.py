"""The A/B runner: stock ZeRO-1 vs ACCO fixed vs ACCO dynamic vs DPU on one model, data order,
seed and global batch, on the emulated cluster (root) or on loopback.

:func:`run_ab` writes the spec, launches one :mod:`benchmarks.worker` per rank, and turns
the ranks' raw records into a summary (:func:`summarize`), which :mod:`benchmarks.report`
writes as JSON, Markdown and PNG plots. :func:`plan` is the dry run: what would be launched,
resolved and checked. The bookkeeping functions here are pure (raw dicts in, numbers out) so
they are unit-tested without launching anything.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ds_acco import configs
from . import advisor, cluster
from .worker import VARIANTS, check_fsdp_config, is_fsdp, mode_of, variant_config

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
    from ds_acco.config import acco_config_of, check_deepspeed_compat
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


# -- bookkeeping (pure) ----------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    q = lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]  # noqa: E731
    return {"min": xs[0], "p25": q(0.25), "p75": q(0.75), "max": xs[-1], "n": len(xs)}


def steady_steps(commits: Sequence[dict], warmup: int) -> List[dict]:
    """Committed steps that count for timing: after the warm-up, not committed while draining."""
    return [c for c in commits if c["step"] > warmup and not c["drained"]]


def step_tokens(run: dict, world: int, gas: int, tokens_per_mb: int) -> Dict[int, int]:
    """Global tokens of each committed step (fixed modes: A·N micro-batches; dynamic: what the
    commit round counted)."""
    rank0 = run["ranks"][0]
    n = len(rank0["commits"])
    if mode_of(run["variant"]) == "dynamic" and rank0["acco_metrics"]:
        by_step = {m["step"]: m["micro_batches_global"] * tokens_per_mb for m in rank0["acco_metrics"]}
        return {s: by_step.get(s, gas * world * tokens_per_mb) for s in range(1, n + 1)}
    return {s: gas * world * tokens_per_mb for s in range(1, n + 1)}


def boundary_positions(variant: str, gas: int) -> set:
    """Micro-batch positions (index mod ``gas``) whose measured forward+backward includes the
    stock baseline's communication: ZeRO-1 reduces inside the last backward; FSDP2 also gathers
    the parameters in the first forward after the optimizer step. ACCO variants: none."""
    if mode_of(variant) != "stock":
        return set()
    return {gas - 1, 0} if is_fsdp(variant) else {gas - 1}


def inner_compute(rank: dict, gas: int, variant: str, lo: int = 0, hi: Optional[int] = None) -> List[float]:
    """Forward+backward times of the micro-batches in ``[lo, hi)`` that carry no communication."""
    skip = boundary_positions(variant, gas)
    xs = rank["mb_compute_s"]
    hi = len(xs) if hi is None else hi
    return [c for i, c in enumerate(xs) if lo <= i < hi and i % gas not in skip]


def rank_busy(rank: dict, warmup: int, gas: int, variant: str) -> Optional[float]:
    """Fraction of the steady window's wall time this rank spent computing (forward+backward).

    The stock baselines communicate inside some micro-batches (:func:`boundary_positions`), so
    there the compute is the median of the other micro-batches times their count."""
    commits = [c for c in rank["commits"] if not c["drained"]]
    if len(commits) <= warmup + 1:
        return None
    first, last = commits[warmup - 1] if warmup else None, commits[-1]
    lo = first["mb_seen"] if first else 0
    hi = last["mb_seen"]
    window = last["train_s"] - (first["train_s"] if first else 0.0)
    comp = rank["mb_compute_s"][lo:hi]
    if window <= 0 or not comp:
        return None
    if mode_of(variant) == "stock":
        inner = inner_compute(rank, gas, variant, lo, hi)
        total = (statistics.median(inner) if inner else statistics.median(comp)) * len(comp)
    else:
        total = sum(comp)
    return min(1.0, total / window)


def loss_curve(run: dict, tokens: Dict[int, int]) -> List[dict]:
    """Train loss per committed step (mean over the step's micro-batches, then over ranks), with
    cumulative tokens and cumulative training time (rank 0's clock, evaluation excluded)."""
    per_step: Dict[int, List[float]] = {}
    for rank in run["ranks"]:
        sums: Dict[int, List[float]] = {}
        for loss, s in zip(rank["mb_loss"], rank["mb_step"]):
            sums.setdefault(s, []).append(loss)
        for s, ls in sums.items():
            per_step.setdefault(s, []).append(sum(ls) / len(ls))
    commits = {c["step"]: c for c in run["ranks"][0]["commits"]}
    out, cum = [], 0
    for s in sorted(per_step):
        step = s + 1  # data of step index s is committed as step s+1
        if step not in commits:
            continue
        cum += tokens.get(step, 0)
        out.append({"step": step, "loss": sum(per_step[s]) / len(per_step[s]), "tokens": cum,
                    "time_s": commits[step]["train_s"]})
    return out


def heldout_curve(run: dict, tokens: Dict[int, int]) -> List[dict]:
    cum = {}
    total = 0
    for s in sorted(tokens):
        total += tokens[s]
        cum[s] = total
    return [{"step": h["step"], "loss": h["loss"], "tokens": cum.get(h["step"], total), "time_s": h["train_s"]}
            for h in run["ranks"][0]["heldout"]]


def time_to_target(points: Sequence[dict], target: Optional[float]) -> Optional[float]:
    """Training time at which the held-out curve first reaches ``target``, interpolated between
    the evaluations around the crossing as ``python -m benchmarks ttt`` does (None: never)."""
    if target is None:
        return None
    from .report import crossing_time
    return crossing_time(points, target)


def summarize(raw: dict, spec: Optional[ABSpec] = None) -> dict:
    """Per-variant figures (see the module docstring of :mod:`benchmarks`) from the raw records."""
    ws = raw["spec"]
    world, gas = ws["world"], ws["gas"]
    warmup = spec.warmup if spec is not None else ws.get("warmup", 1)
    tok_mb = ws["micro_batch"] * ws["seq_len"]
    probe = advisor.Probe.from_measured(raw["probe"], tokens_per_micro_batch=tok_mb, cores=raw.get("cores"),
                                        ranks_per_machine=world)
    preds = advisor.predict(probe, gas, dynamic_min=ws.get("dynamic_min"))
    n_params = raw["probe"][0]["n_params"]
    grouped: Dict[str, List[dict]] = {}
    for run in raw["runs"]:
        grouped.setdefault(run["variant"], []).append(run)
    variants = {}
    for name, runs in grouped.items():
        steps, tps, busy, exposed, comm, mem, tokens_per_step, mbs = [], [], [], [], [], [], [], []
        train_mem = []
        curves, held = [], []
        for run in runs:
            tokens = step_tokens(run, world, gas, tok_mb)
            r0 = run["ranks"][0]
            steady = steady_steps(r0["commits"], warmup)
            steps += [c["step_time_s"] for c in steady]
            if steady:
                tps.append(sum(tokens[c["step"]] for c in steady) / sum(c["step_time_s"] for c in steady))
            tokens_per_step += [tokens[c["step"]] for c in steady]
            busy += [b for b in (rank_busy(r, warmup, gas, name) for r in run["ranks"]) if b is not None]
            mem += [r["peak_rss_delta"] for r in run["ranks"] if r["peak_rss_delta"] is not None]
            train_mem += [r["peak_rss_train_delta"] for r in run["ranks"] if r.get("peak_rss_train_delta") is not None]
            steady_ids = {c["step"] for c in steady}
            for m in r0["acco_metrics"]:
                if m["step"] in steady_ids:
                    exposed.append(m.get("exposed_comm_s"))
                    comm.append(m.get("comm_s"))
                    mbs.append(m.get("micro_batches"))
            curves.append(loss_curve(run, tokens))
            held.append(heldout_curve(run, tokens))
        med_step = _median(steps)
        mode = mode_of(name)
        if mode == "stock":  # compute inside the loop: median non-boundary micro-batch, slowest rank
            inner = []
            for run in runs:
                for r in run["ranks"]:
                    xs = inner_compute(r, gas, name)
                    if xs:
                        inner.append(statistics.median(xs))
            loop_compute = gas * max(inner) if inner else None
            exp = (med_step - loop_compute) if med_step is not None and loop_compute is not None else None
        else:
            loop_compute = None
            exp = _median(exposed)
        mb_per_rank = _median(mbs) if mbs else gas
        t_compute = probe.micro_batch_s * (mb_per_rank or gas)
        rounds = {"stock": 1, "dpu": 1}.get(mode, 2)
        t_comm_iso = rounds * probe.round_s
        overlap = None
        if mode != "stock" and med_step:
            overlap = (t_compute + t_comm_iso - med_step) / min(t_compute, t_comm_iso)
        ideal = max(t_compute, t_comm_iso) if mode in ("fixed", "dpu") else None
        pred = preds.get(mode)
        variants[name] = {
            "mode": mode, "framework": "fsdp2" if is_fsdp(name) else "deepspeed",
            "baseline": None if mode == "stock" else baseline(name, grouped),
            "runs": len(runs), "step_s": med_step, "step_spread": _spread(steps), "tokens_per_s": _median(tps),
            "tokens_per_step": _median(tokens_per_step), "micro_batches_per_rank": mb_per_rank,
            "compute_probe_s": t_compute, "compute_in_loop_s": loop_compute, "exposed_comm_s": exp,
            "comm_s": _median(comm), "comm_isolated_s": t_comm_iso, "overlap_efficiency": overlap,
            "ideal_step_s": ideal, "vs_ideal": (med_step / ideal) if ideal and med_step else None,
            "compute_busy": _median(busy), "peak_mem_delta_bytes": max(mem) if mem else None,
            "peak_mem_train_delta_bytes": max(train_mem) if train_mem else None,
            "train_curve": curves[0], "heldout_curve": held[0],
            "final_heldout": held[0][-1]["loss"] if held[0] else None,
            "predicted_step_s": pred.step_s if pred is not None else None,
            "predicted_tokens_per_s": pred.tokens_per_s if pred is not None else None,
        }
    # Each variant is compared with the stock run of its own framework (FSDP2 ones with stock FSDP2
    # when it ran, else with stock ZeRO-1); the loss target is stock ZeRO-1's (else stock FSDP2's).
    ref = variants.get("stock") or variants.get("fsdp_stock")
    target = spec.target_loss if spec is not None and spec.target_loss is not None else (
        ref["final_heldout"] * 1.01 if ref and ref["final_heldout"] is not None else None)
    for name, v in variants.items():
        v["time_to_target_s"] = time_to_target(v["heldout_curve"], target)
        stock = variants.get(v["baseline"] or "stock")  # the stock runs: against stock ZeRO-1 (itself: 1.00)
        if stock and stock["step_s"] and v["step_s"]:
            v["speedup_step"] = stock["step_s"] / v["step_s"]
            v["speedup_tokens"] = (v["tokens_per_s"] / stock["tokens_per_s"]) if stock["tokens_per_s"] else None
            p = preds.get(v["mode"])
            if p is not None:
                v["predicted_speedup_tokens"] = p.tokens_per_s / preds["stock"].tokens_per_s
            if stock["peak_mem_delta_bytes"] is not None and v["peak_mem_delta_bytes"] is not None:
                v["extra_mem_bytes"] = v["peak_mem_delta_bytes"] - stock["peak_mem_delta_bytes"]
            if stock["final_heldout"] is not None and v["final_heldout"] is not None:
                v["heldout_gap"] = v["final_heldout"] / stock["final_heldout"] - 1.0
    advice = advisor.advise(probe, gas)
    points = [{"label": raw.get("label", ""), "mode": k, "measured_step_s": v["step_s"],
               "predicted_step_s": v["predicted_step_s"]} for k, v in variants.items() if k in VARIANTS and mode_of(k) != "dynamic"
              and not is_fsdp(k)]  # the advisor models DeepSpeed's collectives
    if "dynamic" in variants and variants["dynamic"]["tokens_per_s"]:
        d = variants["dynamic"]  # dynamic steps vary in size: compare time per token instead
        points.append({"label": raw.get("label", ""), "mode": "dynamic",
                       "measured_step_s": d["tokens_per_step"] / d["tokens_per_s"] if d["tokens_per_step"] else None,
                       "predicted_step_s": d["tokens_per_step"] / d["predicted_tokens_per_s"]
                       if d["tokens_per_step"] and d["predicted_tokens_per_s"] else None})
    return {"label": raw.get("label", ""), "setup": raw.get("setup"), "network": raw.get("network"),
            "world": world, "gas": gas, "rate": raw.get("rate"), "n_params": n_params,
            "model_bytes_comm_dtype": n_params * 4, "tokens_per_micro_batch": tok_mb, "warmup": warmup,
            "steps": ws["steps"], "target_loss": target, "probe": dataclasses.asdict(probe),
            "probe_round_s": probe.round_s, "probe_bandwidth_gbit": probe.bandwidth_gbit,
            "advice": advice.as_dict(), "validation": advisor.validate(points), "variants": variants,
            "machine": raw.get("machine"), "date": raw.get("date"), "command": raw.get("command"),
            "slow_rank": ws.get("slow_rank", -1), "slow_factor": ws.get("slow_factor", 1.0),
            "slow_jitter": ws.get("slow_jitter", 0.0), "transient": ws.get("transient"),
            "heterogeneity": heterogeneity_note(ws),
            "emulation": _emulation_note(ws.get("emulate"))}


def heterogeneity_note(ws: dict) -> Optional[str]:
    """How the slow rank was slowed (EMULATION), in words; None for a homogeneous run."""
    if ws.get("slow_rank", -1) < 0:
        return None
    parts = [f"rank {ws['slow_rank']} {ws.get('slow_factor', 1.0):g}x slower per micro-batch"]
    if ws.get("slow_jitter"):
        parts.append(f"lognormal jitter sigma {ws['slow_jitter']:g} per micro-batch (mean 1)")
    t = ws.get("transient")
    if t:
        parts.append(f"{t['factor']:g}x slower again for {t['fraction']:.0%} of the steps from {t.get('start', 0.4):.0%}")
    return "EMULATION of heterogeneous hardware: " + ", ".join(parts) + " (a sleep stretching its micro-batches)"


def _emulation_note(emulate: Optional[dict]) -> Optional[str]:
    if not emulate:
        return None
    from .emulation import describe
    return describe(emulate["params"], emulate["compute_s"])


def machine_info() -> dict:
    import platform
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "hostname_hash": abs(hash(platform.node())) % 10 ** 6}


def run_ab(spec: ABSpec, out_dir: str, *, command: str = "", out=None) -> dict:
    """Run one A/B comparison and write its report into ``out_dir``."""
    from . import report
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
        out.write("\nTime to target (this run):\n\n" + report.time_to_target_markdown(report.time_to_target([summary]))
                  + "\n")
    return summary


def baseline(name: str, present) -> str:
    """The stock variant a variant is compared with: stock FSDP2 in the same layout when it ran,
    else stock FSDP2, else stock ZeRO-1."""
    if is_fsdp(name):
        for base in (("fsdp_stock_sharded",) if name.endswith("_sharded") else ()) + ("fsdp_stock",):
            if base in present:
                return base
    return "stock"

