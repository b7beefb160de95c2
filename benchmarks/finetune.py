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
import os
import sys
import time
from typing import Iterable, List, Optional, Sequence, Tuple

from .finetune_args import FinetuneArguments
from .finetune_pretrain import ensure_pretrained, state_hash
from .finetune_summary import (RECORD_TAG, RECORD_VERSION, acco_block, acco_enabled, median_of, summarize,
                               write_json)
from .finetune_task import TOPICS, TopicDataset, build_task


# The bench's Trainer arguments; the command line overrides any of them (argparse: last one wins).
TRAIN_DEFAULTS: Tuple[str, ...] = (
    "--max_steps", "60", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "64",
    "--gradient_accumulation_steps", "4", "--learning_rate", "1e-3", "--weight_decay", "0.01",
    "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "10", "--save_strategy", "no",
    "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--use_cpu", "true",
    "--seed", "0",
)


# -- small helpers ----------------------------------------------------------------------------------


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


def deepspeed_config(acco: Optional[dict] = None) -> dict:
    """The bench's DeepSpeed config: ZeRO-1, DeepSpeed's AdamW with the settings HF fills from its
    arguments ("auto"), no scheduler (the Trainer's own linear schedule applies), and ``acco`` as
    the ``"acco"`` block (None: stock ZeRO-1), the drift metric measured at every commit unless the
    block says otherwise (the lag table is per step; the library samples every 100th by default)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if acco is not None:
        cfg["acco"] = {**acco, "metrics": {"estimate_drift_every": 1}} if "metrics" not in acco else acco
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
        "lag": lag, "drift_median": median_of(lag, "drift"), "cos_median": median_of(lag, "cos"),
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
            write_json(args.record, record)
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
    write_json(a.out, cfg)
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
