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
if [[ "${1:-}" == "--prepare-wheels" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 hjson==3.1.0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    ls .whl
    exit 0
fi
OUT=${1:-${OUT:-gpu_check_out}}
if ! python3 -c "import deepspeed, pydantic" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
# 7:30, then SIGKILL 10 s later: the script's own runtime.total check fails at 8:00, and the JSON
# keeps every part finished before a kill.
exec timeout --kill-after=10 450 python3 scripts/gpu_check.py --out "$OUT" "${@:2}"
