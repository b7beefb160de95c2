"""Emulation for the A/B runner: accelerator compute that costs wall time but no CPU, and slow ranks.

On a CPU-only host a round's CPU work (gloo's copies and reductions, the shard optimizer step)
competes with the compute it overlaps, so CPU benchmarks cannot show what ACCO does on GPUs,
where forward and backward run on the accelerator and the host CPU is free for the
communication thread. This module stands in for the accelerator:

* each training micro-batch's forward + backward costs ``compute_s`` seconds of wall time spent
  waiting (``time.sleep`` releases the GIL and uses no CPU): the accelerator's time, calibrated
  from a real GPU or the paper's settings;
* the gradients are real and full-size: a small real GPT gives the loss, and a "bulk" parameter
  brings the model to ``params`` elements. Its gradient is exactly zero (AdamW then leaves it at
  zero), so the loss and its curve are those of the small GPT, but it fills G, travels in every
  round and is stepped by the optimizer like any parameter: real buffers, real rounds, over the
  real (emulated) network.

Results measured this way are emulation and are labelled so wherever they are reported
(``summary['emulation']``, the Markdown table's header). The loss of an emulated run is the
small GPT's real training loss under each schedule (the bulk's gradient is exactly zero, so it
changes neither the update nor the clipping norm): its held-out curve against the emulated time
gives a time to target for that small model (``scripts/time_to_target_emulated.sh``). It says
nothing about how a large model's loss responds to the same schedule: that is what the real
fidelity runs at equal tokens are for.
"""
from __future__ import annotations

import math
import random
import time
from typing import Optional, Sequence, Union

import torch

from benchmarks.gpt import CausalLM


class EmulatedLM(CausalLM):
    """A :class:`~benchmarks.gpt.CausalLM` of ``params`` parameters whose training forward +
    backward take ``compute_s`` seconds of wall time, nearly all of it a wait.

    A third of the wait ends the forward and two thirds start the backward (the usual 1 : 2
    split). The backward's part comes before the gradients are produced, not spread among them:
    ZeRO-1 (stock and ACCO) sends nothing until the micro-batch's backward has finished, so
    where inside the backward the time falls does not change a step.
    Evaluation (``eval()`` or no grad) does not wait.
    """

    def __init__(self, seq_len: int, params: int, compute_s: float, n_embd: int = 64, n_layer: int = 1,
                 n_head: int = 2):
        super().__init__(seq_len, n_embd, n_layer, n_head)
        core = sum(p.numel() for p in self.lm.parameters())
        if params < core:
            raise ValueError(f"emulate_params = {params}: below the {core} parameters of the small GPT that gives the "
                             f"loss; fix: at least {core}")
        if not compute_s >= 0:
            raise ValueError(f"emulate_compute_s = {compute_s!r}: must be >= 0 seconds per micro-batch")
        self.compute_s = float(compute_s)
        self.bulk = torch.nn.Parameter(torch.zeros(params - core))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        loss = super().forward(rows)
        if not (self.training and torch.is_grad_enabled()):
            return loss
        _wait(self.compute_s / 3)  # the forward; the backward takes twice as long
        # d(loss)/d(bulk) = 0 exactly: one elementwise pass to materialise it (cheap on CPU).
        loss = loss + self.bulk.sum() * 0.0
        loss.register_hook(_waiting_hook(2 * self.compute_s / 3))
        return loss


def _wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def _waiting_hook(seconds: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        _wait(seconds)
        return grad
    return hook


def compute_for_rank(compute_s: Union[float, Sequence[float]], rank: int) -> float:
    """One value for every rank, or one per rank (heterogeneous accelerators)."""
    if isinstance(compute_s, (int, float)):
        return float(compute_s)
    values = list(compute_s)
    if rank >= len(values):
        raise ValueError(f"emulate_compute_s has {len(values)} values for rank {rank}; fix: one per rank, or one "
                         "for all")
    return float(values[rank])


def describe(params: Optional[int], compute_s) -> str:
    per = (f"{compute_s:g} s" if isinstance(compute_s, (int, float))
           else "/".join(f"{c:g}" for c in compute_s) + " s (per rank)")
    return (f"EMULATION: accelerator stand-in, {per} of waiting per training micro-batch (forward + backward, no "
            f"CPU), real gradients and rounds of a {params / 1e6:.1f}M-parameter model over the network shown")


# -- heterogeneous ranks -----------------------------------------------------------------------------
def slow_down(factor: float, elapsed: float) -> None:
    """Heterogeneous runs: stretch this rank's micro-batch to ``factor`` x its compute time
    (sleeping, so the slow rank does not also steal CPU from the fast ones)."""
    if factor > 1.0:
        time.sleep((factor - 1.0) * elapsed)


class Slowdown:
    """The slow rank's factor for each micro-batch (EMULATION of heterogeneous hardware): the spec's
    ``slow_factor``; times a lognormal jitter of ``slow_jitter`` = σ per micro-batch (mean 1, seeded
    per rank, the same sequence in every variant: a straggler whose speed varies); times
    ``transient['factor']`` while the committed steps are in ``[start, start + fraction)`` of the
    run (a throttled GPU or a noisy neighbour for part of the run). Other ranks: 1."""

    def __init__(self, spec: dict, rank: int):
        self.slow = rank == spec.get("slow_rank", -1)
        self.factor = float(spec.get("slow_factor", 1.0))
        self.sigma = float(spec.get("slow_jitter", 0.0) or 0.0)
        t = spec.get("transient") or {}
        steps = spec["steps"]
        first = round(t.get("start", 0.4) * steps)
        self.window = (first, first + max(1, round(t.get("fraction", 0.2) * steps)))  # committed steps
        self.transient = float(t.get("factor", 1.0))
        self.rng = random.Random(spec.get("seed", 0) * 7919 + rank)

    def __call__(self, step: int) -> float:
        if not self.slow:
            return 1.0
        f = self.factor
        if self.sigma > 0:
            f *= math.exp(self.rng.gauss(-self.sigma ** 2 / 2, self.sigma))
        if self.transient != 1.0 and self.window[0] <= step < self.window[1]:
            f *= self.transient
        return f
