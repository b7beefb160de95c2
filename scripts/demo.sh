#!/usr/bin/env bash
# The README's demo, in two parts, both with the A/B runner of benchmarks on two ranks. As root
# the ranks run as two "nodes" joined by an emulated 1 Gbit/s link (network namespaces + tc);
# otherwise on loopback.
#
# 1. EMULATION (what ACCO does on an accelerator): each micro-batch's forward + backward is a
#    wait that takes no CPU (benchmarks/emulation.py) around a small real GPT, and a bulk
#    parameter makes the gradients and rounds 4M parameters large; stock ZeRO-1, ACCO fixed, DPU
#    and ACCO dynamic train 30 steps with a held-out evaluation every 10, and the run prints step
#    times and the time to a target held-out loss. One round is about half of half a step's
#    compute here (as root), the regime where ACCO fixed hides its rounds.
# 2. Real compute on this machine's CPU: the ~10M-parameter GPT-2, gas 16. On 2 CPU cores the
#    rounds' own CPU work (gloo copies, the shard optimizer step) slows the compute they overlap,
#    so ACCO cannot gain here; BENCHMARKS.md explains the numbers.
#
#   bash scripts/demo.sh                          # both parts
#   DEMO_EMULATED=0 bash scripts/demo.sh          # part 2 only
#   bash scripts/demo.sh --rate 100mbit --gas 16  # extra arguments go to part 2's `python -m benchmarks ab`
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

if [ "${DEMO_EMULATED:-1}" != 0 ]; then
    echo "== part 1 of 2: EMULATION (accelerator stand-in: compute is a wait, no CPU; real rounds)"
    python -m benchmarks ab --world 2 --rate 1gbit --gas 8 --steps 30 --warmup 1 --eval-every 10 \
        --n-embd 64 --n-layer 1 --n-head 2 --emulate-params 4e6 --emulate-compute-s 0.15 \
        --variants stock,fixed,dpu,dynamic --label demo-emulated --out bench_results/demo
    echo "== part 2 of 2: real compute on this machine's CPU cores (cannot gain on 2 cores: see above)"
fi
exec python -m benchmarks ab --world 2 --rate 1gbit --gas 16 --steps 6 --out bench_results/demo "$@"
