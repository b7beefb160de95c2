"""Ranks that drain (evaluate via committed_weights, save checkpoints) at equal micro-batch counts
while dynamic phases leave them at different phase positions (tests/test_drain_agreement.py)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional


import ds_acco
from fixtures import batch
from lifecycle_workers import _engine_for
from workers import snapshot


@dataclass(frozen=True)
class EveryN:
    """A deterministic stand-in for dynamic phases: this rank ends its phase after ``n``
    micro-batches, whatever its peers do (a different n per rank puts the ranks at different
    phase positions at every drain, reproducibly, so a resumed run can be compared bit for bit)."""
    n: int

    def ends(self, n: int, round_done: Callable[[], bool]) -> Optional[str]:
        return "every" if n >= self.n else None


def drain_run(case, total, drain_every, save_every=0, save_dir=None, resume_dir=None, resume_at=None):
    """Feed ``total`` micro-batches; after every ``drain_every``-th one read the committed weights
    (an evaluation), after every ``save_every``-th one save tag 'mb<i>' into ``save_dir``.
    ``resume_dir``/``resume_at``: load tag 'mb<resume_at>' first and go on from there."""
    import faulthandler
    faulthandler.dump_traceback_later(case.get("dump_after_s", 100), exit=False)  # a hang shows where
    rank = int(os.environ["RANK"])
    warned = []  # ds_acco's warnings (e.g. a 'shared' phase held open past a whole phase of all ranks)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("ds_acco").addHandler(handler)
    engine = _engine_for(case)
    schedule = engine.optimizer.schedule
    if case.get("every"):
        schedule.phases = EveryN(case["every"][rank])
    start = 0
    if resume_dir is not None:
        path, _ = engine.load_checkpoint(resume_dir, tag=f"mb{resume_at}")
        assert path is not None
        start = resume_at + 1
    sleep = case.get("sleep", [0.0, 0.0])[rank]
    losses, points, positions = [], [], []
    for i in range(start, total):
        loss = engine(*batch(rank, i))
        engine.backward(loss)
        if sleep:
            time.sleep(sleep)
        engine.step()
        losses.append(loss.item())
        if (i + 1) % drain_every == 0:
            positions.append(len(schedule.history))  # phases ended so far, before the drain
            with ds_acco.committed_weights(engine):
                points.append((i, engine.global_steps, snapshot(engine.module)))
        if save_every and (i + 1) % save_every == 0:
            engine.save_checkpoint(save_dir, tag=f"mb{i}")
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
    steps = engine.global_steps
    reasons = [p.reason for p in schedule.history]
    engine.destroy()
    faulthandler.cancel_dump_traceback_later()
    logging.getLogger("ds_acco").removeHandler(handler)
    return {"losses": losses, "points": points, "positions": positions, "final": final, "global_steps": steps,
            "reasons": reasons, "warned": [w for w in warned if "holds its phase open" in w]}


def extra_drain_run(case, total, extra_at):
    """Rank 0 alone reads the committed weights once more, after micro-batch ``extra_at``; both ranks
    then train on. Returns where and how each rank stopped."""
    from ds_acco.core.round.rounds import DrainMismatchError
    rank = int(os.environ["RANK"])
    engine = _engine_for(case)
    if case.get("every"):
        engine.optimizer.schedule.phases = EveryN(case["every"][rank])
    stopped, error = None, None
    try:
        for i in range(total):
            engine.backward(engine(*batch(rank, i)))
            engine.step()
            if i == extra_at and rank == 0:
                with ds_acco.committed_weights(engine):
                    pass
    except DrainMismatchError as exc:
        stopped, error = i, str(exc)
    except Exception as exc:  # noqa: BLE001 -- reported, so the test says what happened instead
        stopped, error = i, f"{type(exc).__name__}: {exc}"
    engine.optimizer.driver.abandon()  # the ranks no longer agree: let go without a drain
    return {"stopped": stopped, "error": error}
