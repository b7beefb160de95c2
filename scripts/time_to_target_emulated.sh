#!/usr/bin/env bash
# EMULATION: time to a target held-out loss, measured in one run per variant (needs root: the
# emulated cluster). Compute is the accelerator stand-in of benchmarks/emulation.py (a wait per
# micro-batch, no CPU) around a small real GPT whose held-out loss is tracked on committed weights;
# a zero-gradient bulk parameter makes the rounds PARAMS large, over shaped links. Variants: stock,
# ACCO fixed, DPU, ACCO dynamic with each learning-rate rule, order rotated per repeat; with BIG_GAS,
# stock also runs at that gradient_accumulation_steps (stock at dynamic's larger batch).
#   scripts/time_to_target_emulated.sh [OUT_DIR]
#   env: WORLD=2 RATE=1gbit GAS=8 RATIO=4 ROUND_S=0.25 PARAMS=4e6 STEPS=150 EVAL_EVERY=10 REPEATS=3 BIG_GAS=
#        VARIANTS="stock fixed dpu dynamic dynamic_sqrt dynamic_linear" (space-separated)
#        heterogeneous hardware (EMULATION): SLOW_RANK=1 SLOW_FACTOR=2 [JITTER=0.3] [TRANSIENT=3,0.2]
#        (the slow rank's micro-batches stretched SLOW_FACTOR x; RATIO is then the fast ranks' ratio)
# ROUND_S is one round's time at PARAMS measured beforehand (e.g. the sweep's probe); the wait per
# micro-batch makes one round RATIO x half a step's compute (the run measures the real ratio).
set -uo pipefail
# benchmarks/ is not installed: put the checkout on the path, so this runs from any directory
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-bench_results/ttt}"
mkdir -p "$OUT"
export DS_ACCELERATOR=cpu
PY=${PYTHON:-python}
WORLD=${WORLD:-2}; RATE=${RATE:-1gbit}; GAS=${GAS:-8}; RATIO=${RATIO:-4}; ROUND_S=${ROUND_S:-0.25}
PARAMS=${PARAMS:-4e6}; STEPS=${STEPS:-150}; EVAL_EVERY=${EVAL_EVERY:-10}; REPEATS=${REPEATS:-3}; BIG_GAS=${BIG_GAS:-}
read -r -a VARIANTS <<<"${VARIANTS:-stock fixed dpu dynamic dynamic_sqrt dynamic_linear}"
MODEL=(--n-embd 128 --n-layer 2 --n-head 4 --emulate-params "$PARAMS" --eval-every "$EVAL_EVERY" --eval-batches 4)
SLOW=(); slow_stem=""
if [ -n "${SLOW_RANK:-}" ]; then
  SLOW=(--slow-rank "$SLOW_RANK" --slow-factor "${SLOW_FACTOR:-2}")
  slow_stem="-slow${SLOW_RANK}x${SLOW_FACTOR:-2}"
  if [ -n "${JITTER:-}" ]; then SLOW+=(--slow-jitter "$JITTER"); slow_stem+="-jitter$JITTER"; fi
  if [ -n "${TRANSIENT:-}" ]; then SLOW+=(--transient "$TRANSIENT"); slow_stem+="-transient${TRANSIENT//,/x}"; fi
fi
MODEL+=("${SLOW[@]}")
wait_s=$("$PY" -c "print(round($ROUND_S / ($RATIO * $GAS / 2), 4))")
stem="ttt-w$WORLD-$RATE-gas$GAS-r$RATIO$slow_stem"
for ((r = 0; r < REPEATS; r++)); do
  n=${#VARIANTS[@]}; order=""
  for ((i = 0; i < n; i++)); do order+="${VARIANTS[$(((i + r) % n))]},"; done
  echo "=== repeat $r: ${order%,} ($wait_s s per micro-batch)"
  "$PY" -m benchmarks ab --network emulated --world "$WORLD" --rate "$RATE" --gas "$GAS" --steps "$STEPS" \
    --warmup 1 "${MODEL[@]}" --emulate-compute-s "$wait_s" --variants "${order%,}" --prefix "ttt$r" \
    --out "$OUT" --label "$stem-rep$r" >"$OUT/$stem-rep$r.log" 2>&1 || echo "FAILED: $stem-rep$r (see $OUT/$stem-rep$r.log)"
  if [ -n "$BIG_GAS" ]; then
    big_steps=$("$PY" -c "print(max(20, int(1.5 * $STEPS * $GAS / $BIG_GAS)))")
    "$PY" -m benchmarks ab --network emulated --world "$WORLD" --rate "$RATE" --gas "$BIG_GAS" --steps "$big_steps" \
      --warmup 1 "${MODEL[@]}" --emulate-compute-s "$wait_s" --variants stock --prefix "ttb$r" --out "$OUT" \
      --label "$stem-stockgas$BIG_GAS-rep$r" >"$OUT/$stem-stockgas$BIG_GAS-rep$r.log" 2>&1 \
      || echo "FAILED: $stem-stockgas$BIG_GAS-rep$r"
  fi
done
"$PY" -m benchmarks ttt "$OUT/$stem-*rep*.json" --out "$OUT" --stem "$stem"
