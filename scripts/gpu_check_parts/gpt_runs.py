"""The bf16 GPT that the trace and memory parts train: its DeepSpeed engine under stock ZeRO-1,
ACCO or DPU, its data and one micro-batch."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

def gpt_engine(variant: str, n_layer: int, n_embd: int, seq: int, micro_batch: int, gas: int):
    """A bf16 GPT under stock ZeRO-1 ('stock'), ACCO fixed ('fixed') or DPU ('dpu'); every variant
    the same model, data type, batch and optimizer."""
    import ds_acco
    from benchmarks.gpt import CausalLM, param_groups
    torch.manual_seed(0)
    model = CausalLM(seq, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64))
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}}}
    if variant == "stock":
        # DeepSpeed's default buckets (5e8 elements) would dwarf this model and flatter ACCO: HF
        # Trainer's "auto" size instead. ACCO replaces them (and warns when they are set).
        cfg["zero_optimization"].update(reduce_bucket_size=n_embd ** 2, allgather_bucket_size=n_embd ** 2)
    else:
        cfg["acco"] = {"enabled": True, "mode": {"fixed": "acco", "dpu": "dpu"}[variant]}
    engine, *_ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def gpt_data(engine, micro_batch: int, seq: int, count: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (micro_batch, seq + 1), generator=g).to(engine.device) for _ in range(count)]


def gpt_micro_batch(engine, rows: torch.Tensor, before_forward: Optional[Callable[[], None]] = None) -> None:
    if before_forward is not None:
        before_forward()
    loss = engine(rows)
    engine.backward(loss)
    engine.step()
