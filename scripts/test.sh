#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if missing, installs torch first (an
# unpinned torch would pull a multi-GB CUDA build), then this package with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e .  # deepspeed and the package's own requirements: what the op build needs
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
# Build DeepSpeed's CPU ops once, before pytest and outside every test's time limit, after
# removing build locks left by killed compiles (see tests/prebuild.py). The compile (~1.5 min on
# 2 cores) runs while pip installs the test extras (downloads and unpacking), not after them.
python tests/prebuild.py &
prebuild=$!
python -m pip install -q -e '.[test,mpi]'
wait "$prebuild"
export ACCO_TEST_OPS_BUILT=1
# Test time limits: ACCO_TEST_TIMEOUT_SCALE (tests/timeouts.py; default 3x an idle machine's budget).
exec python -m pytest -q --durations=25 "$@"  # the slowest tests, in every CI log
