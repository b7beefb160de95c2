"""Which parts of a rank's shard count in the gradient norm under tensor parallelism
(FlatBuffers.set_norm_params): runs of the counted parameters clipped to the rank's segment,
adjacent runs merged, none where the segment holds only replicated parameters."""
import torch

from ds_acco.core.round.buffers import FlatBuffers


def _flat(rank, world=2, n=20):
    live = torch.zeros(n)
    return FlatBuffers(live, torch.zeros(n), torch.zeros(n // world), rank=rank, world=world,
                       comm_dtype=torch.float32)


def test_runs_are_clipped_to_the_segment_and_merged():
    # parameters at [0,4) [4,7) [7,12) [12,15) [15,20); counted: the 2nd, 3rd and 5th
    counted = [(4, 3), (7, 5), (15, 5)]
    r0, r1 = _flat(0), _flat(1)
    r0.set_norm_params(counted)
    r1.set_norm_params(counted)
    assert r0.norm_ranges == [(4, 6)]  # [4,12) clipped to segment [0,10): one merged run
    assert r1.norm_ranges == [(0, 2), (5, 5)]  # [10,12) and [15,20), relative to 10
    shard = torch.arange(10.0)
    assert [p.tolist() for p in r1.norm_pieces([shard])] == [[0.0, 1.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    assert float(sum((p ** 2).sum() for p in r0.norm_pieces([shard]))) == sum(x * x for x in range(4, 10))


def test_a_segment_of_replicated_parameters_only_counts_nothing():
    r0 = _flat(0)
    r0.set_norm_params([(12, 8)])  # the only tensor-parallel parameter lies in rank 1's segment
    assert r0.norm_ranges == [] and r0.norm_pieces([torch.ones(10)]) == []


def test_without_tensor_parallelism_the_whole_shard_counts():
    shard = torch.ones(10)
    (whole,) = _flat(0).norm_pieces([shard])
    assert whole is shard
