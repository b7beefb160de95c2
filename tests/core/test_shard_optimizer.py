"""The estimate step leaves θ and every bit of optimizer state as it was (no optimizer special-cased)."""
import copy

import pytest
import torch

from ds_acco.core.step.shard_optimizer import ShardOptimizer

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
}


def _equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _setup(name):
    torch.manual_seed(0)
    masters = [torch.randn(37, requires_grad=True), torch.randn(11, requires_grad=True)]
    opt = OPTIMIZERS[name]([{"params": [masters[0]]}, {"params": [masters[1]], "lr": 0.003}])
    return masters, ShardOptimizer(opt, masters), opt


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("after_commits", [0, 3])
def test_estimate_leaves_state_bit_identical(name, after_commits):
    masters, so, opt = _setup(name)
    for _ in range(after_commits):
        so.commit([torch.randn_like(m) for m in masters], lambda: None)
    before_state = copy.deepcopy(opt.state_dict())
    before_params = [m.detach().clone() for m in masters]
    est = so.estimate([torch.randn_like(m) for m in masters], lambda: [m.detach().clone() for m in masters])
    assert _equal(opt.state_dict(), before_state)
    assert all(torch.equal(m, b) for m, b in zip(masters, before_params))
    assert all(m.grad is None for m in masters)
    assert not all(torch.equal(e, b) for e, b in zip(est, before_params))  # the estimate did move


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_estimate_equals_the_step_a_commit_would_take(name):
    masters, so, _ = _setup(name)
    read = lambda: [m.detach().clone() for m in masters]  # noqa: E731
    so.commit([torch.randn_like(m) for m in masters], read)
    g = [torch.randn_like(m) for m in masters]
    est = so.estimate(g, read)
    com = so.commit(g, read)
    assert all(torch.equal(e, c) for e, c in zip(est, com))


def test_estimate_keeps_state_tensor_identity():
    """DeepSpeed links hp params to optimizer-state tensors; the restore keeps the same objects."""
    masters, so, opt = _setup("adam")
    so.commit([torch.ones_like(m) for m in masters], lambda: None)
    ids = {k: id(v) for k, v in opt.state[masters[0]].items()}
    so.estimate([torch.ones_like(m) for m in masters], lambda: None)
    assert {k: id(v) for k, v in opt.state[masters[0]].items()} == ids


def test_estimate_restores_even_when_step_fails():
    masters, so, opt = _setup("adam")
    so.commit([torch.ones_like(m) for m in masters], lambda: None)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError):
        so.estimate([torch.ones(3), torch.ones(3)], lambda: None)  # wrong shapes
    assert _equal(opt.state_dict(), before)
