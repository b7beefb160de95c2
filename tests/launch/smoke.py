"""Launcher smoke run of ds_acco: a few ACCO optimizer steps on a tiny MLP.

Works unchanged under

    deepspeed --num_gpus 2 tests/launch/smoke.py --mode acco
    torchrun --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 tests/launch/smoke.py --mode acco
    MASTER_ADDR=127.0.0.1 mpirun -np 2 python tests/launch/smoke.py --mode acco

and with plain environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT set by hand, one process per rank). Set DS_ACCELERATOR=cpu on CPU-only hosts.

Rank 0 prints, as its last line, ``SMOKE_RESULT {json}`` with the world size, the loss
of every micro-batch and a checksum of the committed weights. The run depends only on
the world size, the mode and the step counts, so every launcher gives identical numbers.
Any failed check raises, so the process (and the launcher) exits non-zero.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

IN, HIDDEN, OUT, MICRO = 8, 16, 4, 4
RESULT_TAG = "SMOKE_RESULT"

# Variables MPI launchers set in every rank (MPICH/Intel MPI hydra, Open MPI, PMIx, Slurm's PMI).
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")
_TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("acco", "dpu"), default="acco")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--gas", type=int, default=4, help="gradient_accumulation_steps (even for mode acco)")
    # The deepspeed launcher appends --local_rank=N; torchrun and mpirun pass nothing. LOCAL_RANK
    # in the environment is what counts, so the value is accepted and ignored.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


_rendezvous_store = None  # under mpirun without MASTER_PORT: rank 0's store, kept alive for the run


def adopt_mpi_env() -> None:
    """Under mpirun, map the MPI ranks onto the torch.distributed variables.

    Without RANK & co. DeepSpeed runs its own mpi4py discovery, which overwrites MASTER_ADDR
    with the first address of ``hostname -I`` (not loopback) and MASTER_PORT with 29500.
    Setting the variables here keeps the rendezvous on MASTER_ADDR (default 127.0.0.1) while ranks
    still come from MPI. With no MASTER_PORT given, rank 0 binds the rendezvous store itself on
    port 0 and broadcasts its port; every rank then joins it as a client (torch's
    ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun), so no port is picked before it is bound.
    """
    global _rendezvous_store
    if all(v in os.environ for v in _TORCH_ENV) or not any(v in os.environ for v in _MPI_ENV):
        return
    from mpi4py import MPI  # initializes MPI; mpi4py finalizes it at exit

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = local.Get_rank()
    local.Free()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if not port:
        if rank == 0:
            from torch.distributed import TCPStore
            _rendezvous_store = TCPStore(os.environ["MASTER_ADDR"], 0, size, is_master=True, wait_for_workers=False)
        port = comm.bcast(_rendezvous_store.port if rank == 0 else None, root=0)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank), MASTER_PORT=str(port))


class SmokeNet(torch.nn.Module):
    """Two-layer MLP whose forward returns its MSE loss; same initial weights on every rank."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def micro_batch(rank: int, i: int):
    """Micro-batch ``i`` of ``rank``: deterministic, different for every rank and index."""
    g = torch.Generator().manual_seed(10_000 + 1000 * rank + i)
    x = torch.randn(MICRO, IN, generator=g)
    w = torch.linspace(-1.0, 1.0, IN * OUT).reshape(IN, OUT)
    y = torch.sin(x @ w) + 0.1 * torch.randn(MICRO, OUT, generator=g)
    return x, y


def weights_checksum(module: torch.nn.Module) -> dict:
    """sha256 over the exact bytes of every parameter (in name order) plus a readable sum."""
    h = hashlib.sha256()
    total = 0.0
    for name, p in sorted(module.named_parameters()):
        t = p.detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
        total += float(t.double().sum())
    return {"sha256": h.hexdigest(), "sum": total}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "acco" and (args.gas < 2 or args.gas % 2):
        raise SystemExit(f"--gas {args.gas}: mode 'acco' needs an even gradient_accumulation_steps >= 2")
    torch.set_num_threads(1)  # same arithmetic under every launcher (they set different thread counts)
    torch.manual_seed(0)
    adopt_mpi_env()

    import torch.distributed as dist

    import ds_acco

    model = SmokeNet(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": args.gas,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "acco": {"enabled": True, "mode": args.mode},
    }
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=optimizer, config=config)
    name = type(engine.optimizer).__name__
    if name != "AccoZeroOptimizer":
        raise RuntimeError(f"engine.optimizer is {name}, expected AccoZeroOptimizer: ACCO did not engage")

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for i in range(args.steps * args.gas):
        x, y = micro_batch(rank, i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with ds_acco.committed_weights(engine):  # collective: every rank enters
        checksum = weights_checksum(engine.module)
        global_steps = int(engine.global_steps)

    gathered = [None] * world
    dist.all_gather_object(gathered, {"checksum": checksum, "losses": losses})
    if any(g["checksum"] != checksum for g in gathered):
        raise RuntimeError(f"committed weights differ between ranks: {[g['checksum'] for g in gathered]}")
    if global_steps != args.steps:
        raise RuntimeError(f"engine.global_steps = {global_steps} after {args.steps} optimizer steps")
    if not all(map(lambda v: v == v and abs(v) != float("inf"), (l for g in gathered for l in g["losses"]))):
        raise RuntimeError(f"non-finite loss: {gathered}")
    engine.destroy()

    if rank == 0:
        result = {
            "world_size": world,
            "mode": args.mode,
            "optimizer": name,
            "steps": args.steps,
            "gas": args.gas,
            "global_steps": global_steps,
            "losses": losses,  # rank 0, one per micro-batch (engine.step call)
            "losses_by_rank": [g["losses"] for g in gathered],
            "checksum": checksum,
        }
        sys.stdout.write(f"{RESULT_TAG} {json.dumps(result, sort_keys=True)}\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
