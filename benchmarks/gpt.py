"""The reference model: a small GPT-2 over bytes, trained by the benchmark (:mod:`benchmarks`),
the examples and the tests on the corpus of :mod:`benchmarks.data`.

    model = CausalLM(seq_len=64)                      # 2 layers x 128, ~0.4M parameters
    loss = model(rows)                                # rows: [batch, seq_len + 1] byte ids
    engine, *_ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=...)

A transformers ``GPT2LMHeadModel`` with random initialisation (seed it with ``torch.manual_seed``
first), a vocabulary of the 256 byte values and no dropout, so two runs from the same seed see
the same numbers and an A/B compares only the optimizer. transformers is imported on first use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB_SIZE = 256  # byte tokens (benchmarks.data.ByteTokenizer)


def gpt2_config(seq_len: int, n_embd: int = 128, n_layer: int = 2, n_head: int = 4):
    """The ``GPT2Config`` of the reference model (for code that wants the bare HF model, e.g. a
    ``Trainer``)."""
    from transformers import GPT2Config
    return GPT2Config(vocab_size=VOCAB_SIZE, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: A/B runs match
                      bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 is not a byte


class CausalLM(torch.nn.Module):
    """GPT-2 whose forward takes ``[batch, seq_len + 1]`` token rows and returns the mean
    next-token cross-entropy (inputs ``row[:-1]``, targets ``row[1:]``)."""

    def __init__(self, seq_len: int, n_embd: int = 128, n_layer: int = 2, n_head: int = 4):
        super().__init__()
        from transformers import GPT2LMHeadModel
        self.lm = GPT2LMHeadModel(gpt2_config(seq_len, n_embd, n_layer, n_head))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=rows[:, :-1], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


def param_groups(model: torch.nn.Module):
    """Weight decay (the optimizer's) on matrices only; none on biases and LayerNorm weights."""
    return [{"params": [p for p in model.parameters() if p.ndim >= 2]},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


@torch.no_grad()
def heldout_loss(module: torch.nn.Module, batches) -> float:
    """Token-weighted mean loss over every rank's held-out batches (a collective: all ranks call it)."""
    was_training = module.training
    module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for rows in batches:
        n = rows[:, 1:].numel()
        total[0] += module(rows).double() * n
        total[1] += n
    dist.all_reduce(total)
    module.train(was_training)
    return (total[0] / total[1]).item()


__all__ = ["VOCAB_SIZE", "CausalLM", "gpt2_config", "heldout_loss", "param_groups"]
