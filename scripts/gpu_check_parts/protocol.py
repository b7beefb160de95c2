"""The protocol part: the lane's stream protocol recorded on the device (RecordingAccelerator), its
race windows widened by spins, each wait of the lane removed in turn to show the checks catch it."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .checks import EXACT, MUTATIONS, Checks, device_sleep, rel_error, sleep_cycles_per_ms

PROTOCOL_CASES = {"acco": {"mode": "acco", "clip": 0.05}, "dpu": {"mode": "dpu"}}
PROTOCOL_GAS, PROTOCOL_STEPS = 4, 4
PACK_SPIN, ROUND_SPIN = "pack spin", "round spin"  # marks in the recording's log where a spin was queued


def widen_race_windows(engine, compute_sleep: Callable[[], None], round_sleep: Callable[[], None]) -> None:
    """Make each of the lane's waits matter for the numbers. The compute stream spins right before
    it packs G into B: a round that does not wait for the pack reads the previous round's B. Each
    round spins on its side stream after its host read, before its optimizer step: compute that does
    not wait for the round reads B before the round has written it."""
    def delayed(step, sleep):
        def run(*args, **kwargs):
            sleep()  # on the calling thread's current stream
            return step(*args, **kwargs)
        return run
    for group in engine.optimizer.schedule.groups:
        group.pack_grads = delayed(group.pack_grads, compute_sleep)
    shard_optimizer = engine.optimizer.driver.shard_optimizer
    for name in ("commit", "estimate_into"):
        setattr(shard_optimizer, name, delayed(getattr(shard_optimizer, name), round_sleep))


def _marked(acc, what: str, sleep: Callable[[], None]) -> Callable[[], None]:
    def run():
        acc.mark(what)
        sleep()
    return run


def widening(log, lane_thread: str = "acco-comm") -> dict:
    """Where a recorded run's spins sat (:func:`widen_race_windows`): how many packs and rounds
    spun, and how many host reads a round made after its spin -- a read there waits for the spin,
    so the round would resolve only once its writes are near, and the window would close again."""
    out = {"pack_spins": 0, "round_spins": 0, "reads_after_round_spin": 0}
    spun = False
    for e in log:
        if e.kind == "mark" and e.what == PACK_SPIN:
            out["pack_spins"] += 1
        elif e.thread != lane_thread:
            continue
        elif e.kind == "mark" and e.what == ROUND_SPIN:
            out["round_spins"] += 1
            spun = True
        elif e.kind == "read":
            out["reads_after_round_spin"] += spun
        elif e.kind == "record":  # the round's done event: its end
            spun = False
    return out


def record(device: torch.device, case: dict, args) -> dict:
    """One recorded DeepSpeed run (tests/comm/stream_workers.py) and its distance to the reference."""
    import stream_workers
    from ds_acco.testing.recording import RecordingAccelerator
    from fixtures import TinyNet, batch, make_optimizer
    from reference import reference_run
    engines = []
    if device.type == "cuda":
        from deepspeed.accelerator import get_accelerator
        acc = RecordingAccelerator(inner=get_accelerator())
        per_ms = sleep_cycles_per_ms()
        spin = lambda ms: device_sleep(ms, per_ms)  # noqa: E731
    else:
        acc = RecordingAccelerator()  # the CPU as an asynchronous device: kernels run at once
        spin = lambda ms: lambda: None  # noqa: E731 -- nothing to widen; the marks still show where

    def setup(engine):
        engines.append(engine)
        widen_race_windows(engine, _marked(acc, PACK_SPIN, spin(args.pack_sleep_ms)),
                           _marked(acc, ROUND_SPIN, spin(args.round_sleep_ms)))
    case = dict(case, gas=PROTOCOL_GAS, steps=PROTOCOL_STEPS)
    try:
        out = stream_workers.train_recorded(acc, case, setup=setup)
    except Exception as exc:  # a mutated run may fail in its rounds; the caller decides
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.destroy()
        return {"raised": f"{type(exc).__name__}: {exc}"}
    want = reference_run(TinyNet(seed=0), batch, world=1, gas=PROTOCOL_GAS, steps=PROTOCOL_STEPS, mode=case["mode"],
                         make_optimizer=make_optimizer("adamw"), clip=case.get("clip", 0.0))
    out["reference_rel_error"] = rel_error(out.pop("final"), want)
    out["widening"] = widening(acc.log)
    out["steady_compute_syncs"] = [s for s in out["compute_syncs"][2 * PROTOCOL_GAS:] if s]
    return out


def check_protocol(checks: Checks, device: torch.device, args) -> dict:
    runs = {name: record(device, dict(case, mutate=args.mutate), args) for name, case in PROTOCOL_CASES.items()}
    raised = {n: r["raised"] for n, r in runs.items() if "raised" in r}
    if raised:
        checks.expect("protocol.races", False, raised, f"the recorded runs raised: {raised}")
        return {"runs": runs}
    checks.expect("protocol.races", all(not r["races"] for r in runs.values()),
                  {n: r["races"][:5] for n, r in runs.items()},
                  "unordered cross-stream accesses: " + "; ".join(f"{n}: {r['races'][:2]}" for n, r in runs.items()))
    checks.expect("protocol.compute_syncs", all(not r["steady_compute_syncs"] for r in runs.values()),
                  {n: r["steady_compute_syncs"] for n, r in runs.items()},
                  "host syncs on the compute side in steady state: "
                  + "; ".join(f"{n}: {r['steady_compute_syncs'][:3]}" for n, r in runs.items()))
    lane = {n: {"reads": len(r["lane_syncs"]), "rounds": r["rounds"]} for n, r in runs.items()}
    checks.expect("protocol.lane_reads",
                  all(r["rounds"] >= PROTOCOL_STEPS and len(r["lane_syncs"]) <= r["rounds"] for r in runs.values()),
                  lane, f"lane host reads vs rounds: {lane}")
    spins = {n: dict(r["widening"], rounds=r["rounds"]) for n, r in runs.items()}
    checks.expect("protocol.widened", all(w["pack_spins"] >= w["rounds"] and w["round_spins"] >= w["rounds"]
                                          and not w["reads_after_round_spin"] for w in spins.values()), spins,
                  f"every round must spin after its host read and every pack before it writes B: {spins}")
    errors = {n: r["reference_rel_error"] for n, r in runs.items()}
    checks.expect("protocol.reference", all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    if args.mutate is None:  # the checks above must catch each wait removed
        for how in MUTATIONS:
            run = record(device, dict(PROTOCOL_CASES["acco"], mutate=how), args)
            runs[f"acco {how}"] = run
            raced = "raised" in run or bool(run["races"])
            wrong = "raised" in run or run["reference_rel_error"] >= EXACT
            caught = raced and (wrong or device.type != "cuda")  # on CPU kernels run at once: no wrong numbers
            checks.expect(f"protocol.catches_{how.replace('-', '_')}", caught,
                          {"races": run.get("races", [])[:2], "raised": run.get("raised"),
                           "reference_rel_error": run.get("reference_rel_error")},
                          f"with {how} the run had races={raced} and wrong numbers={wrong}")
    return {"runs": runs}
