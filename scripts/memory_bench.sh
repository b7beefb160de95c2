#!/usr/bin/env bash
# Peak memory per rank of stock ZeRO-1, ACCO fixed, ACCO dynamic and DPU: each variant in its own
# fresh processes (python -m benchmarks ab --memory), REPEATS times with the order rotated, then
# the medians. Peak RSS is counted from before the model is built to the end of training and the
# final evaluation; "one buffer" B is the model's size in the communication dtype.
#   scripts/memory_bench.sh [OUT_DIR] [extra ab arguments...]
# Defaults: the 43M-parameter GPT (6 x 768), 2 ranks on loopback, gradient_accumulation_steps 4.
# VARIANTS="stock fixed dynamic dpu" (any of python -m benchmarks ab's: each is compared with its
# own stock -- fsdp_* with stock FSDP2 in the same layout, fsdp_*_sharded with fsdp_stock_sharded).
set -euo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
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
    "$PY" -m benchmarks ab --memory "${ARGS[@]}" --variants "$v" --out "$OUT/r$r-$v" --label "mem-$v-r$r" >"$OUT/r$r-$v.log" 2>&1 \
      || { echo "failed: see $OUT/r$r-$v.log"; exit 1; }
  done
done
runs=()  # this invocation's repeats only, not a reused OUT's older ones
for ((r = 0; r < REPEATS; r++)); do for v in "${VARIANTS[@]}"; do runs+=("$OUT/r$r-$v/mem-$v-r$r.json"); done; done
"$PY" -m benchmarks memory-table "${runs[@]}" --variants "${VARIANTS[@]}" --out "$OUT"
