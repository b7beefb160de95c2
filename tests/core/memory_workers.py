"""Allocations of ACCO's phase ends, counted inside spawned ranks (tests/test_round_memory.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ds_acco
from alloc_counter import AllocCounter

IN = OUT = 512  # ~267k parameters: a shard of 2 ranks is 133k elements, 8 budgets (32 chunks)
CHUNK = 4096


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.Tanh(), torch.nn.Linear(OUT, 8))


def phase_end_allocations(acco: dict, optimizer: str = "adamw", extra: dict = None, steps: int = 3, gas: int = 4):
    """Train ``steps`` optimizer steps with rounds run inline (synchronous lane, so they run on
    this thread, where the counter sees them), the drift metric measured in every commit (mode
    acco; ``metrics.estimate_drift_every`` 1); return, per phase end, what ACCO itself allocated
    (the wrapped optimizer's own step is not counted: stock ZeRO-1 runs the same step)."""
    model = _model()
    opts = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2)}
    opt = opts[optimizer](model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "acco": {"synchronous": True, "chunk_elements": CHUNK,
                                        "metrics": {"estimate_drift_every": 1}, **acco}, **(extra or {})}
    with AllocCounter() as built:  # what the engine allocates for good (ACCO's G, B, ...)
        engine, *_ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    counter = AllocCounter()
    torch_opt = engine.optimizer.optimizer
    # its step is not counted (hooks, not an override of step: a round's step runs on the round's own groups)
    torch_opt.register_step_pre_hook(lambda *_: setattr(counter, "paused", counter.paused + 1))
    torch_opt.register_step_post_hook(lambda *_: setattr(counter, "paused", counter.paused - 1))
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(dist.get_rank())
    ends = []
    for _ in range(gas * steps):
        loss = engine(torch.randn(4, IN, generator=g).to(dtype)).float().pow(2).mean()
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        counter.allocations = []
        with counter:
            engine.step()
        if boundary:
            ends.append({"largest": counter.largest, "total_bytes": counter.total_bytes,
                         "report": counter.report(5)})
    shard = engine.optimizer.driver.schedule.groups[0].segment
    records = engine.acco_metrics_history
    drift = [("prev_step_estimate_drift" in r) for r in records]  # the sampled commits' drift, read with the next
    engine.destroy()
    return {"ends": ends, "shard": shard, "drift_records": drift, "built": sorted((a.storage_elems, str(a.dtype)) for a in built.allocations)}


def cases(cases):
    return [phase_end_allocations(**c) for c in cases]
