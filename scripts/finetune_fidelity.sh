#!/usr/bin/env bash
# The short fine-tune fidelity case (issue 34): a tiny BERT topic classifier fine-tuned under the real HF
# Trainer (benchmarks/finetune.py: 2 CPU ranks, ZeRO-1, gas 4, 60 steps of the Trainer's linear schedule,
# DeepSpeed's AdamW), stock ZeRO-1 and each ACCO variant for every seed. Runs are paired: every run of a
# seed starts from the same pretrained checkpoint, classifier init and data order (the table checks it).
# The table: held-out loss on the committed weights at the end, the gap against stock per seed, its median
# and range (python -m benchmarks.finetune summarize).
#   scripts/finetune_fidelity.sh [OUT_DIR]          (default bench_results/finetune)
#   env: SEEDS="0 1 2 3 4"
#        VARIANTS='{"stock": null, "paper": {"enabled": true, "estimate": "paper"}, ...}'   name -> acco block
#                 (JSON; null: stock), run in this order for each seed; the first is the table's baseline.
#                 Default: stock, the paper's estimate, the look-ahead estimate with lr_scale 1.5 and 2.
#        ARGS=""        more arguments for every run (Trainer or task arguments, e.g. "--learning_rate 1e-3")
#        TIMEOUT=1200   seconds per run before it is killed
# A run whose record exists is skipped, so an interrupted sweep resumes; the summary refuses records made
# with different settings. The first run pretrains the shared checkpoint into OUT_DIR/pretrained.
set -euo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-bench_results/finetune}"
PY=${PYTHON:-python}
SEEDS=${SEEDS:-"0 1 2 3 4"}
VARIANTS=${VARIANTS:-'{"stock": null, "paper": {"enabled": true, "estimate": "paper"},
  "lookahead1.5": {"enabled": true, "estimate": {"lr_scale": 1.5}},
  "lookahead2": {"enabled": true, "estimate": {"lr_scale": 2.0}}}'}
ARGS=${ARGS:-}
TIMEOUT=${TIMEOUT:-1200}
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
read -r -a extra <<<"$ARGS"
mkdir -p "$OUT/configs" "$OUT/records" "$OUT/logs"

# name<TAB>block per variant, in the given order
mapfile -t variants < <("$PY" -c 'import json, sys
for name, block in json.loads(sys.argv[1]).items():
    print(f"{name}\t{json.dumps(block)}")' "$VARIANTS")
baseline=${variants[0]%%$'\t'*}
for line in "${variants[@]}"; do
  "$PY" -m benchmarks.finetune config --acco "${line#*$'\t'}" --out "$OUT/configs/${line%%$'\t'*}.json"
done

sweep_start=$(date +%s)
for seed in $SEEDS; do
  for line in "${variants[@]}"; do
    name=${line%%$'\t'*}
    record="$OUT/records/$name-s$seed.json"
    if [ -f "$record" ]; then echo "=== $name seed $seed: $record exists, skipped"; continue; fi
    echo "=== $(date -u +%H:%M:%S) $name seed $seed"
    t0=$(date +%s)
    if timeout --kill-after=30 "$TIMEOUT" "$PY" -m torch.distributed.run --nnodes 1 --nproc_per_node 2 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
        -m ds_acco run -m benchmarks.finetune train --deepspeed "$OUT/configs/$name.json" --variant "$name" \
        --seed "$seed" --output_dir "$OUT/trainer" --pretrained_dir "$OUT/pretrained" --record "$record" \
        "${extra[@]}" >"$OUT/logs/$name-s$seed.log" 2>&1; then
      printf '%s\t%s\t%s\n' "$name" "$seed" "$(( $(date +%s) - t0 ))" >>"$OUT/timings.tsv"
      echo "    $(( $(date +%s) - t0 )) s"
    else
      echo "FAILED: $name seed $seed (see $OUT/logs/$name-s$seed.log)"
    fi
  done
done
echo "sweep: $(( $(date +%s) - sweep_start )) s"
"$PY" -m benchmarks.finetune summarize "$OUT"/records/*.json --baseline "$baseline" --out "$OUT/table"
