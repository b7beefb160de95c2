"""The optimizers other than AdamW for benchmarks.multirun's stacked runs (issue 43 item 4): each one's step
on stacked tensors (a leading run dimension, per-run learning rates), with its own state, the same
update rule as the stock optimizer it stands for:

  adam       torch.optim.Adam, coupled weight decay: g + wd·θ, then Adam (Setting.beta1, beta2, eps)
  sgd        torch.optim.SGD, momentum 0.9, dampening 0, not Nesterov, coupled weight decay; the first
             step's buffer is the gradient itself
  adafactor  transformers.optimization.Adafactor with an explicit lr: scale_parameter=False,
             relative_step=False, warmup_init=False, beta1=None, its default eps (1e-30, 1e-3),
             clip_threshold 1, decay_rate -0.8; factored second moment for a run's >= 2-d tensors;
             weight decay decoupled (θ·(1 − wd·lr)), as transformers applies it
  lion       lion_pytorch.Lion (the lion-pytorch package), betas (0.9, 0.99), θ·(1 − lr·wd) then
             θ − lr·sign(β1·m + (1 − β1)·g), then m ← β2·m + (1 − β2)·g

Weight decay is Setting.weight_decay on the matrices (the decay mask of multirun), 0 elsewhere. ACCO's
estimate, as the library makes it for any optimizer (core/step/shard_optimizer.py's RoundView): the same
step from the committed state with the learning rate times c, the state it produces discarded.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")
SGD_MOMENTUM = 0.9
LION_BETAS = (0.9, 0.99)
ADAFACTOR = dict(eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8)


def _per_run(lr, like: torch.Tensor):
    """A Python float as is; a [R] tensor broadcast against a stacked tensor."""
    return lr.view(-1, *([1] * (like.dim() - 1))) if torch.is_tensor(lr) else lr



def _rms(x: torch.Tensor) -> torch.Tensor:
    """Per run: ‖x_r‖₂ / √numel(x_r), broadcastable against x (Adafactor's _rms of one run's tensor)."""
    flat = x.reshape(x.shape[0], -1)
    return (flat.norm(dim=1) / math.sqrt(flat.shape[1])).view(-1, *([1] * (x.dim() - 1)))


def _adam(p, g, st, lr, wd, step, s):
    g = g + wd * p if wd else g
    m = torch.lerp(st["m"], g, 1 - s.beta1)
    v = st["v"] * s.beta2 + (1 - s.beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - s.beta2 ** step) + s.eps
    return p - (lr / (1 - s.beta1 ** step)) * m / denom, {"m": m, "v": v}


def _sgd(p, g, st, lr, wd, step, s):
    g = g + wd * p if wd else g
    buf = g.clone() if step == 1 else st["buf"] * SGD_MOMENTUM + g  # dampening 0
    return p - lr * buf, {"buf": buf}


def _adafactor(p, g, st, lr, wd, step, s):
    beta2t = 1.0 - math.pow(step, ADAFACTOR["decay_rate"])
    sq = g * g + ADAFACTOR["eps"][0]
    if "row" in st:  # factored: a run's tensor has >= 2 dimensions
        row = st["row"] * beta2t + (1 - beta2t) * sq.mean(dim=-1)
        col = st["col"] * beta2t + (1 - beta2t) * sq.mean(dim=-2)
        r = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        upd, new = r * col.unsqueeze(-2).rsqrt() * g, {"row": row, "col": col}
    else:
        v = st["v"] * beta2t + (1 - beta2t) * sq
        upd, new = v.rsqrt() * g, {"v": v}
    upd = upd / (_rms(upd) / ADAFACTOR["clip_threshold"]).clamp(min=1.0) * lr
    p = p - wd * lr * p if wd else p
    return p - upd, new


def _lion(p, g, st, lr, wd, step, s):
    b1, b2 = LION_BETAS
    p = p * (1 - lr * wd)
    upd = (st["m"] * b1 + g * (1 - b1)).sign()
    return p - lr * upd, {"m": st["m"] * b2 + g * (1 - b2)}


_STEPS = {"adam": _adam, "sgd": _sgd, "adafactor": _adafactor, "lion": _lion}


def _init(kind: str, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    if kind == "adafactor":
        if p.dim() - 1 >= 2:
            return {"row": torch.zeros_like(p[..., 0]), "col": torch.zeros_like(p[..., 0, :])}
        return {"v": torch.zeros_like(p)}
    return {"buf": None} if kind == "sgd" else {"m": torch.zeros_like(p), "v": torch.zeros_like(p)}


class SimOptimizer:
    """One optimizer's state over stacked parameters; ``step`` is one step of every run."""

    def __init__(self, kind: str, setting, theta: Dict[str, torch.Tensor], decay: Dict[str, bool]):
        if kind not in _STEPS:
            raise ValueError(f"optimizer {kind!r}: the stacked recurrences know {OPTIMIZERS}")
        self.kind, self.s, self.fn = kind, setting, _STEPS[kind]
        self.wd = {n: setting.weight_decay if decay[n] else 0.0 for n in theta}
        self.state = {n: _init(kind, p) for n, p in theta.items()}
        self.commits = 0

    def step(self, theta: Dict[str, torch.Tensor], grads: Dict[str, torch.Tensor], lr, commit: bool):
        """θ after one step with ``grads`` at learning rate ``lr`` (a float, or a [R] tensor: per run).
        ``commit``: keep the new state (the commit); else discard it (ACCO's estimate)."""
        step = self.commits + 1
        out, states = {}, {}
        for n, p in theta.items():
            out[n], states[n] = self.fn(p, grads[n], self.state[n], _per_run(lr, p), self.wd[n], step, self.s)
        if commit:
            self.state, self.commits = states, step
        return out


def check_variants(kind: str, variants) -> None:
    """The estimate variants that read AdamW's moments (keep_v, dc, the nag predictor) are AdamW's only."""
    for v in variants:
        if kind != "adamw" and (v.keep_v or v.dc or v.predict == "nag"):
            raise ValueError(f"variant {v.name}: it reads AdamW's moments; optimizer {kind!r} has none")
