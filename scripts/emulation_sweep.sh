#!/usr/bin/env bash
# EMULATION sweep (needs root: the emulated cluster): step time of stock, ACCO fixed, DPU and
# dynamic against the communication / compute ratio, with an accelerator stand-in for compute
# (benchmarks/emulation.py: a wait per micro-batch, no CPU; real gradients and real rounds of
# an 8M-parameter model over shaped links). The ratio is measured per run (the probe's isolated
# round against half a step's compute); its nominal value sets the wait per micro-batch from the
# round time ROUND_S measured once beforehand.
#   scripts/emulation_sweep.sh [OUT_DIR]   (env: WORLD=2 RATE=1gbit GAS=8 REPEATS=1 ROUND_S=0.4
#     VARIANTS="stock fixed dpu dynamic" RATIOS="0.1 0.25 0.5 1 2 4" STEPS=5; repeat k runs the variants
#     rotated by k; mode auto spends its first 3 steps measuring as stock: give it STEPS=10 or more)
set -uo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-bench_results/emulation}"
mkdir -p "$OUT"
export DS_ACCELERATOR=cpu
PY=${PYTHON:-python}
WORLD=${WORLD:-2}; RATE=${RATE:-1gbit}; GAS=${GAS:-8}; REPEATS=${REPEATS:-1}; ROUND_S=${ROUND_S:-0.4}
PARAMS=${PARAMS:-8e6}; STEPS=${STEPS:-5}
read -r -a NAMES <<<"${VARIANTS:-stock fixed dpu dynamic}"
for ((r = 0; r < REPEATS; r++)); do
  # the order rotated by the repeat: no variant always first (a cold cache) or last
  order=""; for ((i = 0; i < ${#NAMES[@]}; i++)); do order+="${order:+,}${NAMES[$(((i + r) % ${#NAMES[@]}))]}"; done
  for ratio in ${RATIOS:-0.1 0.25 0.5 1 2 4}; do
    # one round = ratio x half a step's compute = ratio x (GAS/2) x wait
    wait_s=$("$PY" -c "print(round($ROUND_S / ($ratio * $GAS / 2), 4))")
    label="emu-w$WORLD-$RATE-gas$GAS-r$ratio-rep$r"
    echo "=== ratio $ratio: $wait_s s per micro-batch ($label)"
    "$PY" -m benchmarks ab --network emulated --world "$WORLD" --rate "$RATE" --gas "$GAS" --steps "$STEPS" --warmup 1 \
      --n-embd 64 --n-layer 1 --n-head 2 --emulate-params "$PARAMS" --emulate-compute-s "$wait_s" \
      --variants "$order" --prefix "emu$r" --out "$OUT" --label "$label" >"$OUT/$label.log" 2>&1 \
      || echo "FAILED: $label (see $OUT/$label.log)"
  done
done
"$PY" -m benchmarks sweep "$OUT/emu-*.json" --out "$OUT"
