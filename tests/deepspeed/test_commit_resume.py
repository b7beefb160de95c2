"""``ds_acco.on_commit`` across a checkpoint (each committed step once, resumed or not), and loads into
an engine whose parameters are lent after an export or a save (core/schedule/committed.py): real DeepSpeed
engines on 2 gloo ranks, ACCO and stock ZeRO-1 doing the same."""
import pytest
import torch

from dist import run_ranks
from timeouts import scaled
import commit_resume_workers

ACCO = {"optimizer": "adamw", "schedule": "inv", "clip": 0.5, "acco": {"enabled": True, "mode": "acco"}}
STOCK = dict(ACCO, acco=None)
TOTAL = 20
# gas 4 (phases of 2 micro-batches): after micro-batch 7 the commit of step 2 was just launched (in
# flight until the phase end after 9); after 15 step 4's. Both are stock step boundaries too.
SAVE_AT, RESAVE_AT = 7, 15


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())


def test_on_commit_resumes_exactly(tmp_path):
    """An EMA through ``on_commit``, checkpointed mid-run with the commit in flight (save_checkpoint
    announces it) and serialised after ``save_checkpoint``: the resumed run calls fn for exactly the
    steps the uninterrupted run does after that point, and the final EMA is the uninterrupted one,
    bit for bit; so is the saving run's own. Before the fix the resumed run announced step 2 again."""
    out = run_ranks(commit_resume_workers.ema_across_resume, case=ACCO, save_dir=str(tmp_path), save_at=SAVE_AT,
                    total=TOTAL, timeout=scaled(120))
    for r in out:
        assert r["kind_at_save"] == "RoundKind.COMMIT"
        plain_ema, plain_steps = r["plain"]
        assert plain_steps == [1, 2, 3, 4, 5]
        for run in ("saving", "resumed"):
            ema, steps = r[run]
            assert steps == plain_steps, (run, steps)
            assert _equal(ema, plain_ema), run
    assert _equal(out[0]["plain"][0], out[1]["plain"][0])


@pytest.mark.parametrize("case", [ACCO, STOCK], ids=["acco", "stock"])
def test_rollback_into_a_lent_engine(tmp_path, case):
    """Save after micro-batch 7, train on, save again after 15 (ACCO: the commit in flight, the
    parameters lent: they view B), then roll back to the first save in the same process and train
    on: the loaded weights are the saved ones and training continues exactly as an uninterrupted run
    (losses and final weights), as stock's does."""
    out = run_ranks(commit_resume_workers.rollback_while_lent, case=case, save_dir=str(tmp_path), save_at=SAVE_AT,
                    resave_at=RESAVE_AT, total=TOTAL, load_kwargs={}, timeout=scaled(120))
    for r in out:
        if case["acco"] is not None:
            assert r["kind_at_resave"] == "RoundKind.COMMIT" and r["swapped_at_load"]
        assert _equal(r["loaded"], r["saved"])
        assert r["losses"] == r["plain_losses"]
        assert _equal(r["final"], r["plain_final"])


@pytest.mark.parametrize("case", [ACCO, STOCK], ids=["acco", "stock"])
def test_weights_only_load_into_a_lent_engine(tmp_path, case):
    """The same rollback with ``load_optimizer_states=False`` (no ACCO state restored: a fresh phase
    at the loaded weights): the model holds the checkpoint's weights after the load, as stock's
    does. Without the settle before DeepSpeed's load, the module's weights went into B and the
    parameters then pointed back at the live weights: the committed θ of the second save."""
    out = run_ranks(commit_resume_workers.rollback_while_lent, case=case, save_dir=str(tmp_path), save_at=SAVE_AT,
                    resave_at=RESAVE_AT, total=TOTAL, load_kwargs={"load_optimizer_states": False},
                    timeout=scaled(120))
    for r in out:
        assert _equal(r["loaded"], r["saved"])
        assert all(loss == loss for loss in r["losses"])  # trains on
        assert not _equal(r["final"], r["loaded"])


def test_direct_optimizer_load_settles(tmp_path):
    """DeepSpeed's optimizer ``load_state_dict`` called directly (not through ``load_checkpoint``)
    on an engine lent by a save during a commit phase: the parameters view the flat live weights
    DeepSpeed's restore reads and writes, not B."""
    out = run_ranks(commit_resume_workers.direct_optimizer_load_while_lent, case=ACCO, save_dir=str(tmp_path),
                    save_at=SAVE_AT, total=TOTAL, timeout=scaled(120))
    for r in out:
        assert r["kind_at_save"] == "RoundKind.COMMIT" and r["swapped_before"]
        assert r["params_view_live"] and not r["swapped_after"]
