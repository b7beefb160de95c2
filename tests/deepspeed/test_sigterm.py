"""SIGTERM on one rank: every rank stops at the same round, drains, saves a checkpoint, exits 143;
the checkpoint resumes exactly."""
import torch

from dist import run_ranks
from timeouts import scaled
import lifecycle_workers

TOTAL = 40


def test_sigterm_stops_all_ranks_with_an_exact_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    case = {"optimizer": "adamw", "schedule": "inv", "gas": 4,
            "acco": {"enabled": True, "mode": "acco", "sigterm": "checkpoint", "sigterm_checkpoint_dir": ckpt}}
    out = run_ranks(lifecycle_workers.sigterm_run, case=case, signal_rank=1, signal_at=9, total=TOTAL, timeout=scaled(80))
    assert all(r["stopped"] and r["code"] == 143 for r in out), out
    assert out[0]["done"] == out[1]["done"] < TOTAL - 1  # fixed mode: the same micro-batch on both ranks
    assert out[0]["global_steps"] == out[1]["global_steps"]
    stopped_after = out[0]["done"]  # SystemExit left engine.step() of that micro-batch: it is in the checkpoint
    tag = open(tmp_path / "ckpt" / "latest").read()
    # Resume from it in new processes and compare with an uninterrupted run.
    plain_case = dict(case, acco={"enabled": True, "mode": "acco"})
    full = run_ranks(lifecycle_workers.checkpoint_save_run, case=plain_case, save_dir=str(tmp_path / "unused"), save_at=(),
                     total=TOTAL)
    import os
    os.rename(tmp_path / "ckpt" / tag, tmp_path / "ckpt" / f"mb{stopped_after}")
    resumed = run_ranks(lifecycle_workers.checkpoint_resume_runs, case=plain_case, save_dir=ckpt, save_at=(stopped_after,),
                        total=TOTAL)
    for rank in (0, 1):
        got = resumed[rank][stopped_after]
        assert got["losses"] == full[rank]["losses"][stopped_after + 1:]
        assert all(torch.equal(got["final"][n], t) for n, t in full[rank]["final"].items())


def test_fsdp_sigterm_stops_all_ranks_and_chains_the_previous_handler():
    import sigterm_workers
    case = {"optimizer": "adamw", "gas": 4, "acco": {"enabled": True, "mode": "acco", "sigterm": "stop"}}
    out = run_ranks(sigterm_workers.fsdp_sigterm_run, case=case, signal_rank=1, signal_at=9, total=TOTAL, timeout=scaled(80))
    assert all(r["stopped"] and r["code"] == 143 for r in out), out
    assert out[0]["done"] == out[1]["done"] < TOTAL - 1
    assert out[0]["global_steps"] == out[1]["global_steps"]
    assert out[1]["prior_called"] == [15] and out[0]["prior_called"] == []  # chained, on the signalled rank
    assert all(r["restored"] for r in out)  # close() gives SIGTERM back to the handler before ours
