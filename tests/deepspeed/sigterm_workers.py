"""SIGTERM in the FSDP2 adapter (inside spawned ranks)."""
from __future__ import annotations

import signal

from fsdp_workers import build, feed_until_sigterm


def fsdp_sigterm_run(case, signal_rank, signal_at, total):
    """A handler the program installed before is chained; every rank stops at the same round."""
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    prior = signal.getsignal(signal.SIGTERM)
    model, acco = build(case)
    done, code = feed_until_sigterm(model, acco, total, signal_rank, signal_at)
    out = {"stopped": code is not None, "code": code, "done": done, "global_steps": acco.global_steps,
           "prior_called": list(seen)}
    acco.close()
    out["restored"] = signal.getsignal(signal.SIGTERM) is prior
    return out
