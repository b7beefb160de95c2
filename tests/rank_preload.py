"""What every rank of ``run_ranks`` imports, imported once in its fork server (tests/dist.py).

A spawned rank spends ~8 s of CPU importing torch, DeepSpeed's runtime (its ZeRO optimizer check
imports the Muon optimizer, which imports torch._dynamo and inductor), FSDP and ds_acco before
its first line of work; 2 ranks per test on 2 cores made that most of the suite's time. Ranks
forked from a server that imported them once start with all of it loaded.

Only imports: nothing here may start a Python thread, initialise torch.distributed, or run an
ATen op (an OpenMP pool started before fork does not survive in the child). numpy's OpenBLAS
starts its thread pool on import, as under every DataLoader that forks; OpenBLAS handles fork.
"""
import torch
import torch.distributed
import torch.distributed.fsdp
import torch._dynamo  # noqa: F401  (imported by DeepSpeed's optimizer check through Muon)

import deepspeed
import deepspeed.runtime.engine  # noqa: F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

import ds_acco  # noqa: F401
import ds_acco.deepspeed  # noqa: F401
