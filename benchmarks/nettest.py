"""One rank of ``python -m benchmarks cluster-test``: checks one node of the emulated cluster.

Prints one JSON line: the rank's interface address, whether its namespace has a default route
(it must not), the time of a ``--mbytes`` all-reduce over gloo and the bandwidth it implies.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mbytes", type=float, default=8.0, help="all-reduce size in MB (fp32)")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    routes = subprocess.run(["ip", "route", "show", "default"], capture_output=True, text=True).stdout.strip()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(int(args.mbytes * 1e6 / 4))
    dist.all_reduce(x)  # connection set-up
    ok = bool(torch.all(x == world))
    times = []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    best = min(times)
    wire = 2 * (world - 1) / world * x.numel() * 4  # bytes each rank sends in a ring all-reduce
    print(json.dumps({"rank": rank, "world": world, "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                      "master": os.environ.get("MASTER_ADDR"), "default_route": routes or None,
                      "all_reduce_ok": ok, "all_reduce_s": best, "gbit_per_s": wire * 8 / best / 1e9}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
