"""Soak: 80 rounds on an 8 MB model; nothing grows (memory, threads, handles).

The model is large enough that one leaked model-sized buffer (8.4 MB) exceeds the RSS threshold
(6 MB): with a ~100-parameter model a threshold of 20 MB could not see such a leak at all. To make
RSS show what stays alive, the ranks run with glibc's mmap threshold fixed at 1 MiB (blocks of that
size and up go back to the OS when freed; by default malloc keeps freed 8 MB blocks and RSS wanders
by ~40 MB on this model; malloc_trim at each sample still left 8 MB steps), and every sample is
taken at the same phase position with no round in flight (its temporaries freed).
"""
import pytest

from dist import run_ranks
from fixtures import WideNet
import lifecycle_workers

MICRO_BATCHES, SAMPLE_EVERY = 161, 20  # samples every 20 micro-batches: a multiple of gas, same phase position
RSS_THRESHOLD_MB = 6.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["acco"])
def test_long_run_does_not_grow(mode, monkeypatch):
    model_mb = sum(p.numel() * p.element_size() for p in WideNet().parameters()) / 2**20
    assert model_mb > RSS_THRESHOLD_MB + 2  # one leaked model-sized buffer is seen
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # read by the spawned ranks' glibc at start
    case = {"optimizer": "adamw", "gas": 4, "model": "wide", "acco": {"enabled": True, "mode": mode}}
    samples = run_ranks(lifecycle_workers.soak, case=case, micro_batches=MICRO_BATCHES, sample_every=SAMPLE_EVERY)[0]
    first, last = samples[1], samples[-1]  # after warm-up
    for s in samples:
        print(s)
    assert last["rounds_submitted"] == MICRO_BATCHES // 2  # one round per phase of 2 micro-batches
    assert all(s["inflight"] <= 1 and s["lane_queue"] <= s["inflight"] for s in samples)  # at most the one round
    assert max(s["os_threads"] for s in samples[1:]) == first["os_threads"]
    assert max(s["threads"] for s in samples[1:]) == first["threads"]
    assert last["history"] <= 4096 and last["metrics_records"] <= 1000
    rss = [s["rss_mb"] for s in samples[1:]]
    print(f"model {model_mb:.1f} MB; RSS after warm-up {min(rss):.1f}..{max(rss):.1f} MB, "
          f"last - first {last['rss_mb'] - first['rss_mb']:+.1f} MB")
    assert max(rss) - first["rss_mb"] < RSS_THRESHOLD_MB, (first, max(samples[1:], key=lambda s: s["rss_mb"]))
