"""Small, deterministic data pipeline for the examples (no network needed by default).

* :func:`embedded_corpus` -- English-like text built at run time from the docstrings of a fixed
  list of standard-library modules (about half a megabyte; the same text on every run of a given
  Python version).
* :func:`stdlib_source_corpus` -- the standard library's own ``.py`` source files (about 12 MB, on
  every machine; for sequences too long for the embedded corpus to give many, e.g. 512 bytes).
* :class:`ByteTokenizer` -- UTF-8 bytes as token ids 0..255.
* :func:`load_text_dataset` -- the embedded corpus, or a local text / JSON / CSV / parquet file or
  a Hugging Face hub dataset through the ``datasets`` library (imported only then).
* :func:`make_sequences`, :func:`split_holdout`, :func:`micro_batches`, :func:`heldout_batches` --
  fixed-length training sequences, a held-out split, and per-rank micro-batch streams that are
  disjoint across ranks and identical from run to run for a given seed.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Iterator, List, Optional, Tuple

import torch

EMBEDDED = "embedded"
STDLIB_SOURCE = "stdlib-source"
_SKIPPED_DIRS = ("__pycache__", "idle_test", "site-packages", "test", "tests")

# Pure-Python or platform-independent modules only, so the text does not depend on the OS
# (``os``, ``socket``, ``hashlib``... would). Sorted; never reorder it, or the corpus changes.
STDLIB_MODULES: Tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "enum", "fractions", "functools", "glob", "gzip", "heapq",
    "hmac", "html", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "operator",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "statistics",
    "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "uuid", "warnings", "weakref", "zipfile",
)


def _from_stdlib(obj) -> bool:
    """False for objects defined outside the standard library (other packages sometimes patch
    stdlib classes, e.g. transformers adds ``logging.Logger.warning_once``)."""
    module = getattr(obj, "__module__", None)
    return not isinstance(module, str) or module.partition(".")[0] in sys.stdlib_module_names


def _documentable(obj) -> bool:
    return (inspect.isclass(obj) or inspect.isroutine(obj)) and _from_stdlib(obj)


def _documented(module) -> List[Tuple[str, object]]:
    """``(qualified name, object)`` for a module, its public classes and functions, and the
    public methods of those classes, in sorted order."""
    name = module.__name__
    public = getattr(module, "__all__", None) or [a for a in dir(module) if not a.startswith("_")]
    out = [(name, module)]
    for attr in sorted(public):
        obj = getattr(module, attr, None)
        if not _documentable(obj):
            # replaced at run time (pytest sets threading.excepthook to a functools.partial): the
            # module's saved original (threading.__excepthook__), so the text does not depend on
            # what else the process imported
            obj = getattr(module, f"__{attr}__", obj)
        if not _documentable(obj):
            continue  # constants and submodules: their docs are repetitive or import-order dependent
        out.append((f"{name}.{attr}", obj))
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                member = getattr(obj, meth, None)
                if not meth.startswith("_") and inspect.isroutine(member) and _from_stdlib(member):
                    out.append((f"{name}.{attr}.{meth}", member))
    return out


@functools.lru_cache(maxsize=None)
def embedded_corpus(modules: Tuple[str, ...] = STDLIB_MODULES) -> str:
    """The default training text: each documented name followed by its docstring.

    Built from ``inspect.getdoc`` of ``modules`` and their public members; a docstring seen
    before (inherited or aliased) is skipped. Deterministic for a given Python version, whatever
    else has been imported.
    """
    seen, parts = set(), []
    for mod_name in modules:
        module = importlib.import_module(mod_name)
        for qualname, obj in _documented(module):
            doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(f"{qualname}\n\n{doc}\n")
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def stdlib_source_corpus() -> str:
    """Every ``.py`` file of the running Python's standard library (``sysconfig``'s ``stdlib``
    directory, walked in sorted order; test suites and site-packages left out), one document each.
    Deterministic for a given Python version and installation."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("lib-dynload"))
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(here, name), encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:
        raise FileNotFoundError(f"no standard-library source under {root!r} (a stripped installation?)")
    return "\n\n".join(parts)


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, no special tokens, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor."""
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        """Text of ``ids`` (a tensor or a sequence of ints); invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".csv": "csv", ".parquet": "parquet"}


def _local_files(path: str) -> Tuple[str, List[str]]:
    """The ``datasets`` builder and the sorted data files of a local file or directory."""
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                       if os.path.splitext(f)[1].lower() in _BUILDERS)
    builders = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if not files or None in builders:
        raise ValueError(f"don't know how to read {path!r}: expected files ending in {sorted(_BUILDERS)}")
    if len(builders) > 1:
        raise ValueError(f"{path!r} mixes file kinds {sorted(builders)}; point at one kind of file")
    return builders.pop(), files


def load_text_dataset(source: Optional[str] = None, *, split: str = "train", text_column: str = "text") -> str:
    """The training text of ``source``, as one string (documents separated by a blank line).

    ``source`` is one of:
      * ``None`` or ``"embedded"``: :func:`embedded_corpus` (no ``datasets``, no network);
      * ``"stdlib-source"``: :func:`stdlib_source_corpus` (no ``datasets``, no network);
      * a local file (``.txt``/``.md``, ``.json``/``.jsonl``, ``.csv``, ``.parquet``) or a directory
        of files of one of these kinds, read with ``datasets.load_dataset`` (a text file is one
        document);
      * a hub dataset name, optionally ``name:config`` (e.g. ``wikitext:wikitext-2-raw-v1``);
        this one downloads, so it is only ever used when asked for explicitly.
    ``text_column`` names the column holding the text (``"text"`` for plain-text files).
    """
    if source is None or source == EMBEDDED:
        return embedded_corpus()
    if source == STDLIB_SOURCE:
        return stdlib_source_corpus()
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"loading {source!r} needs the 'datasets' package (pip install datasets); "
                          "the default embedded corpus does not") from exc
    if os.path.exists(source):
        builder, files = _local_files(source)
        extra = {"sample_by": "document"} if builder == "text" else {}  # a file is a document, not a line
        ds = datasets.load_dataset(builder, data_files=files, split=split, **extra)
    else:
        name, _, config = source.partition(":")
        ds = datasets.load_dataset(name, config or None, split=split)
    if text_column not in ds.column_names:
        raise ValueError(f"{source!r} has no column {text_column!r}; columns: {ds.column_names}")
    return "\n\n".join(t for t in ds[text_column] if t)


def make_sequences(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D id stream into non-overlapping rows of ``seq_len + 1`` tokens (inputs are
    ``row[:-1]``, targets ``row[1:]``); the remainder at the end is dropped."""
    n = ids.numel() // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{ids.numel()} tokens are fewer than one sequence of {seq_len + 1}")
    return ids[:n * (seq_len + 1)].view(n, seq_len + 1)


def split_holdout(seqs: torch.Tensor, fraction: float = 0.02, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(train, heldout)``: a seeded random ``fraction`` of the rows (at least one) is held out.

    Rows never overlap, so no held-out token is ever trained on. Both keep corpus order.
    """
    n = seqs.shape[0]
    n_hold = max(1, int(round(n * fraction)))
    if n_hold >= n:
        raise ValueError(f"holding out {n_hold} of {n} sequences leaves nothing to train on")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    hold = perm[:n_hold].sort().values
    train = perm[n_hold:].sort().values
    return seqs[train], seqs[hold]


def micro_batches(seqs: torch.Tensor, micro_batch_size: int, rank: int = 0, world: int = 1,
                  seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless micro-batches ``[micro_batch_size, seq_len + 1]`` for ``rank`` of ``world``.

    Every epoch all ranks draw the same seeded permutation of the rows; rank ``r`` takes
    positions ``r, r + world, ...``, so the ranks' streams are disjoint within an epoch, and each
    rank gets the same whole number of micro-batches (a few leftover rows are skipped that epoch).
    """
    per_rank = seqs.shape[0] // world // micro_batch_size * micro_batch_size
    if per_rank == 0:
        raise ValueError(f"{seqs.shape[0]} sequences are too few for {world} ranks x {micro_batch_size}")
    gen = torch.Generator().manual_seed(seed)
    while True:
        mine = torch.randperm(seqs.shape[0], generator=gen)[rank::world][:per_rank]
        for start in range(0, per_rank, micro_batch_size):
            yield seqs[mine[start:start + micro_batch_size]]


def heldout_batches(seqs: torch.Tensor, batch_size: int, rank: int = 0, world: int = 1) -> List[torch.Tensor]:
    """This rank's share of the held-out rows (``rank::world``) in batches; the shares are disjoint
    and together cover every row, so summing per-rank results gives the full held-out loss."""
    mine = seqs[rank::world]
    return [mine[i:i + batch_size] for i in range(0, mine.shape[0], batch_size)]


def build_splits(source: Optional[str] = None, seq_len: int = 64, holdout: float = 0.02,
                 seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Load ``source``, byte-tokenize it and return ``(train, heldout)`` sequence tensors."""
    ids = ByteTokenizer().encode(load_text_dataset(source))
    return split_holdout(make_sequences(ids, seq_len), holdout, seed)


__all__ = ["EMBEDDED", "STDLIB_MODULES", "STDLIB_SOURCE", "stdlib_source_corpus", "ByteTokenizer", "build_splits", "embedded_corpus",
                          "heldout_batches", "load_text_dataset", "make_sequences", "micro_batches", "split_holdout"]
