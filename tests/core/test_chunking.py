"""The chunk policy (one function: device and sizes in, window size out) and the windows a round
walks through."""
import random

import pytest
import torch

from ds_acco.config import AccoConfig
from ds_acco.core.step import chunking
from ds_acco.core.round.buffers import FlatBuffers
from ds_acco.core.schedule.phases import FixedPhases
from ds_acco.core.schedule.machine import AccoSchedule, ScheduleOptions
from ds_acco.core.step.shard_optimizer import ShardOptimizer

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build

M = 1 << 20
SHARD_7B_8 = 875_000_000  # a 7B model's shard on 8 ranks
GIB = 1 << 30


def test_cpu_keeps_the_memory_bound():
    """CPU: 2M elements at most, 1/64 of the shard, not below 256K: gloo's all-gather travels in pieces of
    the chunk, and 64K-element pieces paid a per-call cost that made a 16 MB gather 1.5-1.8x slower
    (issue 42 item 4: fixed mode near r = 1)."""
    assert chunking.chunk_elements("cpu", SHARD_7B_8) == 2 * M
    assert chunking.chunk_elements("cpu", 64 * M) == M
    assert chunking.chunk_elements(torch.device("cpu"), M) == 256 * 1024
    assert chunking.chunk_elements("cpu", 1000) == 256 * 1024
    for world in (2, 4, 8, 16, 32):  # each rank's piece of gloo's gather stays >= 64K elements, up to the cap
        for shard in (M, 16 * M, SHARD_7B_8):
            assert chunking.chunk_elements("cpu", shard, world=world) // world >= 64 * 1024
    assert chunking.chunk_elements("cpu", M, world=64) == 2 * M  # the cap holds: the buffer stays 8 MiB


def test_accelerators_take_64m_or_the_whole_shard():
    floor = 64 * M
    assert chunking.chunk_elements("cuda", 10 * M) >= 10 * M  # unchunked
    assert chunking.chunk_elements("cuda:3", SHARD_7B_8) == floor
    assert chunking.chunk_elements("xpu", SHARD_7B_8) == floor


def test_an_explicit_chunk_overrides_the_policy():
    assert chunking.chunk_elements("cuda", SHARD_7B_8, requested=4096) == 4096
    assert chunking.chunk_elements("cpu", M, requested=3 * M) == 3 * M
    for bad in (0, -1, 2.5, True, chunking.MAX_CHUNK_ELEMS + 1):
        with pytest.raises(ValueError, match="chunk_elements"):
            chunking.chunk_elements("cpu", M, requested=bad)


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu"])
def test_every_chunk_is_bounded(device):
    """Issue 40: the rounds' temporaries, which the lane's side stream keeps cached between rounds on an
    accelerator, are at most 24 B x 64 Mi elements (1.5 GiB) whatever the shard (a shard of 10^11
    elements; the old rule took a whole shard of up to 1/384 of the free memory) and whatever the
    config: acco.chunk_elements above 2**26 is refused, naming the key and the bound."""
    for shard in (1, 10 ** 6, SHARD_7B_8, 10 ** 11):
        got = chunking.chunk_elements(device, shard)
        assert 1 <= got <= chunking.MAX_CHUNK_ELEMS == 1 << 26
        assert got * chunking.WORKSPACE_BYTES_PER_ELEMENT <= 1.5 * GIB
    assert chunking.chunk_elements(device, SHARD_7B_8, requested=chunking.MAX_CHUNK_ELEMS) == 1 << 26
    assert AccoConfig.from_block({"chunk_elements": 1 << 26}).chunk_elements == chunking.MAX_CHUNK_ELEMS
    with pytest.raises(ValueError, match=r"acco\.chunk_elements = 67108865: .*from 1024 to 67108864"):
        AccoConfig.from_block({"chunk_elements": (1 << 26) + 1})


def _check_windows(numels, chunk):
    seen = [[] for _ in numels]
    count = 0
    for window in chunking.windows(numels, chunk):
        count += 1
        assert window and chunking.window_size(window) <= chunk
        at = 0
        for p in window:
            assert p.at == at and p.n > 0  # packed from 0, in order
            at += p.n
            seen[p.index].append((p.start, p.n))
            if chunk >= 64:  # splits only where torch's CPU fused Adam splits a tensor itself: at
                # multiples of its 16-float task unit (a 64-byte cache line; AVX-512 holds 16 floats)
                assert p.start % 16 == 0
                assert p.start + p.n == numels[p.index] or (p.start + p.n) % 16 == 0
    for numel, parts in zip(numels, seen):  # every element exactly once, in order
        assert sum(n for _, n in parts) == numel
        assert all(s == sum(n for _, n in parts[:i]) for i, (s, _) in enumerate(parts))
    return count


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 4096])
def test_windows_cover_every_element_once_in_order(chunk):
    rng = random.Random(chunk)
    sizes = [0, 1, 5, 63, 64, 65, 127, 1000, 5000] if chunk >= 64 else [0, 1, 5, 63, 64, 65, 127]
    for _ in range(20):
        numels = [rng.choice(sizes) for _ in range(rng.randint(1, 30))]
        count = _check_windows(numels, chunk)
        # windows are nearly full: never more than one per tensor beyond the packed count
        assert count <= -(-sum(numels) // max(1, chunk - chunking.ALIGN + 1)) + len(numels)


def test_windows_span_many_tensors():
    """512 small tensors in one window: what makes one foreach kernel cover them all."""
    windows = list(chunking.windows([2048] * 512, 64 * M))
    assert len(windows) == 1 and len(windows[0]) == 512
    assert len(list(chunking.windows([100 * M], 64 * M))) == 2


def test_auto_is_the_default_and_the_schedule_applies_the_policy():
    assert AccoConfig().chunk_elements == "auto"
    assert ScheduleOptions.from_config(AccoConfig(), 4).chunk_elems is None
    assert ScheduleOptions.from_config(AccoConfig(chunk_elements=4096), 4).chunk_elems == 4096
    for requested, expected in ((None, 256 * 1024), (4096, 4096)):
        live = torch.zeros(3 * M)
        group = FlatBuffers(live, torch.zeros_like(live), torch.zeros(3 * M), rank=0, world=1,
                            comm_dtype=torch.float32)
        so = ShardOptimizer(torch.optim.SGD([group.master], lr=0.1), [group.master])
        options = ScheduleOptions(mode="dpu", phases=FixedPhases(1), chunk_elems=requested)
        schedule = AccoSchedule([group], so, lane=None, process_group=None, rank=0, world=1, options=options)
        assert schedule.context.chunk_elems == so.chunk_elems == expected
