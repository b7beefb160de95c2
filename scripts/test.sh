#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if missing, installs this package with torch
# pinned (an unpinned torch would pull a multi-GB CUDA build), then its test extras; with no
# arguments it runs the whole suite (its two tiers at once), otherwise pytest with the arguments.
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
if [[ $# -gt 0 || "${ACCO_TEST_SERIAL:-0}" == 1 ]]; then  # ACCO_TEST_SERIAL=1: one session, as before
  exec python -m pytest -q --durations=25 "$@"  # the slowest tests, in every CI log
fi
# The whole suite: the slow tier (whole jobs under launchers, fresh interpreters: much of it waits on
# start-ups, sleeps and peers, about one core of two busy on average) runs beside the quick tier, two
# pytest sessions at once; the slow tier's output follows the quick tier's. They share nothing but
# the machine: their ranks bind their own ports, each session's /dev/shm sweep leaves the other's
# live buffers alone (tests/shm_sweep.py).
slow_log=$(mktemp "${TMPDIR:-/tmp}/ds_acco-slow-tier.XXXXXX")
set -m  # its own process group: a background job would otherwise ignore SIGINT (see the trap below)
python -m pytest -q --durations=25 -m slow </dev/null >"$slow_log" 2>&1 &
slow=$!
set +m
# Interrupted (Ctrl-C, CI's cancel): stop the slow tier as Ctrl-C would, so its tests end their jobs.
trap '[[ -n "$slow" ]] && kill -INT "$slow" 2>/dev/null && wait "$slow"; rm -f "$slow_log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
quick_rc=0
python -m pytest -q --durations=25 -m "not slow" || quick_rc=$?
slow_rc=0
wait "$slow" || slow_rc=$?
slow=
echo "==================== the slow tier (-m slow), run beside the quick tier ===================="
cat "$slow_log"
echo "quick tier: exit $quick_rc; slow tier: exit $slow_rc"
(( quick_rc == 0 )) || exit "$quick_rc"
exit "$slow_rc"
