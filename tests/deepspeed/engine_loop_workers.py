"""Rank functions for tests/deepspeed/test_engine_loop.py: many ACCO engines in one process, none destroyed."""
from __future__ import annotations

import gc

import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer


def _one_engine(rank: int, micro_batches: int, mode: str, sigterm: str = "off"):
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt,
                                         config=ds_config(4, {"enabled": True, "mode": mode, "sigterm": sigterm}))
    for i in range(micro_batches):
        x, y = batch(rank, i)
        engine.backward(engine(x, y))
        engine.step()  # leaves a round in flight (6 micro-batches: the first commit)
    with ds_acco.committed_weights(engine):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return engine, weights, engine.global_steps


def undestroyed_engines(engines: int = 10, repeats: int = 3, micro_batches: int = 6, mode: str = "acco"):
    """Build ``engines`` ACCO engines one after another, never destroyed, ``repeats`` times; each
    one trains ``micro_batches`` micro-batches. Rank 1 collects garbage at other moments than rank
    0 (so an engine's finalisation runs at a different point on each rank). Returns every
    engine's (committed weights, global_steps), the number of live 'acco-comm' threads and of
    process groups left beyond those that existed before the first engine."""
    import threading
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    from torch.distributed.distributed_c10d import _world
    results, kept, groups_before = [], [], None
    for r in range(repeats):
        for k in range(engines):
            # the third round installs ACCO's SIGTERM handler: the chained handlers must not keep
            # the engines alive
            engine, weights, steps = _one_engine(rank, micro_batches, mode, "stop" if r == 2 else "off")
            if groups_before is None:
                groups_before = len(_world.pg_map) - 1  # before the first engine's own group
            results.append((weights, steps))
            if rank == 1 and k % 2 == 0:
                gc.collect()  # finalises the previous, unreferenced engines on rank 1 only
            if r == 1:
                kept.append(engine)  # the second round: engines stay referenced until the end
            del engine
        if rank == 0:
            gc.collect()
    del kept
    gc.collect()
    # A collected engine's lane thread ends by itself once its queued rounds are done, releasing
    # the group on its way out: give them a bounded moment.
    for t in [t for t in threading.enumerate() if t.name == "acco-comm"]:
        t.join(30)
    lanes = sum(1 for t in threading.enumerate() if t.name == "acco-comm")
    return {"results": results, "lanes_left": lanes, "groups_left": len(_world.pg_map) - groups_before}
