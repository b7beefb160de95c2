#!/usr/bin/env bash
# EMULATION (root: the emulated cluster): time to target with one rank slower than the other, for
# stock / ACCO fixed / ACCO shared / ACCO dynamic, 3 repeats with the order rotated, at one round
# ~0.25 x half a step's compute on the fast rank (1M-parameter rounds over 1 Gbit/s, 50 ms of
# waiting + ~20 ms of the small GPT's own CPU work per micro-batch). Slow factors: FACTORS.
#   scripts/heterogeneous_sweep.sh [OUT_ROOT]      env: FACTORS="2 3 1.5 1.25" STEPS=64 REPEATS=3
#   JITTER / TRANSIENT (see time_to_target_emulated.sh) add a straggler's jitter or a transient slowdown.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/heterogeneous}
for f in ${FACTORS:-2 3 1.5 1.25}; do
  echo "=== $(date -u +%H:%M:%S) slow factor $f"
  RATIO=0.25 ROUND_S=0.05 PARAMS=1e6 EVAL_EVERY=8 VARIANTS="stock fixed shared dynamic" SLOW_RANK=1 \
    SLOW_FACTOR="$f" STEPS=${STEPS:-64} REPEATS=${REPEATS:-3} bash scripts/time_to_target_emulated.sh "$OUT/slow$f"
done
