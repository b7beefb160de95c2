"""The drift metric's fused pass (ds_acco/core/round/drift.py) gives the values of its definition: the three
squared distances ‖θ̃ − θ_{t+1}‖², ‖θ_{t+1} − θ_t‖², ‖θ̃ − θ_t‖² summed over the ranks, here computed
in float64 from the whole tensors (what the fp64 passes it replaced computed), on 2 gloo ranks, with
windows that split tensors, a bf16 estimate and θ_t kept in bf16; and which commits are sampled."""
import pytest

from dist import run_ranks
from timeouts import scaled

SEGMENT = 10_000


def _sums(chunk, live_dtype, kept_dtype):
    import torch
    import torch.distributed as dist

    from ds_acco.core.round.buffers import FlatBuffers
    from ds_acco.core.round.drift import drift_sums

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    before = torch.randn(SEGMENT, generator=g)  # θ_t
    after = before - 1e-3 * torch.randn(SEGMENT, generator=g)  # θ_{t+1}
    live = torch.zeros(world * SEGMENT, dtype=live_dtype)
    estimate = before - 2e-3 * torch.randn(SEGMENT, generator=g)  # θ̃_{t+1}
    live.narrow(0, rank * SEGMENT, SEGMENT).copy_(estimate)
    group = FlatBuffers(live, torch.zeros_like(live), after.clone(), rank=rank, world=world, comm_dtype=torch.float32)
    kept = before.to(kept_dtype)
    got = drift_sums([group], [kept], chunk, None).tolist()
    e64, a64, b64 = live.narrow(0, rank * SEGMENT, SEGMENT).double(), after.double(), kept.double()
    want = torch.tensor([((e64 - a64) ** 2).sum(), ((a64 - b64) ** 2).sum(), ((e64 - b64) ** 2).sum()],
                        dtype=torch.float64)
    dist.all_reduce(want)
    return got, want.tolist()


@pytest.mark.parametrize("chunk,live_dtype,kept_dtype", [(4096, "float32", "float32"), (1000, "bfloat16", "float32"),
                                                         (SEGMENT, "float32", "bfloat16")])
def test_the_fused_pass_gives_the_definitions_values(chunk, live_dtype, kept_dtype):
    import torch
    for got, want in run_ranks(_sums, chunk=chunk, live_dtype=getattr(torch, live_dtype),
                               kept_dtype=getattr(torch, kept_dtype), timeout=scaled(60)):
        # fp32 differences of values 1e-3 apart, fp64 sums: relative error ~1e-6; a wrong term
        # (a missing window, s·m's sign, the factor 2) moves a sum by far more
        assert got == pytest.approx(want, rel=1e-5), (got, want)
        assert got[0] != pytest.approx(got[2], rel=1e-2)  # the three sums differ: each is checked


def test_sampled_commits():
    from ds_acco.core.round.drift import sampled
    assert [t for t in range(10) if sampled(t, 3)] == [0, 3, 6, 9]
    assert [t for t in range(4) if sampled(t, 1)] == [0, 1, 2, 3]
    assert not any(sampled(t, 0) for t in range(4))
