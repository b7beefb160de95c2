"""The collectives' memory on gloo, measured where the dispatch-mode counter cannot see: gloo
allocates its own scratch inside the collective (on its worker threads, below Python)."""
from dist import run_ranks


def _gather_peak(numel: int, chunk_elems: int):
    import torch
    import torch.distributed as dist
    from ds_acco.comm import collectives

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = torch.zeros(numel)
    part = numel // world
    flat.narrow(0, rank * part, part).fill_(rank + 1)
    collectives.gather_in_place(flat, rank, world, None, chunk_elems)  # warm: one-off buffers
    flat.zero_()
    flat.narrow(0, rank * part, part).fill_(rank + 1)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark
    before = status("VmRSS")
    collectives.gather_in_place(flat, rank, world, None, chunk_elems)
    peak = status("VmHWM") - before
    expect = torch.arange(1, world + 1, dtype=flat.dtype).repeat_interleave(part)
    exact = bool(torch.equal(flat, expect))
    # a segment that is no multiple of the pieces (a short last piece), and one shorter than a piece
    for seg in (3 * (chunk_elems // world) + 5, 7):
        small = torch.zeros(world * seg)
        small.narrow(0, rank * seg, seg).copy_(torch.arange(seg) + 100 * rank)
        collectives.gather_in_place(small, rank, world, None, chunk_elems)
        exact &= bool(torch.equal(small, torch.cat([torch.arange(seg) + 100 * r for r in range(world)]).float()))
    return {"peak": peak, "exact": exact}


def test_gloo_gather_in_place_has_no_full_size_scratch():
    numel = 16 << 20  # 64 MiB of fp32: a full-size scratch could not hide under the bound below
    chunk = 1 << 18  # 1 MiB
    for out in run_ranks(_gather_peak, numel=numel, chunk_elems=chunk):
        assert out["exact"]
        assert out["peak"] < 8 * (chunk * 4) + (4 << 20), f"peak RSS rose by {out['peak'] >> 20} MiB during the gather"
