#!/usr/bin/env bash
# The prepared GPU check: one GPU, world size 1 with NCCL, every check asserted, under 8 minutes.
#
# On the GPU machine, from the repository root:   bash scripts/gpu_check.sh [OUT_DIR] [gpu_check.py options]
# Its torch (2.11 there), transformers and accelerate are used as they are; what it lacks (deepspeed,
# hjson, pydantic...) travels as wheels in .whl/, prepared here first with:
#                                                  bash scripts/gpu_check.sh --prepare-wheels
# Dry run without a GPU (CPU, gloo, a recording accelerator pretending the CPU is a device):
#                                                  bash scripts/gpu_check.sh OUT_DIR --cpu
# Exit status 0 only if every check held; each failing one is named on stderr ("FAIL <check>: why").
# Writes OUT_DIR/gpu_check.json (every check with what it measured, rewritten after each part) and
# OUT_DIR/acco_trace.json (the torch.profiler trace the overlap checks read). The list of checks is
# the docstring of scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
gpu_prelude "$@"
OUT=${1:-${OUT:-gpu_check_out}}
# 7:30 (GPU_CHECK_TIMEOUT_S: scripts/gpu_bench.sh gives it less), then SIGKILL 10 s later: the
# script's own runtime.total check fails at 8:00, and the JSON keeps every part finished before a kill.
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-450}" python3 scripts/gpu_check.py --out "$OUT" "${@:2}"
