"""Memory side probe (NOT used for the loss comparison): run pretrain_gpt.py unchanged, reset the
kernel's peak-RSS mark just before Megatron builds the model and the DeepSpeed engine
(megatron.training.setup_model_and_optimizer), and at exit write this rank's peak RSS above that
baseline to $MEM_PROBE_OUT/rank<R>.json, with the parameter count of its tensor-parallel shard.
The same measurement as ds_acco's A/B runner (`ab --memory`: benchmarks.worker.reset_peak_rss /
peak_rss). With MEM_PROBE_TRACE=1 it also records (call, RSS MiB, peak MiB above the baseline)
after each engine forward / backward / step, to see where a peak arises.
Usage (the script argument order of ds_acco run is kept):
    MEM_PROBE_OUT=DIR deepspeed --num_gpus 4 --module ds_acco run mem_probe.py pretrain_gpt.py ARGS...
"""
import atexit
import json
import os
import sys

import deepspeed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run_script, beside this file
import run_script  # noqa: E402

# the checkout's benchmarks/ (not installed): this file sits in docs/bench/megatron-tp2/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from benchmarks.worker import _status_kb, peak_rss, reset_peak_rss  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
OUT = os.environ["MEM_PROBE_OUT"]
TRACE = os.environ.get("MEM_PROBE_TRACE") == "1"
state = {"baseline": None, "n_params": None, "trace": [], "calls": 0}
MiB = 2 ** 20


def _mib(peak_or_rss):
    return None if peak_or_rss is None else round(peak_or_rss / MiB, 1)


def _write():
    if state["baseline"] is None:
        return
    os.makedirs(OUT, exist_ok=True)
    peak = peak_rss()
    rec = {"rank": RANK, "n_params": state["n_params"], "baseline_rss_bytes": state["baseline"],
           "peak_rss_bytes": peak, "peak_mem_delta_bytes": None if peak is None else peak - state["baseline"],
           "engine_calls": state["calls"]}
    if TRACE:
        rec["trace_mib"] = state["trace"]
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(rec, f, indent=1)


atexit.register(_write)


def _record(name):
    if TRACE:
        rss = _status_kb("VmRSS")
        peak = peak_rss()
        base = state["baseline"]
        state["trace"].append([name, _mib(None if rss is None else rss * 1024 - base),
                               _mib(None if peak is None else peak - base)])


def _wrap(obj, name):
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        r = fn(*a, **k)
        state["calls"] += 1
        _record(name)
        return r

    setattr(obj, name, wrapped)


_orig_init = deepspeed.initialize  # ds_acco's router when launched through `ds_acco run`


def _init(*args, **kwargs):
    out = _orig_init(*args, **kwargs)
    engine = out[0]
    if getattr(engine, "_mem_probe_wrapped", False):  # ds_acco's router may call deepspeed.initialize again
        return out
    engine._mem_probe_wrapped = True
    state["n_params"] = sum(p.numel() for p in engine.module.parameters())
    for name in ("forward", "backward", "step"):
        _wrap(engine, name)
    return out


deepspeed.initialize = _init


def _install_reset():
    import megatron.training as training
    setup = training.setup_model_and_optimizer

    def probed_setup(*a, **k):
        state["baseline"] = reset_peak_rss()
        return setup(*a, **k)

    training.setup_model_and_optimizer = probed_setup


script, _ = run_script.script_path()
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # megatron, for the reset hook
_install_reset()
run_script.run()
