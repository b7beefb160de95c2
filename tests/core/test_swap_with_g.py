"""B ← G at a commit launch exchanges the two buffers' storage instead of copying (FlatBuffers),
where B is exactly G's bytes in G's dtype; otherwise it copies."""
import torch

from ds_acco.core.round.buffers import FlatBuffers
from ds_acco.core.round.rounds import RoundKind


def _flat(comm_dtype=torch.float32, live_dtype=torch.float32, accum_dtype=torch.float32, n=8):
    live = torch.zeros(n, dtype=live_dtype)
    g = FlatBuffers(live, torch.zeros(n, dtype=accum_dtype), torch.zeros(n // 2), rank=0, world=2,
                    comm_dtype=comm_dtype)
    moved = []
    g.on_grads_moved = moved.append
    return g, moved


def test_a_commit_swaps_storage_and_hands_over_the_new_g():
    g, moved = _flat()
    g.grads.copy_(torch.arange(8.0))
    old_g, old_b = g.grads.data_ptr(), g.comm.data_ptr()
    g.pack_grads(RoundKind.COMMIT, clear=True)
    assert g.comm.data_ptr() == old_g and g.grads.data_ptr() == old_b  # no full-size copy
    assert g.reduce_view(RoundKind.COMMIT).tolist() == list(range(8))
    assert g.grads.tolist() == [0.0] * 8 and moved == [g.grads]


def test_bf16_g_with_bf16_b_swaps_fp32_g_with_a_bf16_b_copies():
    g, moved = _flat(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    g.pack_grads(RoundKind.COMMIT, clear=True)
    assert len(moved) == 1
    g, moved = _flat(comm_dtype=torch.bfloat16)  # fp32 G reduced in bf16 (B as wide as the fp32 weights): a copy
    g.grads.fill_(3.0)
    old_b = g.comm.data_ptr()
    g.pack_grads(RoundKind.COMMIT, clear=True)
    assert not moved and g.comm.data_ptr() == old_b
    assert g.reduce_view(RoundKind.COMMIT).float().tolist() == [3.0] * 8 and g.grads.tolist() == [0.0] * 8


def test_an_estimate_keeps_g_and_copies():
    g, moved = _flat()
    g.grads.fill_(2.0)
    g.pack_grads(RoundKind.ESTIMATE, clear=False)
    assert not moved and g.grads.tolist() == [2.0] * 8 and g.reduce_view(RoundKind.ESTIMATE).tolist() == [2.0] * 8
