"""Engines that are never destroyed never affect later engines in the process: no collective from
finalisation or garbage collection, their lane and process group released without one."""
import pytest
import torch

from dist import run_ranks
from timeouts import scaled
import engine_loop_workers


def test_undestroyed_engines_never_hang_and_equal_a_fresh_one():
    out = run_ranks(engine_loop_workers.undestroyed_engines, timeout=scaled(40), engines=10, repeats=3)
    for rank_out in out:
        results = rank_out["results"]
        assert len(results) == 30
        fresh_weights, fresh_steps = results[0]
        assert fresh_steps == 1
        for i, (weights, steps) in enumerate(results):
            assert steps == fresh_steps, i
            for n in fresh_weights:
                assert torch.equal(weights[n], fresh_weights[n]), (i, n)
        assert rank_out["lanes_left"] == 0  # every unreferenced engine's lane thread ended
        assert rank_out["groups_left"] == 0  # and its process group was released
