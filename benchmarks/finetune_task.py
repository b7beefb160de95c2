"""The fine-tuning task: which topic a standard-library docstring passage is from, its word vocabulary,
the fixed held-out split and the dataset the Trainer reads."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Sequence, Tuple

from .finetune_args import FinetuneArguments


# Topic -> standard-library modules whose docstrings make up its passages. Every module of
# benchmarks.data.STDLIB_MODULES belongs to exactly one topic; never reorder (the data would change).
TOPICS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("concurrency", ("asyncio", "queue", "sched", "threading")),
    ("text", ("argparse", "csv", "difflib", "html", "json", "re", "shlex", "string", "textwrap", "tokenize")),
    ("numbers", ("bisect", "calendar", "datetime", "fractions", "heapq", "itertools", "math", "operator",
                 "random", "statistics", "timeit")),
    ("files", ("base64", "glob", "gzip", "hmac", "io", "ipaddress", "pathlib", "pickle", "shutil", "struct",
               "tarfile", "tempfile", "uuid", "zipfile")),
    ("language", ("abc", "ast", "collections", "contextlib", "copy", "dataclasses", "enum", "functools",
                  "inspect", "types", "typing", "weakref")),
    ("diagnostics", ("logging", "pprint", "traceback", "unittest", "warnings")),
)
# Special tokens, then the words by frequency.
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
FIRST_WORD_ID = 5
DATA_SPLIT_SEED = 0  # the held-out split and the per-topic sample: the same for every run and seed


# -- the task ---------------------------------------------------------------------------------------
WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def module_text(module: str) -> str:
    """The embedded corpus of one module (``benchmarks.data.embedded_corpus``) without the lines that
    name the documented objects (``asyncio.Queue.get``): they would give the label away."""
    from benchmarks.data import embedded_corpus

    header = re.compile(rf"^{re.escape(module)}(\.\w+)*$", re.MULTILINE)
    return header.sub("", embedded_corpus((module,)))


def words(text: str) -> List[str]:
    """Lower-cased words, numbers and single punctuation marks: a word-level stand-in for BERT's
    WordPiece that needs no trained tokenizer."""
    return WORD.findall(text.lower())


def topic_passages(passage_words: int) -> List[List[Tuple[str, ...]]]:
    """Per topic (in :data:`TOPICS` order), every whole window of ``passage_words`` words of its
    modules' text, in module order; a passage seen before (tables' ruler lines, repeated
    docstrings) is left out, so that no held-out passage is also a training one."""
    out, seen = [], set()
    for _, modules in TOPICS:
        passages = []
        for module in modules:
            w = words(module_text(module))
            for i in range(0, len(w) - passage_words + 1, passage_words):
                passage = tuple(w[i:i + passage_words])
                if passage not in seen:
                    seen.add(passage)
                    passages.append(passage)
        out.append(passages)
    return out


def build_vocab(passages: Iterable[Sequence[str]], size: int) -> Dict[str, int]:
    """Word -> id for the ``size - FIRST_WORD_ID`` most frequent words (ties by the word itself);
    ids below :data:`FIRST_WORD_ID` are the special tokens."""
    from collections import Counter

    counts = Counter(w for p in passages for w in p)
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[:size - FIRST_WORD_ID]
    return {w: FIRST_WORD_ID + i for i, w in enumerate(ranked)}


def build_task(args: FinetuneArguments):
    """``(train_ids, train_labels, heldout_ids, heldout_labels)``: rows ``[CLS] passage [SEP]`` as int64.

    Each topic keeps a seeded sample of ``passages_per_topic`` passages, of which
    ``heldout_per_topic`` are held out; the vocabulary comes from the training passages only (other
    words are [UNK]). The split does not depend on the run's seed.
    """
    import torch

    gen = torch.Generator().manual_seed(DATA_SPLIT_SEED)
    split = {"train": [], "heldout": []}
    for label, passages in enumerate(topic_passages(args.passage_words)):
        if len(passages) < args.passages_per_topic or args.passages_per_topic <= args.heldout_per_topic:
            raise ValueError(f"topic {TOPICS[label][0]!r} has {len(passages)} passages of {args.passage_words} "
                             f"words: --passages_per_topic {args.passages_per_topic} must be at most that and above "
                             f"--heldout_per_topic {args.heldout_per_topic}")
        order = torch.randperm(len(passages), generator=gen)[:args.passages_per_topic].tolist()
        split["heldout"] += [(passages[i], label) for i in sorted(order[:args.heldout_per_topic])]
        split["train"] += [(passages[i], label) for i in sorted(order[args.heldout_per_topic:])]
    vocab = build_vocab((p for p, _ in split["train"]), args.vocab_size)
    out = []
    for name in ("train", "heldout"):
        out.append(torch.tensor([[CLS_ID, *(vocab.get(w, UNK_ID) for w in p), SEP_ID] for p, _ in split[name]]))
        out.append(torch.tensor([label for _, label in split[name]]))
    return tuple(out)


class TopicDataset:
    """``{"input_ids", "labels"}`` items for the Trainer; remembers which indices this process read,
    so that runs can be checked to have seen the same data in the same order."""

    def __init__(self, ids, labels):
        self.ids, self.labels, self.read = ids, labels, []

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        self.read.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
