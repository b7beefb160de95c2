"""The README's per-rank memory formulas ("Memory per rank"), as numbers: what each variant's model
states take on one rank before activations, reduce buckets, gathered FSDP blocks, chunk windows and
allocator slack. ``scripts/memory_bench.sh`` and the Megatron tensor-parallel probe print them beside
the measured peaks, so a table can show where the measurement and the formula part.

``n`` is the rank's parameter count (under tensor parallelism its shard, replicated parameters
included), ``world`` the data-parallel size; bytes per element: ``w`` model / ``param_dtype``, ``a``
gradient accumulation (G), ``c`` communication, ``e`` ``estimate_comm_dtype`` (0: not set), ``s``
optimizer state (8: AdamW in fp32).
"""
from typing import Dict

# A/B runner variant names (benchmarks.runner) -> the formula's row
_ROWS = {
    "stock": "zero1_stock", "stock_overlap": "zero1_stock", "fixed": "zero1_acco", "dynamic": "zero1_acco", "shared": "zero1_acco",
    "dpu": "zero1_acco", "dynamic_sqrt": "zero1_acco", "dynamic_linear": "zero1_acco",
    "fsdp_stock": "fsdp_stock_resident", "fsdp_fixed": "fsdp_acco_resident", "fsdp_dynamic": "fsdp_acco_resident",
    "fsdp_dpu": "fsdp_acco_resident",
    "fsdp_stock_sharded": "fsdp_stock_sharded", "fsdp_fixed_sharded": "fsdp_acco_sharded",
    # the Megatron probe's names (docs/bench/megatron-tp2/mem_table.py)
    "acco": "zero1_acco",
}


def state_terms(variant: str, n: int, world: int, w: int = 4, a: int = 4, c: int = 4, e: int = 0,
                s: int = 8) -> Dict[str, float]:
    """The formula's terms in bytes for one rank of ``variant`` (a runner variant name)."""
    try:
        row = _ROWS[variant]
    except KeyError:
        raise ValueError(f"variant {variant!r}: no memory formula; known: {sorted(_ROWS)}") from None
    if n < 1 or world < 1:
        raise ValueError(f"n = {n}, world = {world}: both must be >= 1")
    master = n / world * (4 + s)  # fp32 master shard + optimizer state
    if row == "zero1_stock":
        return {"weights": n * w, "gradients": n * w, "master+state": master, "fp32 gradient shard": n / world * 4}
    if row == "zero1_acco":
        t = {"weights": n * w, "G": n * a, "B": n * max(c, w, e), "master+state": master}
        if c != 4:
            t["fp32 gradient shard"] = n / world * 4
        return t
    # Stock FSDP2 reduce-scatters the accumulated unsharded gradients layer by layer on the last
    # micro-batch and frees each layer's as its sharded gradient appears: the N/W sharded gradient
    # does not add to the N unsharded ones at the peak (measured: docs/bench/memory-fsdp-43m).
    if row == "fsdp_stock_resident":
        return {"master+state": master, "unsharded parameters": n * w, "accumulated gradients": n * a}
    if row == "fsdp_stock_sharded":
        return {"master+state": master, "accumulated gradients": n * a}
    if row == "fsdp_acco_resident":
        return {"master+state": master, "unsharded parameters": n * w, "G": n * a, "B": n * max(a, w, e)}
    return {"master+state": master, "G": n * a, "B": n * max(a, e), "E": n / world * w}  # fsdp_acco_sharded


def state_bytes(variant: str, n: int, world: int, **dtypes: int) -> float:
    """The sum of :func:`state_terms`."""
    return sum(state_terms(variant, n, world, **dtypes).values())


def table(summaries, order=None) -> str:
    """Markdown: each variant's median peak RSS Δ over the memory summaries given (``ab --memory``,
    one variant per launch), beside its stock and the formula's prediction (:func:`state_bytes`,
    fp32 AdamW). ``order``: the variants' row order (default: as first seen)."""
    import statistics

    from benchmarks.summary import baseline  # the stock run each variant is compared with, as the A/B report does

    MiB = 2 ** 20
    peaks: Dict[str, list] = {}
    setups = set()
    for s in summaries:
        for name, v in s["variants"].items():
            peaks.setdefault(name, []).append(v["peak_mem_delta_bytes"] / MiB)
        setups.add((s["n_params"], s["world"], s["model_bytes_comm_dtype"]))
    if len(setups) != 1:
        raise ValueError(f"memory summaries of {len(setups)} setups (n_params, world, buffer bytes): {sorted(setups)}; "
                         "fix: one model and world size per table")
    (n, world, buf_bytes), = setups
    buf = buf_bytes / MiB
    rows = [f"N = {n:,} parameters, W = {world}; one buffer B = {buf:.0f} MiB (the model in the communication "
            f"dtype); target: ACCO <= its stock + 1.25 B = + {1.25 * buf:.0f} MiB. Formula: README \"Memory per "
            "rank\", fp32 AdamW, model states only (benchmarks/memory_model.py)", "",
            "| variant | peak RSS Δ MiB, median (runs) | its stock | − its stock | in B | formula MiB | "
            "formula − its stock |", "|---|---|---|---|---|---|---|"]
    for name in [v for v in (order or peaks) if v in peaks]:
        m = statistics.median(peaks[name])
        runs = " / ".join(f"{p:.0f}" for p in sorted(peaks[name]))
        base = baseline(name, peaks)
        ref = statistics.median(peaks[base]) if base in peaks else float("nan")
        f, fb = state_bytes(name, n, world) / MiB, state_bytes(base, n, world) / MiB
        rows.append(f"| {name} | {m:.0f} ({runs}) | {base} | {m - ref:+.0f} | {(m - ref) / buf:+.2f} | {f:.0f} | "
                    f"{f - fb:+.0f} |")
    return "\n".join(rows)
