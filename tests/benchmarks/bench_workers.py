"""The A/B runner's per-rank training loop (benchmarks/worker.py ``run_variant``), run inside
spawned ranks on an emulated accelerator (tests/benchmarks/test_bench.py)."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def variant_records(variants, spec):
    """``run_variant`` for each variant in turn on this rank: its raw records."""
    import deepspeed
    from ds_acco import configs
    from benchmarks import worker

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(configs.resolve("acco.json")) as f:
        base_cfg = json.load(f)
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (512, spec["seq_len"] + 1), generator=g)
    heldout = torch.randint(0, 256, (32, spec["seq_len"] + 1), generator=g)
    return [worker.run_variant(v, spec, base_cfg, train, heldout, rank, world, say=lambda msg: None)
            for v in variants]


def probe_collective_sizes(spec, stub_timing=False):
    """``probe.probe`` on this rank with torch.distributed's collectives recorded: the probe's
    result and the largest tensor any collective was handed (elements). ``stub_timing``: every
    timed call runs once and reports 1 s per repetition, and the overlapped measurement reports
    (0.5 s, 2 s) without running, so the test can check how the probe scales what it timed."""
    import deepspeed
    from benchmarks import probe
    from benchmarks.data import micro_batches

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    largest = [0]

    def recording(fn):
        def call(*tensors, **kw):
            largest[0] = max([largest[0]] + [t.numel() for t in tensors if isinstance(t, torch.Tensor)])
            return fn(*tensors, **kw)
        return call

    for name in ("all_reduce", "all_gather_into_tensor"):
        setattr(dist, name, recording(getattr(dist, name)))
    if stub_timing:
        def timed(fn, reps):
            fn()
            return [1.0] * reps
        probe._timed = timed
        probe.overlapped = lambda micro, one_round, rounds: (0.5, 2.0)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (64, spec["seq_len"] + 1), generator=g)
    result = probe.probe(spec, micro_batches(rows, spec["micro_batch"], rank, world), rank, world)
    return result, largest[0]


def fidelity_runs(variants, spec, base_cfg):
    """``run_variant`` on the embedded corpus (what benchmarks.multirun reads), each variant with
    ``base_cfg`` (its acco.estimate applies to ACCO's variants): this rank's raw records."""
    import deepspeed
    from benchmarks import worker
    from benchmarks.data import build_splits

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, heldout = build_splits("embedded", seq_len=spec["seq_len"], holdout=0.02, seed=0)
    return [worker.run_variant(v, spec, base_cfg, train, heldout, rank, world, say=lambda msg: None)
            for v in variants]


def overlap_records(variants, spec):
    """``run_variant`` per variant on the random rows of :func:`variant_records`, with what DeepSpeed's
    ZeRO-1 optimizer was built with (overlap_comm, contiguous_gradients, reduce_bucket_size) and how
    many bucket reduces it ran, and how many of them started from a gradient hook (inside backward)."""
    import traceback

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from benchmarks import trainers

    seen = {}
    build, reduce = trainers.DeepSpeedTrainer.__init__, DeepSpeedZeroOptimizer.reduce_ipg_grads

    def recording_build(self, model, cfg):
        build(self, model, cfg)
        opt = self.inner.optimizer
        seen.update(settings={k: getattr(opt, k) for k in ("overlap_comm", "contiguous_gradients",
                                                           "reduce_bucket_size")}, reduces=0, reduces_from_hooks=0)

    def counting_reduce(self, *args, **kwargs):
        seen["reduces"] += 1
        if any(f.name == "reduce_independent_p_g_buckets_and_remove_grads" for f in traceback.extract_stack()):
            seen["reduces_from_hooks"] += 1
        return reduce(self, *args, **kwargs)

    trainers.DeepSpeedTrainer.__init__, DeepSpeedZeroOptimizer.reduce_ipg_grads = recording_build, counting_reduce
    try:
        out = []
        for v in variants:
            record = variant_records([v], spec)[0]
            out.append(dict(seen, record={k: record[k] for k in ("committed", "mb_loss", "heldout")}))
        return out
    finally:
        trainers.DeepSpeedTrainer.__init__, DeepSpeedZeroOptimizer.reduce_ipg_grads = build, reduce
