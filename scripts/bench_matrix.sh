#!/usr/bin/env bash
# The BENCHMARKS.md matrix on the emulated cluster (needs root). Usage:
#   bash scripts/bench_matrix.sh [OUT_DIR]
# Each run writes <label>.json/.md/_*.png into OUT_DIR; `summarize` combines them at the end.
# Ordered by priority, so a cut-short matrix still has the main comparisons.
set -uo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-bench_results/matrix}"
mkdir -p "$OUT"
export DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ds_ext}"
AB="python -m benchmarks ab --network emulated --out $OUT --steps 5 --warmup 1"
run() { echo "=== $*"; $AB "$@" || echo "FAILED: $*"; }
run --world 2 --rate 1gbit --gas 16
run --world 2 --rate 100mbit --gas 16
run --world 2 --rate 1gbit --gas 4
run --world 2 --rate 100mbit --gas 4
run --world 2 --gas 16                       # unshaped
run --world 2 --gas 4                        # unshaped
run --world 2 --rate 1gbit --gas 8 --slow-rank 1 --slow-factor 2   # heterogeneous: rank 1 computes 2x slower
run --world 4 --rate 1gbit --gas 8           # 4 ranks on 2 cores: oversubscribed
# training quality at equal tokens: longer, held-out loss on committed weights every 5 steps
run --world 2 --gas 4 --steps 21 --eval-every 5 --eval-batches 8 --variants stock,fixed,dpu --label quality-w2-unshaped-gas4
# both frameworks side by side: stock ZeRO-1 / stock FSDP2 and the ACCO variants of each
run --world 2 --rate 1gbit --gas 16 --variants all --label fsdp-w2-1gbit-gas16
run --world 2 --rate 100mbit --gas 4 --variants all --label fsdp-w2-100mbit-gas4
python -m benchmarks summarize "$OUT/w*.json" "$OUT/quality*.json" "$OUT/fsdp*.json" --out "$OUT"
echo MATRIX_DONE
