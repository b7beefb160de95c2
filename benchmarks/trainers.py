"""One trainer interface (forward, backward, step, committed weights) over DeepSpeed, stock FSDP2
and AccoFSDP: what each A/B variant trains with."""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.distributed as dist

from benchmarks.gpt import param_groups

from .variants import check_fsdp_config, is_fsdp, is_sharded, mode_of


# -- trainers: one interface over DeepSpeed, stock FSDP2 and AccoFSDP ------------------------------
class _Delegating:
    """A trainer whose engine (DeepSpeed's, or AccoFSDP) has ``backward``, ``step``,
    ``global_steps`` and works with :func:`ds_acco.committed_weights`."""

    def __init__(self, inner, forward):
        self.inner, self._forward = inner, forward

    def __call__(self, rows):
        return self._forward(rows)

    def backward(self, loss):
        self.inner.backward(loss)

    def step(self):
        self.inner.step()

    @property
    def global_steps(self) -> int:
        return self.inner.global_steps

    def committed_weights(self):
        import ds_acco
        return ds_acco.committed_weights(self.inner)


class DeepSpeedTrainer(_Delegating):
    """Stock ZeRO-1 (``ds_acco.initialize`` without an ``acco`` block is plain
    ``deepspeed.initialize``) or ACCO / DPU on DeepSpeed."""

    fsdp = False

    def __init__(self, model: torch.nn.Module, cfg: dict):
        import ds_acco
        engine, _, _, _ = ds_acco.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        super().__init__(engine, engine)
        self.module = engine.module
        self.acco = getattr(engine.optimizer, "schedule", None) is not None

    def metrics_history(self) -> List[dict]:
        return list(self.inner.acco_metrics_history) if self.acco else []

    def auto_decision(self) -> Optional[dict]:
        """Mode auto: its decision (inputs, choice, reason), once taken; else None."""
        chooser = getattr(getattr(self.inner.optimizer, "schedule", None), "auto", None)
        return dict(chooser.decision) if chooser is not None and chooser.decision is not None else None

    def close(self):
        self.inner.destroy()


def shard_fsdp(model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module:
    """FSDP2's usual recipe (``fully_shard`` each transformer block, then the root) on a 1-D CPU
    mesh, by default with ``reshard_after_forward=False``: parameters are gathered once per optimizer
    step, the same traffic as ZeRO-1 (one reduce-scatter and one all-gather of the model per step).
    ``sharded``: FSDP's defaults (blocks resharded after forward, re-gathered for backward), the
    configuration that keeps one block unsharded at a time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.lm.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=sharded)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def fsdp_adamw(model: torch.nn.Module, cfg: dict) -> torch.optim.AdamW:
    """torch AdamW over FSDP's sharded parameters with the settings of the config's optimizer
    block (the DeepSpeed variants build the same optimizer from it, ``torch_adam``)."""
    opt = cfg.get("optimizer") or {}
    if opt and str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        raise ValueError(f"optimizer.type = {opt.get('type')!r}: the FSDP variants build torch AdamW; fix: use an "
                         "AdamW optimizer block or run the DeepSpeed variants only")
    p = dict(opt.get("params") or {})
    return torch.optim.AdamW(param_groups(model), lr=p.get("lr", 1e-3), betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.01))


class StockFSDPTrainer:
    """Stock FSDP2 with gradient accumulation: gradient sync (reduce-scatter) only on the last
    micro-batch of each step (no-sync accumulation of unsharded gradients before it), then clipping
    and the optimizer step on the shards. Resharding after backward on the last micro-batch only,
    or (``sharded``) after every forward and backward."""

    fsdp = True
    acco = False

    def __init__(self, model: torch.nn.Module, cfg: dict, sharded: bool = False):
        check_fsdp_config(cfg)
        self.sharded = sharded
        self.module = shard_fsdp(model, sharded)
        self.optimizer = fsdp_adamw(model, cfg)
        self.gas = cfg["gradient_accumulation_steps"]
        self.clip = float(cfg.get("gradient_clipping") or 0.0)
        self.micro = 0
        self.global_steps = 0

    def __call__(self, rows):
        last = self.micro % self.gas == self.gas - 1
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last or self.sharded)  # the next step's forward gathers the new shards
        return self.module(rows)

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.gas == 0:
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1

    @contextlib.contextmanager
    def committed_weights(self):
        """The shards are the committed weights. An evaluation forward gathers them and, with
        ``reshard_after_forward=False``, leaves them gathered: reshard on exit, so the next timed
        step pays its all-gather as every step does."""
        from torch.distributed.fsdp import FSDPModule
        try:
            yield
        finally:
            for m in self.module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def metrics_history(self) -> List[dict]:
        return []

    def close(self):
        pass


class AccoFSDPTrainer(_Delegating):
    """ACCO / DPU on the same FSDP2 model (:class:`ds_acco.fsdp.AccoFSDP`)."""

    fsdp = True
    acco = True

    def __init__(self, model: torch.nn.Module, cfg: dict, sharded: bool = False):
        from ds_acco.fsdp import AccoFSDP
        check_fsdp_config(cfg)
        self.module = shard_fsdp(model, sharded)
        super().__init__(AccoFSDP(self.module, fsdp_adamw(model, cfg), cfg, sharded_params=sharded), self.module)

    def metrics_history(self) -> List[dict]:
        return self.inner.acco_metrics_history

    def close(self):
        self.inner.close()


def make_trainer(variant: str, model: torch.nn.Module, cfg: dict):
    if not is_fsdp(variant):
        return DeepSpeedTrainer(model, cfg)
    trainer = StockFSDPTrainer if mode_of(variant) == "stock" else AccoFSDPTrainer
    return trainer(model, cfg, sharded=is_sharded(variant))
