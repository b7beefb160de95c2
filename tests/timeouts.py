"""Test time limits, scaled to the machine the suite runs on.

Every limit in the suite is written as ``scaled(seconds)``, where ``seconds`` is a generous
budget for an otherwise idle 2-core machine (with DeepSpeed's CPU ops already built: the
session builds them once before any test, see conftest.py). The scale comes from the
environment variable ``ACCO_TEST_TIMEOUT_SCALE`` (a positive number) and defaults to 3, so a
machine three times slower than an idle one still passes. On a quiet machine,
``ACCO_TEST_TIMEOUT_SCALE=1`` makes a hang fail three times sooner; on a crowded one, raise it.

Limits that are themselves the behaviour under test (a launcher killing a sleeper after 1.5 s,
acco.comm_timeout_s) are not scaled; only how long the test waits for them is.
"""
from __future__ import annotations

import os

ENV = "ACCO_TEST_TIMEOUT_SCALE"
DEFAULT_SCALE = 3.0


def scale() -> float:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SCALE
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: must be a positive number (default {DEFAULT_SCALE:g})") from None
    if not value > 0:
        raise ValueError(f"{ENV}={raw!r}: must be a positive number (default {DEFAULT_SCALE:g})")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` (an idle-machine budget) times the machine's scale."""
    return seconds * scale()
