#!/usr/bin/env bash
# The README's demo: stock ZeRO-1 vs ACCO (fixed, dynamic) vs DPU on a ~10M-parameter GPT-2,
# two CPU ranks, with the A/B runner of ds_acco.bench. As root the two ranks run as two
# "nodes" joined by an emulated 1 Gbit/s link (network namespaces + tc); otherwise on
# loopback, where overlap cannot show (the runner says why).
#
#   bash scripts/demo.sh                          # defaults below
#   bash scripts/demo.sh --rate 100mbit --gas 16  # extra arguments go to `python -m ds_acco.bench ab`
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
python -m pip install --quiet --disable-pip-version-check -e '.[examples,bench]'

export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
mkdir -p "$TORCH_EXTENSIONS_DIR"

exec python -m ds_acco.bench ab --world 2 --rate 1gbit --gas 16 --steps 6 --out bench_results/demo "$@"
