"""gloo gather_in_place of a 4e6-element fp32 buffer over the emulated 1 Gbit/s links, 2 ranks:
time per call for each piece size (ds_acco.comm.collectives), medians of 7; plus one all-reduce."""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from ds_acco.comm import collectives
torch.set_num_threads(1)
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
flat = torch.zeros(4_000_000)
out = {}
for chunk in (1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 4_000_000, 1 << 16, 1 << 18):
    ts = []
    for _ in range(8):
        dist.barrier(); a = time.perf_counter()
        collectives.gather_in_place(flat, r, w, None, chunk)
        ts.append(time.perf_counter() - a)
    out.setdefault(f"gather chunk {chunk}", []).append(round(statistics.median(ts[1:]), 4))
ts = []
for _ in range(6):
    dist.barrier(); a = time.perf_counter(); dist.all_reduce(flat); ts.append(time.perf_counter() - a)
out["all_reduce"] = statistics.median(ts[1:])
if r == 0:
    print(json.dumps(out, indent=1))
dist.destroy_process_group()
