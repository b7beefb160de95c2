"""The byte-level BERT and its masked-LM pretraining, cached by settings and data hash, so every
fine-tune of a comparison starts from the same checkpoint, as a hub checkpoint would."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Mapping

from .finetune_args import FinetuneArguments
from .finetune_task import FIRST_WORD_ID, MASK_ID, PAD_ID, TOPICS, UNK_ID


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


def state_hash(state: Mapping) -> str:
    """A short digest of a state dict's tensors (names, dtypes, shapes and values), key-sorted."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]
