#!/usr/bin/env bash
# Peak memory per rank of stock ZeRO-1, ACCO fixed, ACCO dynamic and DPU: each variant in its own
# fresh processes (python -m ds_acco.bench ab --memory), REPEATS times with the order rotated, then
# the medians. Peak RSS is counted from before the model is built to the end of training and the
# final evaluation; "one buffer" B is the model's size in the communication dtype.
#   scripts/memory_bench.sh [OUT_DIR] [extra ab arguments...]
# Defaults: the 43M-parameter GPT (6 x 768), 2 ranks on loopback, gradient_accumulation_steps 4.
# VARIANTS="stock fixed dynamic dpu" (any of python -m ds_acco.bench ab's: each is compared with its
# own stock -- fsdp_* with stock FSDP2 in the same layout, fsdp_*_sharded with fsdp_stock_sharded).
set -euo pipefail
OUT=${1:-bench_results/memory}
shift || true
REPEATS=${REPEATS:-3}
PY=${PYTHON:-python}
read -r -a VARIANTS <<<"${VARIANTS:-stock fixed dynamic dpu}"
mkdir -p "$OUT"
ARGS=(--network loopback --world 2 --n-embd 768 --n-layer 6 --n-head 12 --gas 4 --steps 3 --warmup 1 "$@")
for ((r = 0; r < REPEATS; r++)); do
  for ((k = 0; k < ${#VARIANTS[@]}; k++)); do
    v=${VARIANTS[$(((k + r) % ${#VARIANTS[@]}))]}
    echo "== repeat $((r + 1))/$REPEATS: $v"
    "$PY" -m ds_acco.bench ab --memory "${ARGS[@]}" --variants "$v" --out "$OUT/r$r-$v" --label "mem-$v-r$r" >"$OUT/r$r-$v.log" 2>&1 \
      || { echo "failed: see $OUT/r$r-$v.log"; exit 1; }
  done
done
"$PY" - "$OUT" "$REPEATS" "${VARIANTS[@]}" <<'PY'
import glob, json, os, statistics, sys
from ds_acco.bench.memory_model import state_bytes
out, repeats, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
peaks, buf, n, world = {}, None, None, None
paths = [p for r in range(repeats) for p in glob.glob(os.path.join(out, f"r{r}-*", f"mem-*-r{r}.json"))]
for path in paths:
    if path.endswith(".raw.json") or path.endswith(".spec.json"):
        continue
    s = json.load(open(path))
    for name, v in s["variants"].items():
        peaks.setdefault(name, []).append(v["peak_mem_delta_bytes"] / 2 ** 20)
    buf = s["model_bytes_comm_dtype"] / 2 ** 20
    n, world = s["n_params"], s["world"]


def baseline(name):  # the stock run of the same framework and layout (ds_acco.bench.runner._baseline)
    if name.startswith("fsdp_"):
        for base in (["fsdp_stock_sharded"] if name.endswith("_sharded") else []) + ["fsdp_stock"]:
            if base in peaks:
                return base
    return "stock"


rows = [f"N = {n:,} parameters, W = {world}; one buffer B = {buf:.0f} MiB (the model in the communication dtype); "
        f"target: ACCO <= its stock + 1.25 B = + {1.25 * buf:.0f} MiB. Formula: README \"Memory per rank\", fp32 "
        "AdamW, model states only (ds_acco/bench/memory_model.py)", "",
        "| variant | peak RSS Δ MiB, median (runs) | its stock | − its stock | in B | formula MiB | formula − its stock |",
        "|---|---|---|---|---|---|---|"]
MiB = 2 ** 20
for name in names:
    if name in peaks:
        m = statistics.median(peaks[name])
        runs = " / ".join(f"{p:.0f}" for p in sorted(peaks[name]))
        base = baseline(name)
        ref = statistics.median(peaks[base]) if base in peaks else float("nan")
        f, fb = state_bytes(name, n, world) / MiB, state_bytes(base, n, world) / MiB
        rows.append(f"| {name} | {m:.0f} ({runs}) | {base} | {m - ref:+.0f} | {(m - ref) / buf:+.2f} | {f:.0f} | {f - fb:+.0f} |")
text = "\n".join(rows)
print(text)
open(os.path.join(out, "memory.md"), "w").write(text + "\n")
PY
