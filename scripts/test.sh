#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if missing, installs this package with torch
# pinned (an unpinned torch would pull a multi-GB CUDA build), then its test extras; with no
# arguments it runs the whole suite, otherwise pytest with the arguments; in parallel workers (below).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch pinned in the same resolution as deepspeed and the package's own requirements (what the op
# build needs): one pip run, not one for torch and another that resolves it again.
python -m pip install -q torch==2.13.0 -e .
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
# Parallel (pytest-xdist, --dist loadfile: each module's tests run in one worker, in order, so its
# module fixtures start once; --no-loadscope-reorder: the workers take the modules in the order
# tests/conftest.py gives, those with whole jobs first, not xdist's largest-test-count-first): the whole
# suite in 3 workers, anything else in 2. Measured on 2 idle cores (docs/testing.md, "Suite time"):
# the suite is mostly process start-ups, waits on peers and sleeps, so a third worker pays and a fourth
# costs more in contention than it hides. ACCO_TEST_WORKERS=N or -n N among the arguments sets the
# number; ACCO_TEST_SERIAL=1 (or --pdb, --trace, -s, --capture=no, -p no:xdist among the arguments)
# runs one plain pytest session.
serial=${ACCO_TEST_SERIAL:-0}
workers=${ACCO_TEST_WORKERS:-$([[ $# -eq 0 ]] && echo 3 || echo 2)}
prev=
for arg in "$@"; do
  case $arg in
    --pdb|--trace|-s|--capture=no|-pno:xdist) serial=1;;
    no:xdist) [[ "$prev" == -p ]] && serial=1;;
    -n|-n[0-9]*|--numprocesses|--numprocesses=*) workers=;;  # the arguments name the number
  esac
  prev=$arg
done
if [[ "$serial" == 1 ]]; then
  exec python -m pytest -q --durations=25 "$@"  # the slowest tests, in every CI log
fi
exec python -m pytest -q --durations=25 ${workers:+-n "$workers"} --dist loadfile --no-loadscope-reorder "$@"
