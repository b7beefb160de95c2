"""Optional side probe (NOT used for the main comparison): run pretrain_gpt.py unchanged, but after
every engine.step() print DeepSpeed's engine.get_global_grad_norm() on every rank, because
Megatron-DeepSpeed's train_step sets grad_norm = None on its --deepspeed (non-pipeline) path and
so prints no grad-norm column.  Usage (the script argument order of ds_acco run is kept):
    deepspeed --num_gpus 4 --module ds_acco run /work/megatron-tp/gn_probe.py pretrain_gpt.py ARGS...
"""
import os
import sys

import deepspeed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run_script, beside this file
import run_script  # noqa: E402

_orig_init = deepspeed.initialize  # ds_acco's router when launched through `ds_acco run`


def _init(*args, **kwargs):
    out = _orig_init(*args, **kwargs)
    engine = out[0]
    step = engine.step
    rank = int(os.environ.get("RANK", "0"))
    n = [0]

    def probed_step(*a, **k):
        r = step(*a, **k)
        n[0] += 1
        g = engine.get_global_grad_norm()
        print(f"GNPROBE rank {rank} iteration {n[0]} grad_norm {g}", flush=True)
        return r

    engine.step = probed_step
    return out


deepspeed.initialize = _init
run_script.run()
