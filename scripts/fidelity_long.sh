#!/usr/bin/env bash
# Long-run fidelity at equal tokens (real compute, loopback, no emulation): stock ZeRO-1 vs ACCO
# fixed (and any other VARIANTS) over STEPS steps with a warm-up + cosine schedule (DeepSpeed's
# WarmupCosineLR), at each learning-rate multiple of the shipped AdamW's 1e-3; judged on the held-out
# loss averaged over the last 30% of the steps (python -m benchmarks fidelity).
#   scripts/fidelity_long.sh [OUT_DIR]
#   env: STEPS=1000 WARMUP=50 LRS="0.5 1 2" GAS=8 EVAL_EVERY=50 MODEL="--n-embd 128 --n-layer 2 --n-head 4"
#        VARIANTS=stock,fixed  SLOW="" (e.g. "--slow-rank 1 --slow-factor 2" with VARIANTS=stock,shared)
#        SEEDS="0" (initial weights and data order; several seeds: the summary adds their median gap)
set -euo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-bench_results/fidelity}"
mkdir -p "$OUT"
export DS_ACCELERATOR=cpu
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0}; STEPS=${STEPS:-1000}; WARMUP=${WARMUP:-50}; LRS=${LRS:-"0.5 1 2"}; GAS=${GAS:-8}; EVAL_EVERY=${EVAL_EVERY:-50}
MODEL=${MODEL:-"--n-embd 128 --n-layer 2 --n-head 4"}; VARIANTS=${VARIANTS:-stock,fixed}; SLOW=${SLOW:-}
read -r -a model <<<"$MODEL"
read -r -a slow <<<"$SLOW"
tag=$(echo "$MODEL" | tr -d ' -' | sed 's/nembd/e/;s/nlayer/l/;s/nhead/h/')
for lr in $LRS; do
  cfg="$OUT/zero1-lr$lr-cosine$STEPS.json"
  "$PY" - "$cfg" "$lr" "$STEPS" "$WARMUP" <<'PY'
import json, sys
from ds_acco import configs
path, mult, steps, warmup = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = json.load(open(configs.resolve("zero1.json")))
cfg["optimizer"]["params"]["lr"] *= mult
cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": warmup,
                    "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_type": "linear"}}
json.dump(cfg, open(path, "w"), indent=1)
PY
  for seed in $SEEDS; do
    label="fid-$tag-lr$lr-$STEPS"
    [ "$seed" = 0 ] || label+="-s$seed"  # seed 0 keeps the name of the runs published before seeds
    echo "=== $(date -u +%H:%M:%S) $label"
    "$PY" -m benchmarks ab --network loopback --world 2 --gas "$GAS" --steps "$STEPS" --warmup 1 "${model[@]}" \
      "${slow[@]}" --eval-every "$EVAL_EVERY" --eval-batches 8 --variants "$VARIANTS" --config "$cfg" --seed "$seed" \
      --out "$OUT" --label "$label" >"$OUT/$label.log" 2>&1 || echo "FAILED: $label (see $OUT/$label.log)"
  done
done
"$PY" -m benchmarks fidelity "$OUT"/fid-*.json --out "$OUT" --stem "fidelity-$tag"
