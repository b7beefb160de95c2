"""In-flight schedule states saved by the code before issue 41's refactor (ac8fa32) load into today's
schedule and continue exactly as that code continued them (its weights and counters, recorded with it).

The saved states (tests/core/saved_states/ac8fa32_<mode>.pt) are a one-rank schedule over 8 weights,
Adam at lr 0.1, after 11 micro-batches of gradient (w - target) x (1 + 0.1 x (i mod 3)) at
gradient_accumulation_steps 4: the round in flight, G, B and the position mid-phase. Loaded, then 13
more micro-batches; the committed weights and counters must equal ac8fa32's own continuation
(``ac8fa32_continued.json``). The master weights are not part of the schedule's state (a checkpoint
restores them with the optimizer): both runs continue from zeros, alike.
"""
import json
from pathlib import Path

import pytest

from dist import run_ranks
from timeouts import scaled

SAVED = Path(__file__).parent / "saved_states"
CONFIGS = {"fixed": dict(mode="acco", sync_warmup_steps=1), "dpu": dict(mode="dpu"),
           "shared": dict(mode="acco", accumulation="shared")}


def _continue(name):
    import torch
    import torch.distributed as dist

    from ds_acco.comm.lane import CommLane
    from ds_acco.config import AccoConfig
    from ds_acco.core.round.buffers import FlatBuffers
    from ds_acco.core.schedule.machine import AccoSchedule
    from ds_acco.core.schedule.options import ScheduleOptions
    from ds_acco.core.step.shard_optimizer import ShardOptimizer
    dist.init_process_group("gloo")  # the harness's store (tests/dist.py)
    config = AccoConfig(enabled=True, **CONFIGS[name])
    n = 8
    live, grads = torch.zeros(n), torch.zeros(n)
    master = torch.nn.Parameter(live.clone())
    group = FlatBuffers(live, grads, master, rank=0, world=1, comm_dtype=torch.float32)
    opt = torch.optim.Adam([master], lr=0.1)
    schedule = AccoSchedule([group], ShardOptimizer(opt, [master]), CommLane(timeout_s=60),
                            process_group=dist.group.WORLD, rank=0, world=1,
                            options=ScheduleOptions.from_config(config, 4))
    saved = torch.load(SAVED / f"ac8fa32_{name}.pt", weights_only=False)
    opt.load_state_dict(saved["opt"])
    schedule.load_state_dict(saved["sched"])
    target = torch.arange(n, dtype=torch.float32)
    for i in range(11, 24):
        schedule.before_backward()
        grads.add_((live - target) * (1 + 0.1 * (i % 3)))
        ends = schedule.decide_phase_end()
        schedule.record_micro_batch(1.0)
        if ends:
            schedule.end_phase()
    schedule.drain()
    with schedule.committed_weights():
        weights = live.tolist()
    out = {"committed_steps": schedule.committed_steps, "step_index": schedule.step_index,
           "micro_batches": schedule.micro_batches, "weights": weights}
    schedule.close()
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_state_saved_before_the_refactor_continues_as_it_did(name):
    want = json.loads((SAVED / "ac8fa32_continued.json").read_text())[name]
    (got,) = run_ranks(_continue, world=1, timeout=scaled(60), name=name)
    assert got == want  # every weight exactly (float32 values as Python floats)


def _load_and_listen(lr_scale):
    import logging

    import torch
    import torch.distributed as dist

    from ds_acco.comm.lane import CommLane
    from ds_acco.config import AccoConfig
    from ds_acco.core.round.buffers import FlatBuffers
    from ds_acco.core.schedule.machine import AccoSchedule
    from ds_acco.core.schedule.options import ScheduleOptions
    from ds_acco.core.step.shard_optimizer import ShardOptimizer
    dist.init_process_group("gloo")
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("ds_acco").addHandler(handler)
    config = AccoConfig(enabled=True, estimate={"lr_scale": lr_scale}, **CONFIGS["fixed"])
    live, grads = torch.zeros(8), torch.zeros(8)
    master = torch.nn.Parameter(live.clone())
    opt = torch.optim.Adam([master], lr=0.1)
    schedule = AccoSchedule([FlatBuffers(live, grads, master, rank=0, world=1, comm_dtype=torch.float32)],
                            ShardOptimizer(opt, [master]), CommLane(timeout_s=60), process_group=dist.group.WORLD,
                            rank=0, world=1, options=ScheduleOptions.from_config(config, 4))
    saved = torch.load(SAVED / "ac8fa32_fixed.pt", weights_only=False)
    opt.load_state_dict(saved["opt"])
    schedule.load_state_dict(saved["sched"])
    schedule.close()
    return [m for m in heard if "lr_scale" in m]


def test_a_state_saved_before_lr_scale_was_recorded_warns_a_run_whose_estimate_is_not_the_old_default():
    # ac8fa32 recorded no lr_scale; its default was 2 for every optimizer (a Lion or Adafactor run resumed
    # today gets 1 from its family unless the config sets it): said, with the fix
    (heard,) = run_ranks(_load_and_listen, world=1, timeout=scaled(60), lr_scale=1.0)
    assert len(heard) == 1 and "lr_scale" in heard[0] and '"estimate": {"lr_scale": 2}' in heard[0], heard
    (quiet,) = run_ranks(_load_and_listen, world=1, timeout=scaled(60), lr_scale=2.0)
    assert quiet == []
