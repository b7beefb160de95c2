"""A step-time model on paper: stock ZeRO-1, ACCO fixed and the one-round mode on a cluster nobody
here has rented (issue 42 item 6). :mod:`.scale_check` checks it against every emulated point we
measured; ``python -m benchmarks scale-model --table`` writes the table of docs/bench/scale-model.

Inputs: parameters ``P``, GPUs ``N`` (``g`` per node, ``n = N/g`` nodes), tensor parallelism ``tp``
inside a node (data parallelism ``D = N/tp``), bytes per element of the gradients and of the
parameters on the wire (``b``, bf16: 2), tokens per micro-batch ``T``, the link (``B_node`` nominal
bytes/s per node, ``α`` per ring hop), its achieved fraction ``η`` (the calibration constant:
fitted on the emulated points, assumed for NCCL), NVLink ``B_nv`` (per GPU, one direction) and ``α_nv``.

* Compute per micro-batch: ``t = 6·P·T / (tp · peak · MFU)`` (or measured).
* One collective over the full tensor ``S = P·b`` (a ring at each level; hierarchical: the
  ``k = g/tp`` data-parallel ranks of a node over NVLink on their ``S/tp``, then the nodes over
  the link, every rank of a node sending its ``1/k`` at once, so the node's NIC carries
  ``(n−1)/n · S`` whatever ``tp``)::

      coll(S) = f·[(k−1)/k · S/tp / (η·B_nv) + (k−1)·α_nv] + f·[(n−1)/n · S / (η·B_node) + (n−1)·α]

  ``f`` = 1 for a reduce-scatter or an all-gather (NCCL); gloo has no reduce-scatter, and both
  stock ZeRO-1's per-owner reduces and ACCO's in-place all-reduce cost an all-reduce, ``f`` = 2.
* Optimizer step on the shard, memory-bound: ``opt = 30 B · P/N / HBM`` (read fp32 master, m, v,
  gradient shard: 16 B; write master, m, v: 12 B, the bf16 parameter: 2 B), or measured.
* A round: ``R = coll_reduce(S) + opt + coll_gather(S)`` (+ ACCO's three tiny all-reduces,
  ``2·(n−1)·α`` each); stock exposes the same round without the tiny ones: ``R_s``.
* ``A`` micro-batches per step, ``C = A·t``:

      stock      = C + R_s                   (nothing overlaps)
      fixed      = 2·max(C/2, R)             (two rounds per step, one under each half)
      one-round  = max(C, R)                 (one round per step under the whole next step:
                                              DPU's schedule and bytes, so DPU's step time)

* ``r = R / (C/2)``, BENCHMARKS.md's ratio: fixed hides its rounds where ``r ≤ 1``, one-round
  where ``r ≤ 2``.

Not modelled: overlap's cost to compute (NCCL kernels take SMs and HBM; the emulation's CPU
contention is folded into its fitted ``η``), stock's ``overlap_comm``, pipeline parallelism,
activations' memory (the table flags model states over 90% of the GPU's memory).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, H100 SXM
MFU = 0.40
HBM_BPS = 3.35e12  # H100 SXM HBM3
NVLINK_BPS = 450e9  # per GPU, one direction (NVLink 4: 900 GB/s both ways)
NVLINK_ALPHA_S = 2e-6
GPU_MEMORY = 80e9
OPT_BYTES_PER_PARAM = 30  # 16 read + 14 written, see the module docstring
ETA_NCCL = 0.80  # assumed achieved fraction of line rate for NCCL's rings (not measured here)


@dataclasses.dataclass(frozen=True)
class Link:
    """The inter-node network: nominal bytes/s per node and latency per ring hop."""
    name: str
    node_bps: float
    alpha_s: float


LINKS = {
    "eth100": Link("100 Gbit/s Ethernet per node", 100e9 / 8, 10e-6),
    "ib400": Link("400 Gbit/s InfiniBand per GPU", 8 * 400e9 / 8, 3e-6),  # 8 HCAs per node (DGX H100)
    "ib400-node": Link("400 Gbit/s InfiniBand per node", 400e9 / 8, 3e-6),
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training job: model, GPUs, batch, hardware; ``None`` fields are derived (docstring)."""
    params: float
    gpus: int
    gpus_per_node: int = 8
    tp: int = 1
    tokens_per_micro_batch: int = 4096
    global_tokens: int = 2 ** 22  # ~4M tokens per optimizer step
    wire_bytes: int = 2  # bf16 gradients and parameters
    eta: float = ETA_NCCL
    reduce_factor: float = 1.0  # f of the reduce: 1 reduce-scatter (NCCL), 2 all-reduce in its place (gloo)
    peak_flops: float = H100_BF16_PEAK
    mfu: float = MFU
    hbm_bps: float = HBM_BPS
    nvlink_bps: float = NVLINK_BPS
    nvlink_alpha_s: float = NVLINK_ALPHA_S
    gas: Optional[int] = None  # micro-batches per step; else from global_tokens, at least 2, even
    micro_batch_s: Optional[float] = None  # measured compute per micro-batch
    opt_step_s: Optional[float] = None  # measured optimizer step on the shard

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.gpus_per_node < 1 or self.params <= 0:
            raise ValueError(f"params, gpus, tp and gpus_per_node must be positive: {self}")
        if self.gpus % self.tp or (self.gpus_per_node % self.tp and self.gpus >= self.gpus_per_node):
            raise ValueError(f"tp={self.tp} must divide gpus={self.gpus} and gpus_per_node={self.gpus_per_node}")
        if not 0 < self.eta <= 1:
            raise ValueError(f"eta={self.eta}: the achieved fraction of the link rate is in (0, 1]")

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def accumulation(self) -> int:
        if self.gas is not None:
            return self.gas
        a = max(2, round(self.global_tokens / (self.dp * self.tokens_per_micro_batch)))
        return a + a % 2

    @property
    def t(self) -> float:
        if self.micro_batch_s is not None:
            return self.micro_batch_s
        return 6 * self.params * self.tokens_per_micro_batch / (self.tp * self.peak_flops * self.mfu)

    @property
    def opt_s(self) -> float:
        if self.opt_step_s is not None:
            return self.opt_step_s
        return OPT_BYTES_PER_PARAM * self.params / self.gpus / self.hbm_bps


def collective_s(s: Setup, link: Link, factor: float = 1.0) -> float:
    """One reduce-scatter or all-gather (``factor`` 1) of the full tensor over the DP group."""
    size = s.params * s.wire_bytes
    k = min(s.gpus, s.gpus_per_node) // s.tp  # data-parallel ranks inside one node
    n = s.nodes
    intra = (k - 1) / k * size / s.tp / (s.eta * s.nvlink_bps) + (k - 1) * s.nvlink_alpha_s
    inter = (n - 1) / n * size / (s.eta * link.node_bps) + (n - 1) * link.alpha_s
    return factor * (intra + inter)


def tiny_s(s: Setup, link: Link) -> float:
    """A tiny all-reduce (counts, norms): latency only, ``2·(hops)·α``."""
    k = min(s.gpus, s.gpus_per_node) // s.tp
    return 2 * ((k - 1) * s.nvlink_alpha_s + (s.nodes - 1) * link.alpha_s)


def stock_round_s(s: Setup, link: Link) -> float:
    if s.dp == 1:
        return 0.0  # no data parallelism: nothing to reduce or gather
    return collective_s(s, link, s.reduce_factor) + s.opt_s + collective_s(s, link)


def round_s(s: Setup, link: Link) -> float:
    """One ACCO round: reduce, shard step, all-gather, three tiny all-reduces."""
    if s.dp == 1:
        return 0.0
    return stock_round_s(s, link) + 3 * tiny_s(s, link)


def step_times(s: Setup, link: Link) -> Dict[str, float]:
    """Predicted seconds per optimizer step of each mode, and r (the module docstring)."""
    c = s.accumulation * s.t
    rs, r = stock_round_s(s, link), round_s(s, link)
    return {"stock": c + rs, "fixed": 2 * max(c / 2, r), "one_round": max(c, r), "dpu": max(c, r),
            "compute_s": c, "round_s": r, "r": r / (c / 2)}


def memory_gb(s: Setup, variant: str) -> float:
    """Model states per GPU (GB, before activations), the project's own formulas (memory_model)."""
    from .memory_model import state_terms
    w = s.wire_bytes
    return sum(state_terms(variant, int(s.params / s.tp), s.dp, w=w, a=w, c=w).values()) / 1e9


# -- the table -------------------------------------------------------------------------------

MODELS = {"1B": (1e9, 1), "7B": (7e9, 1), "70B": (70e9, 8)}  # parameters, tensor parallelism inside a node
GPU_COUNTS = (8, 64, 256, 1024)


def table_rows(links=("eth100", "ib400"), eta: float = ETA_NCCL, mfu: float = MFU) -> List[dict]:
    rows = []
    for name, (p, tp) in MODELS.items():
        for gpus in GPU_COUNTS:
            for key in links:
                s = Setup(params=p, gpus=gpus, tp=tp, eta=eta, mfu=mfu)
                st = step_times(s, LINKS[key])
                rows.append({"model": name, "gpus": gpus, "link": key, "tp": tp, "dp": s.dp, "nodes": s.nodes, "gas": s.accumulation,
                             "tokens": s.accumulation * s.dp * s.tokens_per_micro_batch, **st,
                             "mem_stock_gb": memory_gb(s, "stock"), "mem_acco_gb": memory_gb(s, "fixed")})
    return rows


def _note(row: dict) -> str:
    notes = []
    if row["dp"] == 1:
        notes.append("DP 1: nothing to hide")
    if row["mem_acco_gb"] > 0.9 * GPU_MEMORY / 1e9:
        fits = "neither fits" if row["mem_stock_gb"] > 0.9 * GPU_MEMORY / 1e9 else "ACCO does not fit"
        notes.append(f"{fits} ({row['mem_stock_gb']:.0f}/{row['mem_acco_gb']:.0f} GB states)")
    return "; ".join(notes)


def markdown(rows: List[dict], compact: bool = False) -> str:
    """The table; ``compact``: BENCHMARKS.md's, one row per model and GPU count beyond one node,
    each link a cell ``r · stock s · fixed × stock · one-round × stock``."""
    names = {"eth100": "100G Eth/node", "ib400": "400G IB/GPU", "ib400-node": "400G IB/node"}
    if compact:
        links = list(dict.fromkeys(w["link"] for w in rows))
        lines = ["| model | GPUs | A | " + " | ".join(f"{names[k]}: r · stock · fixed · one-round" for k in links) + " |",
                 "|---|---|---|" + "---|" * len(links)]
        for (model, gpus), group in _groups(rows).items():
            if group[0]["nodes"] == 1:
                continue  # one node: NVLink only, the network is not used
            cells = [f"{w['r']:.2f} · {w['stock']:.2f} s · {w['stock'] / w['fixed']:.2f}× · {w['stock'] / w['one_round']:.2f}×"
                     for w in group]
            lines.append(f"| {model} | {gpus} | {group[0]['gas']} | " + " | ".join(cells) + " |")
        return "\n".join(lines)
    lines = ["| model (TP) | GPUs | link | A (tokens/step) | compute s | round s | r | stock s | fixed s (× stock) "
             "| one-round s (× stock) | states GB stock/ACCO | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in rows:
        x = lambda m: f"{w[m]:.2f} ({w['stock'] / w[m]:.2f}×)"  # noqa: E731
        lines.append(f"| {w['model']} ({w['tp']}) | {w['gpus']} | {names[w['link']]} | {w['gas']} ({w['tokens'] / 2 ** 20:.0f}M) | "
                     f"{w['compute_s']:.2f} | {w['round_s']:.3f} | {w['r']:.2f} | {w['stock']:.2f} | {x('fixed')} | "
                     f"{x('one_round')} | {w['mem_stock_gb']:.0f}/{w['mem_acco_gb']:.0f} | {_note(w)} |")
    return "\n".join(lines)


def _groups(rows: List[dict]) -> Dict[tuple, List[dict]]:
    out: Dict[tuple, List[dict]] = {}
    for w in rows:
        out.setdefault((w["model"], w["gpus"]), []).append(w)
    return out
