"""Peak RSS per rank of the `run_tp2.sh memory` launches (mem_probe.py's rank<R>.json), stock vs ACCO,
with the README's per-rank formula (benchmarks.memory_model) beside each.
    python mem_table.py mem/    ->  a markdown table on stdout
A run's figure is its largest rank (the one that sets the job's memory); the table gives the median
over repeats with every run in parentheses, and each rank's median below it."""
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # benchmarks/
from benchmarks.memory_model import state_bytes, state_terms  # noqa: E402

MiB = 2 ** 20
DP = 2  # data-parallel size of the TP 2 x DP 2 launches

root = sys.argv[1] if len(sys.argv) > 1 else "mem"
runs = {}  # variant -> [ {rank: record} per repeat ]
for d in sorted(p for p in glob.glob(os.path.join(root, "mem_*_r*")) if os.path.isdir(p)):
    variant = os.path.basename(d).split("_")[1]
    recs = {}
    for p in glob.glob(os.path.join(d, "rank*.json")):
        r = json.load(open(p))
        recs[r["rank"]] = r
    if recs:
        runs.setdefault(variant, []).append(recs)
if "stock" not in runs or "acco" not in runs:
    sys.exit(f"{root}: need mem_stock_r* and mem_acco_r* runs, found {sorted(runs)}")

n = next(iter(runs["stock"][0].values()))["n_params"]
buf = n * 4 / MiB
print(f"N = {n:,} parameters per tensor-parallel rank, TP 2 x DP 2 (4 ranks); one buffer B = N x 4 bytes "
      f"= {buf:.0f} MiB; target ACCO <= stock + 1.25 B = + {1.25 * buf:.0f} MiB. Formula: README "
      "\"Memory per rank\" (benchmarks/memory_model.py), fp32, Adam, model states only, W = DP = 2.\n")
print("| variant | peak RSS Δ MiB of the largest rank, median (runs) | − stock | in B | per rank (median) | "
      "formula MiB | formula − stock |")
print("|---|---|---|---|---|---|---|")
med = {}
for v in ("stock", "acco"):
    tops = [max(rec["peak_mem_delta_bytes"] for rec in recs.values()) / MiB for recs in runs[v]]
    med[v] = statistics.median(tops)
    ranks = sorted(runs[v][0])
    per_rank = " / ".join(f"{statistics.median(recs[k]['peak_mem_delta_bytes'] for recs in runs[v] if k in recs) / MiB:.0f}"
                          for k in ranks)
    f = state_bytes(v, n, DP) / MiB
    fs = state_bytes("stock", n, DP) / MiB
    d = med[v] - med["stock"]
    print(f"| {v} | {med[v]:.0f} ({' / '.join(f'{t:.0f}' for t in sorted(tops))}) | "
          f"{'–' if v == 'stock' else f'{d:+.0f}'} | {'–' if v == 'stock' else f'{d / buf:+.2f}'} | {per_rank} | "
          f"{f:.0f} | {'–' if v == 'stock' else f'{f - fs:+.0f}'} |")
print()
for v in ("stock", "acco"):
    terms = ", ".join(f"{k} {b / MiB:.0f}" for k, b in state_terms(v, n, DP).items())
    print(f"- formula terms, {v} (MiB): {terms}")
