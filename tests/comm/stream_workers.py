"""Rank workers that train through the real engines with the recording accelerator as the lane's
device API (tests/comm/test_stream_protocol.py)."""
from __future__ import annotations

import torch

import ds_acco
from ds_acco.testing.recording import RecordingAccelerator
from fixtures import TinyNet, batch, ds_config, make_optimizer

LANE_THREAD = "acco-comm"


def adam_step_counts(optimizer):
    """torch Adam's ``step`` counts: CPU tensors by torch's design (not capturable), read with
    ``.item()`` by every Adam step; not device reads."""
    return lambda t: t.dim() == 0 and any(t is s.get("step") for s in optimizer.state.values())


def record_deepspeed(case: dict) -> dict:
    """ZeRO-1 + ACCO with every lane stream, event and host read recorded by a recording accelerator
    pretending the CPU is a device (``case``: see :func:`train_recorded`)."""
    return train_recorded(RecordingAccelerator(), case)


def train_recorded(acc: RecordingAccelerator, case: dict, setup=None) -> dict:
    """Train TinyNet through DeepSpeed's engine with ``acc`` as the lane's accelerator and every
    micro-batch recorded; summarise what it recorded (:func:`_summary`).

    ``case``: gas, steps, mode, synchronous, optimizer, clip, mutate (None, or 'no-ready-wait' /
    'no-done-wait': the lane skips that wait, to show the checks catch it). ``setup(engine)`` runs
    once before training (scripts/gpu_check.py widens the race windows there). The micro-batches go
    to the engine's device, so ``acc`` may wrap a real accelerator."""
    import ds_acco.deepspeed.optimizer as ds_opt
    import os
    rank = int(os.environ["RANK"])
    seam = ds_opt._stream_accelerator
    ds_opt._stream_accelerator = lambda device: acc
    try:
        model = TinyNet(seed=0)
        gas = case.get("gas", 4)
        acco = {"enabled": True, "mode": case.get("mode", "acco"), "synchronous": case.get("synchronous", False)}
        cfg = ds_config(gas, acco, clip=case.get("clip", 0.0))
        opt = make_optimizer(case.get("optimizer", "adamw"))(model)
        engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    finally:
        ds_opt._stream_accelerator = seam
    acc.exclude_reads = adam_step_counts(opt)
    _mutate(engine.optimizer.schedule.lane, case.get("mutate"))
    if setup is not None:
        setup(engine)
    losses = []
    n = gas * case.get("steps", 4)
    data = [tuple(t.to(engine.device) for t in batch(rank, i)) for i in range(n)]
    from deepspeed.accelerator import get_accelerator
    # DeepSpeed's own accelerator too: its throughput timer synchronised the whole device at every
    # forward and step (found on an H200), which on a GPU waits for the lane's side stream
    with acc.recording(), acc.watching(get_accelerator()):
        for i, (x, y) in enumerate(data):
            acc.mark(f"start {i}")
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            acc.mark(f"end {i}")
    rounds = engine.optimizer.schedule.lane.rounds_submitted
    out = _summary(acc, n, rounds)
    with ds_acco.committed_weights(engine):
        out["final"] = {k: v.detach().cpu().clone() for k, v in engine.module.named_parameters()}
    out["losses"] = [float(v) for v in losses]
    engine.destroy()
    return out


def record_fsdp(case: dict) -> dict:
    """The FSDP2 adapter with the recording accelerator as its lane's device API."""
    import os
    import ds_acco.core.driver as driver
    import fsdp_workers
    acc = RecordingAccelerator()
    driver.stream_accelerator = lambda device, accelerator=None: acc
    gas, steps = case.get("gas", 4), case.get("steps", 4)
    model, acco = fsdp_workers.build({"optimizer": case.get("optimizer", "adamw"), "gas": gas,
                                      "acco": {"enabled": True, "mode": case.get("mode", "acco")},
                                      "clip": case.get("clip", 0.0)})
    acc.exclude_reads = adam_step_counts(acco.optimizer)
    rank = int(os.environ["RANK"])
    n = gas * steps
    losses = []
    with acc.recording():
        for i in range(n):
            acc.mark(f"start {i}")
            loss = model(*batch(rank, i))
            acco.backward(loss)
            acco.step()
            losses.append(loss.detach())
            acc.mark(f"end {i}")
    out = _summary(acc, n, acco.driver.lane.rounds_submitted)
    out["losses"] = [float(v) for v in losses]
    acco.close()
    return out


def _summary(acc: RecordingAccelerator, micro_batches: int, rounds: int) -> dict:
    """Host syncs per micro-batch on the compute side -- every thread but the lane's: on a device,
    autograd runs backward on a thread of its own -- and on the lane; races; streams and waits."""
    compute = [[e.what for e in acc.host_syncs(between=(f"start {i}", f"end {i}")) if e.thread != LANE_THREAD]
               for i in range(micro_batches)]
    lane = [e.what for e in acc.host_syncs(thread=LANE_THREAD)]
    return {"races": acc.races(), "compute_syncs": compute, "lane_syncs": lane, "rounds": rounds,
            "streams": [(s.id, s.device_index) for s in acc.streams()],
            "waits": [(e.kind, e.thread) for e in acc.events()]}


def _mutate(lane, how):
    """A deliberately broken lane protocol (the checks must catch it)."""
    if how is None:
        return
    accel = lane._accel

    class Skipping:
        def __getattr__(self, name):
            return getattr(accel, name)

        def Stream(self, *a, **k):  # noqa: N802
            return accel.Stream(*a, **k)

        def current_stream(self, index=None):
            s = accel.current_stream(index)
            if how == "no-done-wait":
                return _NoWait(s)
            return s

    if how == "no-ready-wait":
        lane._stream = _NoWait(lane._stream)
    lane._accel = Skipping()


class _NoWait:
    def __init__(self, s):
        self._s = s

    def __getattr__(self, name):
        return getattr(self._s, name)

    def wait_event(self, event):
        pass
