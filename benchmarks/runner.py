"""The A/B runner: stock ZeRO-1 vs ACCO fixed vs ACCO dynamic vs DPU on one model, data order,
seed and global batch, on the emulated cluster (root) or on loopback.

:func:`run_ab` writes the spec, launches one :mod:`benchmarks.worker` per rank, and turns
the ranks' raw records into a summary (:func:`benchmarks.summary.summarize`, pure: raw dicts in,
numbers out), which :mod:`benchmarks.report` writes as JSON, Markdown and PNG plots. :func:`plan`
is the dry run: what would be launched, resolved and checked. The spec itself, :class:`ABSpec`,
lives in :mod:`benchmarks.ab_spec`, below both the runner and the summary.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import cluster
from .ab_spec import ABSpec
from .summary import summarize
from .variants import check_fsdp_config, is_fsdp, variant_config

# What the runner sets for every rank on top of the inherited environment (PYTHONPATH and
# TORCH_EXTENSIONS_DIR, if set, pass through). A fixed mmap threshold: large tensors are always
# mmapped and returned on free, so the peak-RSS delta of a variant counts its own allocations
# (glibc's sliding threshold would let a later variant reuse an earlier one's freed heap).
WORKER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
EMULATED_PORT = 29500
LOOPBACK_NOTE = ("loopback: all ranks share this machine's cores and 127.0.0.1; gloo's copies and reductions are "
                 "CPU-bound and compete with compute for the same cores, so there is no idle network time for "
                 "ACCO to fill and no speed-up can show (run as root for the emulated cluster with shaped links)")


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


