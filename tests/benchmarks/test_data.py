"""The embedded corpus, the byte tokenizer, the per-rank streams, and the real datasets loader on local files."""
import itertools
import json

import pytest
import torch

from benchmarks import data

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build


@pytest.mark.slow  # a fresh interpreter builds the corpus (~1.5 s)
def test_embedded_corpus_is_deterministic_and_sizeable():
    """The same text in a fresh interpreter as in this one, where pytest has replaced stdlib hooks
    (threading.excepthook): before, the corpus -- so every benchmark's data -- depended on what the
    process had imported (483,187 characters under pytest against 483,306 in a plain run)."""
    import hashlib
    import subprocess
    import sys
    a = data.embedded_corpus.__wrapped__()  # not the cache: computed here, now
    code = "import hashlib; from benchmarks.data import embedded_corpus; print(hashlib.md5(embedded_corpus().encode()).hexdigest())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert hashlib.md5(a.encode()).hexdigest() == fresh and len(a) > 100_000


def test_a_replaced_stdlib_hook_does_not_change_the_corpus(monkeypatch):
    import threading
    plain = data.embedded_corpus.__wrapped__()
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # as pytest's plugin does
    assert data.embedded_corpus.__wrapped__() == plain


def test_byte_tokenizer_round_trips():
    tok = data.ByteTokenizer()
    text = "ACCO — accumulate while you communicate ✓"
    ids = tok.encode(text)
    assert ids.dtype in (torch.long, torch.int64) and int(ids.max()) < 256
    assert tok.decode(ids) == text


def test_rank_streams_are_disjoint_and_repeatable():
    seqs = data.make_sequences(torch.arange(10_000), 15)  # every row distinct
    take = lambda r: torch.cat(list(itertools.islice(data.micro_batches(seqs, 4, r, 2, seed=3), 20)))  # noqa: E731
    r0, r1 = take(0), take(1)
    assert torch.equal(r0, take(0))
    rows0 = {tuple(row.tolist()) for row in r0}
    assert not rows0 & {tuple(row.tolist()) for row in r1}


def test_holdout_never_overlaps_training():
    seqs = data.make_sequences(torch.arange(20_000), 31)
    train, held = data.split_holdout(seqs, 0.05, seed=1)
    assert len(train) + len(held) == len(seqs)
    assert not {tuple(r.tolist()) for r in train} & {tuple(r.tolist()) for r in held}


def test_datasets_loader_reads_local_text_and_jsonl(tmp_path):
    pytest.importorskip("datasets", reason="the 'datasets' package is part of the test extras")
    (tmp_path / "a.txt").write_text("first document\nwith two lines")
    (tmp_path / "b.txt").write_text("second document")
    text = data.load_text_dataset(str(tmp_path))
    assert "first document\nwith two lines" in text and "second document" in text
    j = tmp_path / "rows.jsonl"
    j.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["alpha", "beta"])))
    assert data.load_text_dataset(str(j)) == "alpha\n\nbeta"
    with pytest.raises(ValueError, match="no column"):
        data.load_text_dataset(str(j), text_column="body")
