#!/usr/bin/env bash
# issue 42 item 2: the HF Trainer fine-tune with the one-round predictors, 5 seeds
cd /work/main && . .venv/bin/activate
export TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions
SEEDS="${SEEDS:-0 1 2 3 4}" VARIANTS='{"stock": null, "la2": {"enabled": true}, "dpu": {"enabled": true, "mode": "dpu"},
 "ef": {"enabled": true, "mode": "one_round", "predictor": "ef"},
 "ext1": {"enabled": true, "mode": "one_round", "predictor": "ext"},
 "nag": {"enabled": true, "mode": "one_round", "predictor": "nag"}}' \
  nice -n 10 bash scripts/finetune_fidelity.sh "$1"
