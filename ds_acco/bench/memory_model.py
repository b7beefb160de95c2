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

# A/B runner variant names (ds_acco.bench.runner) -> the formula's row
_ROWS = {
    "stock": "zero1_stock", "fixed": "zero1_acco", "dynamic": "zero1_acco", "shared": "zero1_acco",
    "dpu": "zero1_acco",
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
    if row == "fsdp_stock_resident":
        return {"master+state": master, "unsharded parameters": n * w, "accumulated gradients": n * a,
                "sharded gradient": n / world * 4}
    if row == "fsdp_stock_sharded":
        return {"master+state": master, "accumulated gradients": n * a, "sharded gradient": n / world * 4}
    if row == "fsdp_acco_resident":
        return {"master+state": master, "unsharded parameters": n * w, "G": n * a, "B": n * max(a, w, e)}
    return {"master+state": master, "G": n * a, "B": n * max(a, e), "E": n / world * w}  # fsdp_acco_sharded


def state_bytes(variant: str, n: int, world: int, **dtypes: int) -> float:
    """The sum of :func:`state_terms`."""
    return sum(state_terms(variant, n, world, **dtypes).values())
