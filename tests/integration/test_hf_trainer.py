"""HF ``Trainer`` with ``deepspeed=<acco config>`` on 2 CPU ranks, after ``ds_acco.install()``: the
engine is ACCO's, every micro-batch reaches ``engine.step()``, evaluation runs on committed
weights, and the training loss goes down. Runs ``examples/finetune_hf_trainer.py``'s ``main``
inside ranks spawned by ``tests/dist.py`` (tiny random-init GPT-2, byte tokens, no downloads)."""
from __future__ import annotations

import os

import pytest

from dist import run_ranks
from timeouts import scaled

pytest.importorskip("accelerate", reason="HF Trainer's DeepSpeed integration needs accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, GAS = 6, 4


def finetune(argv):
    import sys

    sys.path.insert(0, REPO)
    from examples.finetune_hf_trainer import main

    os.environ["OMP_NUM_THREADS"] = "1"  # Accelerate otherwise sets 2 threads per rank on 2 cores
    return main(argv)


def test_hf_trainer_trains_with_acco():
    argv = ["--deepspeed_config", os.path.join(REPO, "ds_configs", "acco.json"), "--max-steps", str(STEPS),
            "--gradient-accumulation-steps", str(GAS), "--per-device-batch-size", "4", "--train-sequences", "400"]
    results = run_ranks(finetune, world=2, timeout=scaled(80), argv=argv)
    for r in results:
        assert r["world_size"] == 2
        assert r["engine"] == "AccoEngine", r
        assert r["optimizer"] == "AccoZeroOptimizer", r
        assert r["gradient_accumulation_steps"] == GAS  # "auto", filled by HF from TrainingArguments
        assert r["hf_global_step"] == STEPS
        # Every micro-batch reached engine.step(), so ACCO committed one step per GAS micro-batches
        # (the last ones drained by the evaluation on committed weights).
        assert r["engine_global_steps"] == STEPS, r
    losses = results[0]["losses"]
    assert len(losses) == STEPS
    half = STEPS // 2
    assert sum(losses[half:]) / half < sum(losses[:half]) / half - 0.2, f"training loss did not decrease: {losses}"
    assert losses[-1] < losses[0] - 0.5, losses
    assert results[0]["eval_loss"] < losses[0] - 0.5, results[0]
    assert results[0]["eval_loss"] == results[1]["eval_loss"]  # gathered across ranks: one number
