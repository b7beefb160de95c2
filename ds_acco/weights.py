"""The committed weights of an ACCO engine, for evaluation and export."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def committed_weights(engine):
    """Inside, the model holds the newest committed parameters θ (never the estimate θ̃).

    A commit round still in flight is waited for first (it then counts as committed:
    ``engine.global_steps`` and the LR scheduler advance); an estimate round in flight goes on,
    since the live weights already are the committed ones. On exit the live weights are
    restored, so training continues on exactly the trajectory it would have had. Meant for
    evaluation and export of the model's weights: do not run backward passes inside. For a
    stock DeepSpeed engine this is a no-op.
    """
    hook = getattr(engine, "acco_committed_weights", None)  # AccoEngine and AccoFSDP have it
    inner = hook() if hook is not None else contextlib.nullcontext()
    with inner:
        yield engine
