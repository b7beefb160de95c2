"""A round's kernel count is bounded (issue 21): with the accelerator chunk policy, the ops of a
round's compute at 100M parameters are at most 2x those at 1M, and at a fixed size they do not
grow with the number of parameter tensors (FSDP2 hands over one tensor per parameter, hundreds).

Counted with a dispatch mode (tests/op_counter.py) on one rank, without collectives: the round's
compute as :func:`ds_acco.core.round.rounds.run_round` runs it -- this rank's reduced shard ÷ the weight
(``shard_mean``), the squared norm (``global_norm_sq``), the clip (``clip_``), then the estimate
into B (``estimate_into``) or the commit and the write of θ into B (``commit`` + ``write_shards``).
Not counted: the collectives (one each on NCCL) and the drift metric (world > 1). Sizes of 100M
run on the meta device (no memory, the same ops; a test checks that meta and CPU dispatch the same
ops at 1M).
"""
from types import SimpleNamespace

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from ds_acco.core.step import chunking
from ds_acco.core.round import rounds
from ds_acco.core.round.buffers import BufferGroup
from ds_acco.core.round.rounds import RoundKind
from ds_acco.core.step.shard_optimizer import ShardOptimizer, global_norm_sq
from op_counter import OpCounter

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build

M = 1 << 20
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "adam-amsgrad-maximize": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True, maximize=True),
    "sgd-nesterov-wd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True,
                                                      weight_decay=0.01),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, fused=True),
}


class ShardList(BufferGroup):
    """A rank's shard as a list of parameter tensors laid end to end in its segment of B (FSDP2's
    layout, one rank): only what a round's compute reads."""

    def __init__(self, sizes, device, comm_dtype, live_dtype=torch.bfloat16):
        self.rank, self.world, self.segment = 0, 1, sum(sizes)
        self.comm_dtype, self.live_dtype = comm_dtype, live_dtype
        self.masters = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.grads = torch.zeros(0, device=device)
        self.comm = self.allocate_comm(self.segment, device, comm_dtype, live_dtype)

    @property
    def shard_params(self):
        return self.masters

    def shard_values(self):
        return [m.detach() for m in self.masters]

    def shard_views(self, flat, rank=None):
        return [flat.narrow(0, o, m.numel()) for o, m in zip(self.offsets, self.masters)]

    def _not_in_a_round(self, *args):
        raise AssertionError("not part of a round's compute")

    live_shard_views = pack_grads = unpack_into_live = swap_live_and_gathered = layout = _not_in_a_round


def _setup(device, sizes, optimizer, groups=1, comm_dtype=torch.float32, policy_device="cuda"):
    """One rank's shard of ``sizes`` tensors (param groups interleaved, as decay / no-decay), the
    optimizer with its state created, and the chunk the policy gives ``policy_device``."""
    shard = ShardList(sizes, device, comm_dtype)
    param_groups = [{"params": shard.masters[k::groups]} for k in range(groups)]
    if groups > 1:
        param_groups[1]["weight_decay"] = 0.0
    opt = OPTIMIZERS[optimizer](param_groups)
    chunk = chunking.chunk_elements(policy_device, shard.segment)
    so = ShardOptimizer(opt, shard.masters, chunk)
    check = torch_optimizer._device_dtype_check_for_fused
    if device == "meta":  # torch's fused step refuses meta parameters when it creates the state
        torch_optimizer._device_dtype_check_for_fused = lambda p, cuda_unsupported=False: None
    try:
        so.commit([torch.zeros_like(m) for m in shard.masters])  # the state exists from here on
    finally:
        torch_optimizer._device_dtype_check_for_fused = check
    return SimpleNamespace(groups=[shard], chunk_elems=chunk), so


def _round_compute(ctx, so, kind):
    grads = [rounds.shard_mean(g.shard_views(g.reduce_view(kind)), 8.0) for g in ctx.groups]
    flat_grads = [t for gs in grads for t in gs]
    global_norm_sq(flat_grads, ctx.chunk_elems)  # all-reduced and read on the host in a real round
    rounds.clip_(flat_grads, 2.0, 1.0)  # a norm above the clip: the division runs
    param_grads = [pg for g, gs in zip(ctx.groups, grads) for pg in g.param_grads(gs)]
    if kind is RoundKind.COMMIT:
        so.commit(param_grads)
        rounds.write_shards(ctx)
    else:
        so.estimate_into(param_grads, [v for g in ctx.groups for v in g.shard_views(g.gather_view())])


def count(device, sizes, optimizer, kind, **setup) -> OpCounter:
    ctx, so = _setup(device, sizes, optimizer, **setup)
    with OpCounter() as counter:
        _round_compute(ctx, so, kind)
    return counter


def _many(total, n, seed=0):
    """``n`` tensor sizes of uneven lengths summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(n, generator=g) + 0.1
    sizes = [max(1, int(w)) for w in (weights / weights.sum() * total).tolist()]
    sizes[-1] += total - sum(sizes)
    return sizes


KINDS = [RoundKind.ESTIMATE, RoundKind.COMMIT]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ops_at_100m_parameters_are_at_most_twice_those_at_1m(optimizer, kind):
    small = count("meta", [M], optimizer, kind)
    large = count("meta", [100 * M], optimizer, kind)
    print(f"{optimizer} {kind.value}: {small.kernels} ops at 1M, {large.kernels} at 100M "
          f"(views {small.view_count} / {large.view_count})")
    assert large.kernels <= 2 * small.kernels, f"1M: {small.report()}\n100M: {large.report()}"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ops_do_not_grow_with_the_number_of_parameter_tensors(optimizer, kind):
    one = count("meta", [M], optimizer, kind)
    many = count("meta", _many(M, 512), optimizer, kind)
    print(f"{optimizer} {kind.value}: {one.kernels} ops for 1 tensor, {many.kernels} for 512 "
          f"(views {one.view_count} / {many.view_count})")
    assert many.kernels == one.kernels, f"1 tensor: {one.report()}\n512: {many.report()}"
    # two param groups (decay / no decay, interleaved as in a transformer): the ops follow the groups
    two = count("meta", [M // 2, M // 2], optimizer, kind, groups=2)
    many_two = count("meta", _many(M, 512, seed=1), optimizer, kind, groups=2)
    assert many_two.kernels == two.kernels <= 2 * one.kernels, f"2: {two.report()}\n512: {many_two.report()}"


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_the_meta_device_dispatches_the_ops_the_cpu_does(comm_dtype):
    """What is counted on meta tensors is what runs on real ones (1M elements on CPU, the
    accelerator's chunk), op by op."""
    for optimizer in OPTIMIZERS:
        for kind in KINDS:
            sizes = _many(M, 64)
            meta = count("meta", sizes, optimizer, kind, comm_dtype=comm_dtype)
            cpu = count("cpu", sizes, optimizer, kind, comm_dtype=comm_dtype)
            assert meta.ops == cpu.ops, (optimizer, kind, meta.report(), cpu.report())


def test_the_cpu_policy_walks_small_windows():
    """The contrast, and why the accelerator policy exists: at 100M elements the CPU's windows (2M
    elements at most) are 50, the accelerator's 2; the ops follow."""
    cpu = count("meta", [100 * M], "adamw", RoundKind.ESTIMATE, policy_device="cpu")
    accelerator = count("meta", [100 * M], "adamw", RoundKind.ESTIMATE)
    print(f"100M: {cpu.kernels} ops with the CPU policy, {accelerator.kernels} with the accelerator's")
    assert cpu.kernels > 10 * accelerator.kernels


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_look_ahead_estimate_dispatches_the_papers_ops(optimizer):
    """The estimate's learning rate × c (acco.estimate.lr_scale) is a scalar of the same step: an
    estimate round with lr_scale 2 dispatches exactly the paper's ops, op by op, so the look-ahead
    costs no kernel and no byte (issue: a default variant must not lengthen the step)."""
    def estimate_ops(lr_scale):
        ctx, so = _setup("meta", _many(M, 64), optimizer, groups=2)
        g = ctx.groups[0]
        grads = [rounds.shard_mean(g.shard_views(g.reduce_view(RoundKind.ESTIMATE)), 8.0)]
        param_grads = [pg for gs in grads for pg in g.param_grads(gs)]
        with OpCounter() as counter:
            so.estimate_into(param_grads, g.shard_views(g.gather_view()), lr_scale=lr_scale)
        return counter
    paper, look_ahead = estimate_ops(1.0), estimate_ops(2.0)
    assert paper.kernels > 0
    assert look_ahead.ops == paper.ops, f"paper: {paper.report()}\nlr_scale 2: {look_ahead.report()}"
