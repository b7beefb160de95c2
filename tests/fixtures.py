"""Model, data, optimizers and schedules shared by the distributed tests and the reference."""
from __future__ import annotations

import torch

IN, HIDDEN, OUT, MICRO = 6, 10, 3, 4


class TinyNet(torch.nn.Module):
    """A two-layer MLP whose forward returns its MSE loss."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


class WideNet(torch.nn.Module):
    """TinyNet's data, 2.1M parameters (8.4 MB in fp32): a leak of one model-sized buffer shows in RSS."""

    def __init__(self, seed: int = 0, width: int = 1024):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, width)
        self.mid = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, x, y):
        h = torch.tanh(self.mid(torch.tanh(self.fc1(x))))
        return torch.nn.functional.mse_loss(self.fc2(h), y)


class TokenNet(TinyNet):
    """TinyNet whose loss is a *sum* over the valid rows ("tokens") of a padded micro-batch, so
    per-token weighting (weight = number of valid rows) gives the exact per-token mean."""

    def forward(self, x, y, mask):
        per_row = ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).mean(dim=1)
        return (per_row * mask).sum()


def token_batch(rank: int, i: int):
    """A padded micro-batch with 1..MICRO valid rows (deterministic)."""
    x, y = batch(rank, i)
    valid = 1 + (3 * rank + 5 * i) % MICRO
    mask = (torch.arange(MICRO) < valid).to(x.dtype)
    return x, y, mask


def batch(rank: int, i: int):
    """Micro-batch ``m_i`` of ``rank``: deterministic, different per rank and index."""
    g = torch.Generator().manual_seed(1000 * rank + i + 7)
    x = torch.randn(MICRO, IN, generator=g)
    y = torch.randn(MICRO, OUT, generator=g)
    return x, y


def param_groups(model):
    """Two groups (weights with decay, biases without) to exercise several flat groups."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class HeavyBall(torch.optim.Optimizer):
    """A user-defined optimizer (no functional step in ds_acco): heavy-ball momentum with decoupled
    weight decay, p ← p (1 − lr·wd) − lr·m, m ← β m + g. Its step reads each group through a helper
    method, as user code often does."""

    def __init__(self, params, lr=0.05, beta=0.8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _update(self, p, group):
        state = self.state[p]
        m = state.get("momentum")
        m = state["momentum"] = p.grad.clone() if m is None else m.mul_(group["beta"]).add_(p.grad)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(-group["lr"] * m)


TENSOR_LR = ":tensor-lr"  # suffix of a name: the same optimizer built with lr=torch.tensor(...)


def make_optimizer(name: str):
    if name.endswith(TENSOR_LR):
        return _with_tensor_lr(make_optimizer(name[:-len(TENSOR_LR)]))

    def build(model):
        if name == "sgd":
            return torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9, weight_decay=0.01)
        if name == "adamw":
            return torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)
        if name == "adamw-fast":
            # For precision tests: lr 0.05 puts the schedules (acco, dpu, stock) far apart relative to
            # bf16 noise; eps 1e-3 keeps Adam's first steps from being sign-like on tiny gradients
            # (with eps 1e-8, bf16 gradient noise moves ACCO's θ_T 5x more than stock's or DPU's: its
            # estimate steps from S_t amplify it; seen in a float64 reference with bf16-rounded
            # gradients, no ds_acco involved).
            return torch.optim.AdamW(param_groups(model), lr=0.05, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)
        if name == "adamw-fused":  # torch's fused kernel: a functional step of its own
            return torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
        if name == "adamw1":  # one group, as DeepSpeed's config-built AdamW makes it
            return torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)
        if name == "adam":
            return torch.optim.Adam(model.parameters(), lr=0.02)
        if name == "rmsprop":  # no functional step: the estimate steps the shards for real, then restores them
            return torch.optim.RMSprop(param_groups(model), lr=0.01)
        if name == "adagrad":  # one group, no scheduler: DeepSpeed rebuilds Adagrad from its defaults on the shards
            return torch.optim.Adagrad(model.parameters(), lr=0.05, weight_decay=0.01)
        if name == "adafactor":
            return torch.optim.Adafactor(param_groups(model), lr=0.02, weight_decay=0.01)
        if name == "adafactor-hf":  # transformers' Adafactor at a given rate (relative_step computes its own)
            from transformers.optimization import Adafactor
            return Adafactor(param_groups(model), lr=0.02, relative_step=False, scale_parameter=False)
        if name == "lion":  # lion-pytorch's Lion: the normalised-update family (docs/estimate.md)
            from lion_pytorch import Lion
            return Lion(param_groups(model), lr=0.02, betas=(0.9, 0.99), weight_decay=0.01)
        if name == "heavy-ball":
            return HeavyBall(param_groups(model), lr=0.05, weight_decay=0.01)
        if name == "cpu-adamw":  # DeepSpeed's CPU Adam as a client optimizer (its op must be built)
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return DeepSpeedCPUAdam(param_groups(model), lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)
        raise ValueError(name)
    return build


def _with_tensor_lr(make_float):
    """``make_float``'s optimizer with every rate a 0-dim tensor, as ``lr=torch.tensor(...)`` builds it."""
    def build(model):
        opt = make_float(model)
        for group in opt.param_groups:
            group["lr"] = torch.tensor(group["lr"])
        opt.defaults["lr"] = torch.tensor(opt.defaults["lr"])
        return opt
    return build


def make_scheduler(kind):
    if kind is None:
        return None

    def build(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    return build


def ds_config(gas: int = 4, acco=None, clip: float = 0.0, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
    if acco is not None:
        cfg["acco"] = acco
    cfg.update(extra)
    return cfg
