"""The short fine-tune fidelity case (issue 34): a tiny BERT topic classifier under the real HF Trainer.

One run is one fine-tune, stock ZeRO-1 or ACCO, chosen only by the DeepSpeed config given to the
Trainer (its ``"acco"`` block). The script itself is an ordinary HF example script: it never imports
ACCO's engine; ACCO is switched on from outside by ``python -m ds_acco run``::

    python -m benchmarks.finetune config --acco '{"enabled": true}' --out acco.json
    torchrun --nproc_per_node 2 -m ds_acco run -m benchmarks.finetune train \\
        --deepspeed acco.json --seed 0 --variant acco --pretrained_dir runs/pretrained --record acco-s0.json
    python -m benchmarks.finetune summarize runs/records/*.json --baseline stock

The task (a stand-in for an AG-News-style topic classifier): passages of ``passage_bytes`` bytes from
the docstrings of the standard-library modules that :mod:`benchmarks.data` embeds, each labelled with
the topic of its module (:data:`TOPICS`: concurrency, text, numbers, files, language, diagnostics),
the header line naming the documented object removed. The same number of passages per topic, a fixed
held-out split. Nothing is downloaded.

The model: a byte-level BERT (``transformers`` ``BertConfig``) first pretrained by masked-language
modelling on the training passages (no labels) for ``pretrain_steps`` from ``pretrain_seed`` -- the
same checkpoint for every run -- saved with ``save_pretrained`` and loaded with
``BertForSequenceClassification.from_pretrained``, which initialises the pooler and the classifier
from the run's ``--seed``, as a user's fine-tune of a hub checkpoint does.

The fine-tune: HF ``Trainer`` with ``--deepspeed CONFIG`` (ZeRO-1, DeepSpeed's AdamW whose settings
the Trainer fills from its arguments, no scheduler block so the Trainer's default linear decay with
no warm-up applies), 2 ranks, ``gradient_accumulation_steps`` 4. Everything else is HF's default
except what :data:`TRAIN_DEFAULTS` sets; any Trainer argument can be overridden on the command line.
At the end rank 0 evaluates the held-out loss and accuracy on the committed weights
(``ds_acco.committed_weights``; a no-op for stock), checks them against ``Trainer.evaluate()``, and
writes one JSON record (``--record``; also printed as ``FINETUNE_RECORD {...}``).

``summarize`` pairs the records by seed (same pretrained checkpoint, initial weights, data and data
order, which it checks) and gives each variant's held-out loss gap against the baseline per seed,
with its median and range.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

RECORD_TAG = "FINETUNE_RECORD"
RECORD_VERSION = 1

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

# The bench's Trainer arguments; the command line overrides any of them (argparse: last one wins).
TRAIN_DEFAULTS: Tuple[str, ...] = (
    "--max_steps", "60", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "64",
    "--gradient_accumulation_steps", "4", "--learning_rate", "1e-3", "--weight_decay", "0.01",
    "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "10", "--save_strategy", "no",
    "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--use_cpu", "true",
    "--seed", "0",
)


@dataclasses.dataclass
class FinetuneArguments:
    """The task, the model and its pretraining (the Trainer's own arguments come separately)."""

    variant: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "name of this run's variant in the table (default: 'stock' without an enabled acco block, else 'acco')"})
    record: Optional[str] = dataclasses.field(default=None, metadata={"help": "write the JSON record here (rank 0)"})
    pretrained_dir: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "pretrained checkpoint: loaded if present (its settings must match), else pretrained and saved "
                "here; default: OUTPUT_DIR/pretrained"})
    passage_words: int = dataclasses.field(default=20, metadata={"help": "words per passage (+ CLS and SEP)"})
    vocab_size: int = dataclasses.field(default=2000, metadata={"help": "words kept (by frequency) + 5 special"})
    passages_per_topic: int = dataclasses.field(default=512, metadata={"help": "passages kept per topic"})
    heldout_per_topic: int = dataclasses.field(default=96, metadata={
        "help": "of those, held out per topic (96 leaves 6 x 416 = 2496 = 39 x 64 training passages: whole "
                "optimizer steps per epoch at 2 ranks x 8 x gas 4)"})
    allow_partial_steps: bool = dataclasses.field(default=False, metadata={
        "help": "run even when an epoch does not end on a whole optimizer step (the Trainer then takes a short "
                "step at each epoch's end, which ACCO does not follow: see the module docstring)"})
    loss_kwargs: str = dataclasses.field(default="auto", metadata={
        "choices": ["auto", "off"],
        "help": "'auto': the Trainer decides whether the model normalises its loss by num_items_in_batch (for "
                "BertForSequenceClassification transformers 5.x wrongly decides yes: logged and optimised losses "
                "are x world size, training ones also x gradient_accumulation_steps); 'off': "
                "trainer.model_accepts_loss_kwargs = False, HF's documented override (true mean loss)"})
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 512
    pretrain_steps: int = dataclasses.field(default=1500, metadata={"help": "MLM steps before the fine-tune"})
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-3
    pretrain_seed: int = 0


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


# -- the model and its pretraining ------------------------------------------------------------------
def bert_config(args: FinetuneArguments):
    """The byte-level BERT's ``BertConfig`` (dropout as BERT's default, 0.1)."""
    from transformers import BertConfig

    return BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, intermediate_size=args.intermediate_size,
                      max_position_embeddings=args.passage_words + 2, pad_token_id=PAD_ID,
                      num_labels=len(TOPICS), id2label={i: name for i, (name, _) in enumerate(TOPICS)},
                      label2id={name: i for i, (name, _) in enumerate(TOPICS)})


def mask_for_mlm(ids, gen, vocab_size: int, probability: float = 0.15):
    """BERT's masking: ``probability`` of the text positions become targets; of those 80% are
    replaced by [MASK], 10% by a random word, 10% kept. Returns ``(inputs, labels)``."""
    import torch

    text = (ids == UNK_ID) | (ids >= FIRST_WORD_ID)
    target = (torch.rand(ids.shape, generator=gen) < probability) & text
    labels = torch.where(target, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=gen)
    inputs = torch.where(target & (roll < 0.8), torch.full_like(ids, MASK_ID), ids)
    random_words = torch.randint(FIRST_WORD_ID, vocab_size, ids.shape, generator=gen)
    inputs = torch.where(target & (roll >= 0.8) & (roll < 0.9), random_words, inputs)
    return inputs, labels


def pretrain_settings(args: FinetuneArguments, data_hash: str) -> dict:
    """What a pretrained checkpoint depends on (compared when one is loaded)."""
    keys = ("passage_words", "vocab_size", "passages_per_topic", "heldout_per_topic", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "intermediate_size", "pretrain_steps", "pretrain_batch_size",
            "pretrain_learning_rate", "pretrain_seed")
    return {**{k: getattr(args, k) for k in keys}, "data_hash": data_hash}


def pretrain(args: FinetuneArguments, train_ids, out_dir: str, data_hash: str) -> dict:
    """MLM-pretrain the encoder on ``train_ids`` (single process, deterministic: one thread, seeded)
    and ``save_pretrained`` it into ``out_dir``, with ``pretrain.json`` (settings, loss, weights hash)."""
    import torch
    from transformers import BertForMaskedLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits whatever the machine's core count
    try:
        torch.manual_seed(args.pretrain_seed)
        model = BertForMaskedLM(bert_config(args))
        opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_learning_rate, weight_decay=0.01)
        steps = args.pretrain_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1))
        gen = torch.Generator().manual_seed(args.pretrain_seed)
        losses = []
        model.train()
        for _ in range(steps):
            batch = train_ids[torch.randint(0, train_ids.shape[0], (args.pretrain_batch_size,), generator=gen)]
            inputs, labels = mask_for_mlm(batch, gen, args.vocab_size)
            loss = model(input_ids=inputs, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tail = losses[-20:] or [float("nan")]
    info = {"settings": pretrain_settings(args, data_hash), "mlm_loss_first": losses[0] if losses else None,
            "mlm_loss_last20": sum(tail) / len(tail), "weights_hash": state_hash(model.state_dict())}
    with open(os.path.join(out_dir, "pretrain.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    return info


def ensure_pretrained(args: FinetuneArguments, train_ids, data_hash: str) -> dict:
    """``pretrain.json`` of the checkpoint in ``args.pretrained_dir``, pretraining it first if absent.

    A checkpoint found there must have been pretrained with this run's settings (else ValueError
    naming the key). A new one is written to a temporary folder beside it and published by a
    rename, so that a concurrent run never reads half a checkpoint.
    """
    info_path = os.path.join(args.pretrained_dir, "pretrain.json")
    if not os.path.exists(info_path):
        parent = os.path.dirname(os.path.abspath(args.pretrained_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".pretraining-", dir=parent)
        pretrain(args, train_ids, tmp, data_hash)
        try:
            os.rename(tmp, args.pretrained_dir)
        except OSError:  # another run published it first; it is checked below like any other
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    with open(info_path) as f:
        info = json.load(f)
    want = pretrain_settings(args, data_hash)
    wrong = {k: (info["settings"].get(k), v) for k, v in want.items() if info["settings"].get(k) != v}
    if wrong:
        detail = ", ".join(f"{k}: checkpoint {have!r}, this run {need!r}" for k, (have, need) in sorted(wrong.items()))
        raise ValueError(f"--pretrained_dir {args.pretrained_dir}: pretrained with other settings ({detail}); "
                         "give the run the same settings, or another --pretrained_dir")
    return info


# -- small helpers ----------------------------------------------------------------------------------
def state_hash(state: Mapping) -> str:
    """A short digest of a state dict's tensors (names, dtypes, shapes and values), key-sorted."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def digest(values: Iterable) -> str:
    """A short digest of a sequence of ints or tensors."""
    h = hashlib.sha256()
    for v in values:
        h.update(v.contiguous().numpy().tobytes() if hasattr(v, "numpy") else str(v).encode() + b",")
    return h.hexdigest()[:16]


def estimate_lag(engine) -> List[dict]:
    """Per committed step of an ACCO engine (``engine.acco_metrics_history``), ``step`` k: how well
    θ̃_k estimated θ_k, the drift ‖θ̃_k − θ_k‖ / ‖θ_k − θ_{k-1}‖ and the cosine between the estimate's
    update θ̃_k − θ_{k-1} and the commit's θ_k − θ_{k-1}. Empty for stock (and for steps the bounded
    history no longer holds)."""
    out = []
    for rec in getattr(engine, "acco_metrics_history", None) or ():
        if "prev_step_estimate_drift" in rec:  # measured by the commit of the step before rec's
            out.append({"step": rec["step"] - 1, "drift": rec["prev_step_estimate_drift"],
                        "cos": rec.get("prev_step_estimate_cos")})
    return out


def _median_of(rows: Sequence[Mapping], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def heldout_metrics(model, ids, labels, batch_size: int = 128) -> Tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of ``model`` over all rows, summed in float64."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch_size):
            logits = model(input_ids=ids[i:i + batch_size]).logits.float()
            y = labels[i:i + batch_size]
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double().item()
            correct += int((logits.argmax(-1) == y).sum())
    model.train(was_training)
    return loss_sum / ids.shape[0], correct / ids.shape[0]


def accuracy(eval_prediction) -> dict:
    """``compute_metrics`` for the Trainer."""
    import numpy as np

    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float(np.mean(np.argmax(logits, axis=-1) == labels))}


def acco_block(ds_config) -> Optional[dict]:
    """The ``"acco"`` block of a DeepSpeed config (a path or a dict), or None."""
    if isinstance(ds_config, str):
        with open(ds_config) as f:
            ds_config = json.load(f)
    return (ds_config or {}).get("acco")


def acco_enabled(block: Optional[Mapping]) -> bool:
    """Whether an ``"acco"`` block switches ACCO on (validated by ``ds_acco.AccoConfig``)."""
    if block is None:
        return False
    from ds_acco import AccoConfig
    return AccoConfig(**block).enabled


def deepspeed_config(acco: Optional[dict] = None) -> dict:
    """The bench's DeepSpeed config: ZeRO-1, DeepSpeed's AdamW with the settings HF fills from its
    arguments ("auto"), no scheduler (the Trainer's own linear schedule applies), and ``acco`` as
    the ``"acco"`` block (None: stock ZeRO-1)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if acco is not None:
        cfg["acco"] = acco
    return cfg


def forget_deepspeed_shm() -> None:
    """Unlink this rank's DeepSpeed CPU shm buffer name (``/dev/shm``, ~66 MB, which DeepSpeed never
    removes; a sweep of 15 runs would leave 2 GB of RAM behind). Called after training, when every
    peer has long mapped it: their mappings stay valid."""
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("RANK"))
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass


# -- one fine-tune ----------------------------------------------------------------------------------
def comparable_settings(args: FinetuneArguments, targs) -> dict:
    """What every run of one table must share: all but the seed, the variant and the bookkeeping."""
    mine = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("variant", "record", "pretrained_dir")}
    theirs = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
              "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type",
              "warmup_steps", "dataloader_drop_last", "world_size")
    return {**mine, **{k: str(getattr(targs, k)) for k in theirs}}


def epoch_micro_batches(n_train: int, targs) -> int:
    """Micro-batches per rank in one epoch of the Trainer's data loader (Accelerate's sharding with
    ``even_batches``: the batches are dealt to the ranks in turn, the last round padded)."""
    mb = targs.per_device_train_batch_size
    batches = n_train // mb if targs.dataloader_drop_last else -(-n_train // mb)
    return -(-batches // targs.world_size)


def parse_train_args(argv: Sequence[str]):
    """``(FinetuneArguments, TrainingArguments)`` from :data:`TRAIN_DEFAULTS` + ``argv``."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((FinetuneArguments, TrainingArguments))
    args, targs = parser.parse_args_into_dataclasses(args=[*TRAIN_DEFAULTS, *argv])
    if targs.output_dir is None or not any(a.split("=")[0] == "--output_dir" for a in argv):
        raise ValueError("--output_dir DIR is required (the same folder on every rank: the pretrained checkpoint "
                         "goes to DIR/pretrained unless --pretrained_dir says otherwise)")
    if args.pretrained_dir is None:
        args.pretrained_dir = os.path.join(targs.output_dir, "pretrained")
    return args, targs


def train(argv: Sequence[str]) -> dict:
    """Run one fine-tune (see the module docstring); returns the record (on every rank)."""
    started = time.monotonic()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; say so to the hub client too
    import torch

    torch.set_num_threads(1)  # 2 ranks on 2 cores, and the same bits on every run
    args, targs = parse_train_args(argv)
    if targs.deepspeed is None:
        raise ValueError("--deepspeed CONFIG.json is required (python -m benchmarks.finetune config writes one)")
    block = acco_block(targs.deepspeed)
    enabled = acco_enabled(block)
    import ds_acco
    if enabled and not ds_acco.installed():
        raise RuntimeError(f"{targs.deepspeed} enables ACCO but ds_acco is not installed in this process, so the "
                           "Trainer would build stock DeepSpeed: launch through `python -m ds_acco run -m "
                           "benchmarks.finetune train ...`")
    variant = args.variant or ("acco" if enabled else "stock")

    import logging
    import warnings
    from transformers import BertForSequenceClassification, Trainer, set_seed
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the "newly initialized classifier" notice is expected here
    hf_logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)

    train_ids, train_labels, heldout_ids, heldout_labels = build_task(args)
    data_hash = digest([train_ids, train_labels, heldout_ids, heldout_labels])
    epoch = epoch_micro_batches(train_ids.shape[0], targs)
    partial = epoch % targs.gradient_accumulation_steps != 0 and targs.max_steps * targs.gradient_accumulation_steps > epoch
    if partial and not args.allow_partial_steps:
        raise ValueError(
            f"an epoch is {epoch} micro-batches per rank ({train_ids.shape[0]} passages, "
            f"{targs.per_device_train_batch_size} per micro-batch, {targs.world_size} ranks), not a multiple of "
            f"--gradient_accumulation_steps {targs.gradient_accumulation_steps}: the Trainer would end each epoch "
            "with a short optimizer step, which ACCO does not take, so stock and ACCO would train different "
            "schedules. Change --heldout_per_topic / --passages_per_topic / the batch, or pass "
            "--allow_partial_steps true to measure exactly that")
    t0 = time.monotonic()
    with targs.main_process_first(desc="pretraining"):  # rank 0 pretrains (if needed), the others then load
        pretrain_info = ensure_pretrained(args, train_ids, data_hash)
    pretrain_s = time.monotonic() - t0
    set_seed(targs.seed)  # as HF's examples: before the model, so the new head depends on --seed
    model = BertForSequenceClassification.from_pretrained(args.pretrained_dir)
    init_hash = state_hash(model.state_dict())
    train_set = TopicDataset(train_ids, train_labels)
    trainer = Trainer(model=model, args=targs, train_dataset=train_set,
                      eval_dataset=TopicDataset(heldout_ids, heldout_labels), compute_metrics=accuracy)
    if args.loss_kwargs == "off":
        trainer.model_accepts_loss_kwargs = False  # HF's override for a model that ignores num_items_in_batch
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    trainer_eval = trainer.evaluate()  # under ds_acco.install(): on the committed weights
    engine = trainer.model_wrapped
    with ds_acco.committed_weights(engine):
        heldout_loss, heldout_accuracy = heldout_metrics(trainer.model, heldout_ids, heldout_labels)
    history = trainer.state.log_history
    lag = estimate_lag(engine)
    record = {
        "version": RECORD_VERSION, "variant": variant, "seed": targs.seed, "acco": block,
        "deepspeed_config": os.path.abspath(targs.deepspeed),
        "engine": type(engine).__name__, "optimizer": type(getattr(engine, "optimizer", None)).__name__,
        "world_size": targs.world_size, "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(), "max_steps": targs.max_steps,
        "learning_rate": targs.learning_rate, "lr_scheduler_type": str(targs.lr_scheduler_type),
        "warmup_steps": targs.warmup_steps, "hf_global_step": trainer.state.global_step,
        "engine_global_steps": int(engine.global_steps),
        "heldout_loss": heldout_loss, "heldout_accuracy": heldout_accuracy,
        "trainer_eval_loss": trainer_eval["eval_loss"], "trainer_eval_accuracy": trainer_eval.get("eval_accuracy"),
        "eval_curve": [{"step": h["step"], "loss": h["eval_loss"], "accuracy": h.get("eval_accuracy")}
                       for h in history if "eval_loss" in h],
        "train_losses": [h["loss"] for h in history if "loss" in h],
        "learning_rates": [h.get("learning_rate") for h in history if "loss" in h],
        "grad_norms": [h.get("grad_norm") for h in history if "loss" in h],
        "loss_kwargs": args.loss_kwargs, "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
        "trainer_eval_loss_ratio": trainer_eval["eval_loss"] / heldout_loss,
        "epoch_micro_batches": epoch, "partial_steps": partial,
        "lag": lag, "drift_median": _median_of(lag, "drift"), "cos_median": _median_of(lag, "cos"),
        "n_train": int(train_ids.shape[0]), "n_heldout": int(heldout_ids.shape[0]),
        "class_counts": torch.bincount(train_labels, minlength=len(TOPICS)).tolist(),
        "data_hash": data_hash, "pretrained_hash": pretrain_info["weights_hash"],
        "pretrain": pretrain_info, "init_hash": init_hash, "data_order_hash": digest(train_set.read),
        "finetune": dataclasses.asdict(args),
        "settings": comparable_settings(args, targs),
        "pretrain_s": pretrain_s, "train_s": train_s, "total_s": time.monotonic() - started,
        "versions": _versions(),
    }
    if hasattr(engine, "destroy"):
        engine.destroy()  # ACCO: drain the round in flight and stop the communication thread
    forget_deepspeed_shm()
    if targs.process_index == 0:
        if args.record:
            _write_json(args.record, record)
        print(f"{RECORD_TAG} {json.dumps(record, sort_keys=True)}", flush=True)
    return record


def _versions() -> dict:
    import platform
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "ds_acco"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 -- a version is informative only
            out[name] = None
    return out


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# -- the table --------------------------------------------------------------------------------------
PAIRING_KEYS = ("data_hash", "pretrained_hash", "init_hash", "data_order_hash")


def gap_pct(loss: float, baseline: float) -> float:
    """The relative gap of ``loss`` over ``baseline``, in percent."""
    return 100.0 * (loss - baseline) / baseline


def check_records(records: Sequence[Mapping], baseline: str) -> None:
    """Refuse records that cannot be compared: a duplicate (variant, seed), a variant whose engine
    does not match its config (stock built from an enabled acco block or the reverse), runs with
    different settings, a seed whose runs did not start from the same checkpoint, weights and data
    order, or no baseline run."""
    seen, problems = {}, []
    for r in records:
        key = (r["variant"], r["seed"])
        if key in seen:
            problems.append(f"two records for variant {key[0]!r} seed {key[1]}")
        seen[key] = r
        wants_acco = acco_enabled(r.get("acco"))
        if wants_acco != (r["engine"] != "DeepSpeedEngine"):
            problems.append(f"variant {r['variant']!r} seed {r['seed']}: acco block {r.get('acco')} but engine "
                            f"{r['engine']} (launched without `python -m ds_acco run`?)")
    settings = {json.dumps(r.get("settings"), sort_keys=True) for r in records}
    if len(settings) > 1:
        problems.append(f"the runs used different settings: {sorted(settings)}")
    if not any(v == baseline for v, _ in seen):
        problems.append(f"no record of the baseline variant {baseline!r} (variants: {sorted({v for v, _ in seen})})")
    blocks = {}
    for (variant, seed), r in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        blocks.setdefault(variant, json.dumps(r.get("acco"), sort_keys=True))
        if blocks[variant] != json.dumps(r.get("acco"), sort_keys=True):
            problems.append(f"variant {variant!r} has different acco blocks across seeds")
        base = seen.get((baseline, seed))
        if base is not None:
            for k in PAIRING_KEYS:
                if r.get(k) != base.get(k):
                    problems.append(f"seed {seed}: variant {variant!r} has {k} {r.get(k)} but {baseline!r} "
                                    f"{base.get(k)}: the runs are not paired")
    if problems:
        raise ValueError("records cannot be compared:\n  " + "\n  ".join(problems))


def gap_table(records: Sequence[Mapping], baseline: str = "stock", metric: str = "heldout_loss") -> dict:
    """Per variant other than ``baseline``: the gap (%) of ``metric`` against the baseline run of the
    same seed, per seed, and over the seeds that have both: ``n``, ``median``, ``min``, ``max``.
    Seeds without a baseline run are left out and listed under ``unpaired``."""
    check_records(records, baseline)
    by = {(r["variant"], r["seed"]): r for r in records}
    variants = [v for v in dict.fromkeys(r["variant"] for r in records) if v != baseline]
    table = {"baseline": baseline, "metric": metric,
             "baseline_values": {s: by[(baseline, s)][metric] for v, s in sorted(by) if v == baseline},
             "variants": {}}
    for variant in variants:
        seeds = sorted(s for v, s in by if v == variant)
        per_seed = {s: gap_pct(by[(variant, s)][metric], by[(baseline, s)][metric]) for s in seeds
                    if (baseline, s) in by}
        gaps = list(per_seed.values())
        table["variants"][variant] = {
            "per_seed": per_seed, "values": {s: by[(variant, s)][metric] for s in seeds},
            "unpaired": [s for s in seeds if s not in per_seed], "n": len(gaps),
            "median": statistics.median(gaps) if gaps else None,
            "min": min(gaps) if gaps else None, "max": max(gaps) if gaps else None}
    return table


def format_table(table: Mapping) -> str:
    """Markdown: one row per seed (the baseline's value, each variant's value and gap), then the
    median and the range of each variant's gap."""
    variants = list(table["variants"])
    seeds = sorted({*table["baseline_values"], *(s for v in variants for s in table["variants"][v]["values"])})
    head = [f"{table['baseline']} {table['metric']}"] + [f"{v} (gap)" for v in variants]
    lines = ["| seed | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for s in seeds:
        cells = [_fmt(table["baseline_values"].get(s))]
        for v in variants:
            t = table["variants"][v]
            val, gap = t["values"].get(s), t["per_seed"].get(s)
            cells.append("—" if val is None else f"{val:.4f} ({'unpaired' if gap is None else f'{gap:+.2f}%'})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for label, fn in (("median gap", lambda t: _pct(t["median"])),
                      ("range", lambda t: "—" if t["n"] == 0 else f"{t['min']:+.2f}% … {t['max']:+.2f}%"),
                      ("seeds paired", lambda t: str(t["n"]))):
        lines.append(f"| {label} | | " + " | ".join(fn(table["variants"][v]) for v in variants) + " |")
    return "\n".join(lines)


def curve_table(records: Sequence[Mapping], baseline: str = "stock") -> dict:
    """Per variant, per evaluation step of the run (the Trainer's periodic evaluations, on committed
    weights): the median over the paired seeds of the held-out loss gap against the baseline. The
    Trainer's loss may be scaled (see ``loss_kwargs``), but by the same factor in both runs of a pair."""
    by = {(r["variant"], r["seed"]): {p["step"]: p["loss"] for p in r["eval_curve"]} for r in records}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        if variant == baseline:
            continue
        gaps = {}
        for (v, seed), curve in by.items():
            base = by.get((baseline, seed))
            if v == variant and base is not None:
                for step, loss in curve.items():
                    if step in base:
                        gaps.setdefault(step, []).append(gap_pct(loss, base[step]))
        out[variant] = {step: statistics.median(g) for step, g in sorted(gaps.items())}
    return out


def format_curve(curve: Mapping) -> str:
    """Markdown of :func:`curve_table`: one row per evaluation step."""
    variants = list(curve)
    steps = sorted({s for v in variants for s in curve[v]})
    lines = ["| step | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(_pct(curve[v].get(s)) for v in variants) + " |" for s in steps]
    return "\n".join(lines)


def lag_table(records: Sequence[Mapping]) -> dict:
    """Per variant with lag metrics: the median over its seeds of each run's median drift and cosine."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        runs = [r for r in records if r["variant"] == variant and r.get("drift_median") is not None]
        if runs:
            out[variant] = {"drift": statistics.median(r["drift_median"] for r in runs),
                            "cos": _median_of(runs, "cos_median"), "n": len(runs)}
    return out


def format_lag(lag: Mapping) -> str:
    """Markdown of :func:`lag_table`."""
    lines = ["| variant | drift | cos | seeds |", "|---|---|---|---|"]
    lines += [f"| {v} | {t['drift']:.3f} | {_fmt(t['cos'], 3)} | {t['n']} |" for v, t in lag.items()]
    return "\n".join(lines)


def _fmt(x, digits: int = 4):
    return "—" if x is None else f"{x:.{digits}f}"


def _pct(x):
    return "—" if x is None else f"{x:+.2f}%"


def load_records(paths: Sequence[str]) -> List[dict]:
    """The JSON records at ``paths`` (each one fine-tune)."""
    out = []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if r.get("version") != RECORD_VERSION:
            raise ValueError(f"{p}: record version {r.get('version')}, this summarizer reads {RECORD_VERSION}")
        out.append(r)
    return out


def summarize(argv: Sequence[str]) -> dict:
    """``summarize RECORDS... [--baseline stock] [--order a,b] [--out STEM]``: print the tables (loss gap
    at the end, accuracy, the gap along the run, the estimate's lag); with ``--out``, also write
    ``STEM.md`` and ``STEM.json``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune summarize")
    p.add_argument("records", nargs="+")
    p.add_argument("--baseline", default="stock")
    p.add_argument("--order", default=None, help="comma-separated variant names: the tables' column order")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    a = p.parse_args(argv)
    records = load_records(a.records)
    if a.order:
        rank = {v: i for i, v in enumerate(a.order.split(","))}
        records.sort(key=lambda r: (rank.get(r["variant"], len(rank)), r["variant"], r["seed"]))
    loss = gap_table(records, a.baseline, "heldout_loss")
    acc = gap_table(records, a.baseline, "heldout_accuracy")
    curve = curve_table(records, a.baseline)
    lag = lag_table(records)
    text = (f"Held-out loss on committed weights at the end, gap vs {a.baseline} (positive: worse)\n\n"
            f"{format_table(loss)}\n\nHeld-out accuracy, relative change vs {a.baseline}\n\n{format_table(acc)}\n\n"
            f"Held-out loss along the run (the Trainer's evaluations), median gap vs {a.baseline} over the seeds\n\n"
            f"{format_curve(curve)}\n\n"
            "Estimate lag per variant: median over seeds of each run's median per-step drift "
            "‖θ̃_k − θ_k‖ / ‖θ_k − θ_{k-1}‖ and cosine (the estimate's update vs the commit's)\n\n"
            f"{format_lag(lag)}\n")
    print(text)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(text)
        _write_json(a.out + ".json", {"heldout_loss": loss, "heldout_accuracy": acc, "curve": curve, "lag": lag})
    return loss


# -- entry point ------------------------------------------------------------------------------------
def write_config(argv: Sequence[str]) -> dict:
    """``config --acco JSON|null --out PATH``: write :func:`deepspeed_config` with that acco block."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune config")
    p.add_argument("--acco", default="null", help="the acco block as JSON; null: stock ZeRO-1")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    block = json.loads(a.acco)
    acco_enabled(block)  # a block ds_acco would refuse fails here, naming the key
    cfg = deepspeed_config(block)
    _write_json(a.out, cfg)
    return cfg


COMMANDS = {"train": train, "summarize": summarize, "config": write_config}


def main(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # the deepspeed launcher puts --local_rank=K first; the Trainer reads the rank from the environment
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: python -m benchmarks.finetune {{{','.join(COMMANDS)}}} ...\n\n{__doc__}")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
