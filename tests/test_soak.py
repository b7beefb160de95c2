"""Soak: thousands of micro-batches of a tiny model; nothing grows (memory, threads, handles)."""
import pytest

from dist import run_ranks
import workers

MICRO_BATCHES = 2000


@pytest.mark.parametrize("mode", ["acco"])
def test_long_run_does_not_grow(mode):
    case = {"optimizer": "adamw", "gas": 4, "acco": {"enabled": True, "mode": mode}}
    samples = run_ranks(workers.soak, case=case, micro_batches=MICRO_BATCHES, sample_every=250, timeout=600)[0]
    first, last = samples[1], samples[-1]  # after warm-up
    for s in samples:
        print(s)
    assert last["rounds_submitted"] == MICRO_BATCHES // 2  # one round per phase of 2 micro-batches
    assert all(s["inflight"] <= 1 and s["lane_queue"] <= s["inflight"] for s in samples)  # at most the one round
    assert max(s["os_threads"] for s in samples[1:]) == first["os_threads"]
    assert max(s["threads"] for s in samples[1:]) == first["threads"]
    assert last["history"] <= 4096 and last["metrics_records"] <= 1000
    assert last["rss_mb"] - first["rss_mb"] < 20, (first, last)
