#!/usr/bin/env bash
# The README's demo: stock ZeRO-1 vs ACCO on a small GPT-2, two CPU ranks, side by side.
#
#   bash scripts/demo.sh                 # defaults (examples/train_gpt.py --ab)
#   bash scripts/demo.sh --steps 60      # extra arguments go to examples/train_gpt.py
#
# Idempotent: creates .venv only if missing; pip skips what is already installed. The first run
# also compiles DeepSpeed's small CPU communication op (about a minute) into .cache/.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

if [ ! -x .venv/bin/python ]; then
    echo "demo: creating .venv"
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# torch first and pinned: with no torch installed, an unpinned one pulls a multi-GB CUDA build.
# Where the default index only has CUDA wheels, point TORCH_INDEX_URL at a CPU wheel index.
python -m pip install --quiet --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e '.[examples]'

export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
mkdir -p "$TORCH_EXTENSIONS_DIR"

exec deepspeed --num_gpus 2 examples/train_gpt.py --ab "$@"
