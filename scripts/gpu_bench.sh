#!/usr/bin/env bash
# The prepared GPU benchmark: one GPU (H100 or H200), three parts, under 10 minutes.
#
# On the GPU machine, from the repository root:   bash scripts/gpu_bench.sh [OUT_DIR] [gpu_bench.py options]
# Its wheels are gpu_check's (scripts/gpu_env.sh), prepared here first with:
#                                                  bash scripts/gpu_bench.sh --prepare-wheels
# Dry run without a GPU (CPU, gloo, tiny models, about a minute):
#                                                  bash scripts/gpu_bench.sh OUT_DIR --cpu --tiny
# Parts (scripts/gpu_bench.py's docstring): gpu_check (scripts/gpu_check.sh, 150 s limit), step time of
# stock ZeRO-1 and ACCO fixed at GPT-2 small and medium sizes, the fidelity sweep at GPT-2-small scale.
# Writes OUT_DIR/gpu_bench.json (rewritten after each part) and OUT_DIR/gpu_bench.md; exit status 0 only
# if every part holds numbers. 9:40, then SIGKILL 10 s later: the JSON keeps the parts finished by then.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
gpu_prelude "$@"
OUT=${1:-${OUT:-gpu_bench_out}}
exec timeout --kill-after=10 580 python3 scripts/gpu_bench.py --out "$OUT" "${@:2}"
