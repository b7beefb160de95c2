"""What the drift metric adds to a commit round, on one process and a flat shard (docs/bench/drift-cost).

Times the commit round's step on a shard of ``--elements`` fp32 parameters with torch AdamW (ACCO's
in-place functional commit, window by window), without and with the drift metric of a sampled
commit: θ_t kept (the copy ``rounds._keep_shards_for_drift`` makes into B) and
:func:`ds_acco.core.round.drift.drift_sums` after the step. The collectives are left out (a world-1 gloo
group sums the three scalars), so the difference is the metric's own compute and memory traffic::

    python -m benchmarks.drift_cost --elements 350000000 --repeats 3 --threads 1

Prints one JSON line: each variant's times (s), their medians and the chunk used. Memory: six fp32
shard-sized tensors (master, gradient, Adam's two moments, live weights, the kept θ_t): 8.4 GB at
350M elements.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from ds_acco.core.step import chunking
from ds_acco.core.round.drift import drift_sums
from ds_acco.core.step.shard_optimizer import ShardOptimizer


class _Shard:
    """What the drift metric reads of a buffer group: the master shard (θ_{t+1} after the step) and
    the live weights' shard (θ̃_{t+1})."""

    def __init__(self, master: torch.Tensor, live: torch.Tensor):
        self.master, self.live = master, live

    def shard_values(self):
        return [self.master.detach()]

    def live_shard_views(self):
        return [self.live]


def measure(elements: int, repeats: int) -> dict:
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(elements))
    grad = torch.randn(elements) * 1e-3
    live = master.detach() + 1e-4 * torch.randn(elements)  # an estimate near θ
    kept = torch.empty(elements)  # stands for another rank's segment of B
    chunk = chunking.chunk_elements("cpu", elements)
    opt = ShardOptimizer(torch.optim.AdamW([master], lr=1e-4, weight_decay=0.1), [master], chunk)
    group = _Shard(master, live)

    def commit():
        opt.commit([grad])

    def commit_with_metrics():
        torch._foreach_copy_([kept], [master.detach()])
        opt.commit([grad])
        drift_sums([group], [kept], chunk, None).tolist()

    commit()  # Adam's lazy state
    times = {"commit": [], "commit_with_metrics": []}
    for _ in range(repeats):
        for name, fn in (("commit", commit), ("commit_with_metrics", commit_with_metrics)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"elements": elements, "chunk": chunk, "threads": torch.get_num_threads(), "times_s": times,
            "median_s": medians, "metrics_over_commit": medians["commit_with_metrics"] / medians["commit"] - 1}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=350_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine may be shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            print(json.dumps(measure(args.elements, args.repeats)))
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
