"""The timeline's per-step figures (issue 42 item 4: fixed mode near r = 1, shown with a timeline)."""
import pytest

from benchmarks import timeline


def _trace():
    """gas 2: a slow first step (2 s, warm-up), then steps of 1.0 / 1.1 / 1.0 / 1.1 s; a wait at each
    step's half boundary (0.3 / 0.1 / 0.3 s); estimate rounds 0.4-0.5 s, commits 0.6 s (step 0's: 5 s, 0.9 s)."""
    compute, blocking, rounds, t = [], [], [], 0.0
    spans, waits, estimates = (2.0, 1.0, 1.1, 1.0, 1.1), (0.0, 0.3, 0.1, 0.3, 0.2), (5.0, 0.4, 0.5, 0.45, 0.5)
    for step, (span, wait, est) in enumerate(zip(spans, waits, estimates)):
        compute += [(t, 0.35 * span), (t + 0.5 * span, 0.35 * span)]
        if wait:
            blocking.append((t + 0.35, wait))
        rounds += [(f"estimate {step}", t, est), (f"commit {step}", t + 0.5 * span, 0.9 if step == 0 else 0.6)]
        t += span
    return {"variant": "fixed", "gas": 2, "compute": compute, "blocking": blocking, "rounds": rounds, "total_s": t}


def test_stats_are_medians_past_the_first_step():
    st = timeline.stats(_trace())
    assert st["step_s"] == pytest.approx(1.0)  # steps 1-3 (a step's end is the next one's start): 2 s left out
    assert st["wait_s"] == pytest.approx(0.3)  # per step, the median, not the mean
    assert st["round_s"] == {"commit": pytest.approx(0.6), "estimate": pytest.approx(0.475)}  # kinds apart, step 0 out
