"""SIGTERM in the FSDP2 adapter (inside spawned ranks)."""
from __future__ import annotations

import os
import signal

from fsdp_workers import build, feed


def fsdp_sigterm_run(case, signal_rank, signal_at, total):
    """A handler the program installed before is chained; every rank stops at the same round."""
    rank = int(os.environ["RANK"])
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    prior = signal.getsignal(signal.SIGTERM)
    model, acco = build(case)
    done = 0
    out = {"stopped": False}
    try:
        for i in range(total):
            feed(model, acco, i, i + 1)
            done = i + 1
            if rank == signal_rank and i == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit as exc:
        out = {"stopped": True, "code": exc.code}
    out.update(done=done, global_steps=acco.global_steps, prior_called=list(seen))
    acco.close()
    out["restored"] = signal.getsignal(signal.SIGTERM) is prior
    return out
