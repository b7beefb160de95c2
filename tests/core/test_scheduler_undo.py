"""A skipped commit's LR-scheduler step is undone through the scheduler's protocol
(ds_acco/core/lifecycle/scheduler_undo.py, driven by ``LRBookkeeping``, ds_acco/core/lifecycle/lr_bookkeeping.py).

The calls are the schedule's own, in its order: before a commit is launched the step still owed
is taken (``step_owed``), the round captures the settings (``capture_settings``: what the round
uses), ``launched``; after the ``step()`` that launched it the owed step is taken; a phase later
the commit is ``collected``, applied or skipped. Stock never steps the scheduler for a skipped
step, so the reference is a fresh optimizer and scheduler stepped once per *applied* commit; the
settings each round uses must equal the reference's at that step, bit for bit. (The engine
tests in tests/deepspeed/test_lr_skipped_commit.py compare with a real stock engine.)
"""
import gc
import logging
import threading
import types

import pytest
import torch

from ds_acco.core.lifecycle.lr_bookkeeping import LRBookkeeping
from ds_acco.core.step.functional_step import capture_settings
from ds_acco.core.round.rounds import RoundKind
from ds_acco.core.lifecycle.scheduler_undo import copied_state, load_restores
from schedulers import SCHEDULERS, MegatronLikeScheduler, settings

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build
STEPS = 9
SKIPPED = (2, 5, 6)  # two in a row: the second undo starts from an undone state


def _optimizer(scale: int = 1, tensor_lr: bool = False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64 * scale, 8)), torch.nn.Parameter(torch.randn(64 * scale))]
    lr = torch.tensor(0.02) if tensor_lr else 0.02
    opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}], lr=lr,
                            betas=(0.9, 0.99), weight_decay=0.1)
    for p in params:  # Adam's state exists, as in training: a copy of the optimizer would copy it
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _bookkeeping(opt, sched):
    return LRBookkeeping(lambda: sched.step(), lambda: sched, lambda: opt)


def _run(lr, opt, skipped=SKIPPED, steps=STEPS, between=None):
    """Each commit's settings as its round captured them, and the settings read right after the
    step() that launched it."""
    used, read = [], []
    for t in range(steps):
        lr.step_owed()  # before_launch
        used.append(settings(opt))
        lr.launched(RoundKind.COMMIT)
        lr.step_owed()  # the end of the step() that launched it
        read.append(settings(opt))
        if between is not None:
            between(t)
        lr.collected(t in skipped)  # a phase later
    return used, read


def _reference(build, skipped=SKIPPED, steps=STEPS, steps_before=0):
    """A fresh optimizer and scheduler (``build(optimizer)``) stepped ``steps_before`` times, then
    once per applied commit: each commit's settings, the final settings and scheduler state."""
    opt = _optimizer()
    sched = build(opt)
    for _ in range(steps_before):
        sched.step()
    used = []
    for t in range(steps):
        used.append(settings(opt))
        if t not in skipped:
            sched.step()
    return used, settings(opt), getattr(sched, "state_dict", dict)()


@pytest.fixture(autouse=True)
def _no_step_order_warning():
    import warnings
    with warnings.catch_warnings():  # torch's "lr_scheduler.step() before optimizer.step()": no real steps here
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_each_round_uses_the_settings_of_a_scheduler_stepped_on_applied_commits(name):
    opt = _optimizer()
    sched = SCHEDULERS[name](opt)
    used, read = _run(_bookkeeping(opt, sched), opt)
    want, final, state = _reference(SCHEDULERS[name])
    assert used == want  # every setting of every group, bit for bit (floats compared exactly)
    assert settings(opt) == final
    # the real optimizer's rate keeps moving after the skips (the composite schedulers froze)
    assert read[-1] != read[SKIPPED[0]]
    assert [g["lr"] for g in settings(opt)] == list(sched.get_last_lr()) or name == "ds-warmupdecay"
    if name != "ds-warmupdecay":  # DeepSpeed's state_dict() is its step counter alone
        assert _plain(sched.state_dict()) == _plain(state)


def _plain(state):
    """A scheduler state without callables (LambdaLR keeps its lambdas' own dicts)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items() if not callable(v)}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    return state


def _snapshot_tensor_bytes(lr, live) -> int:
    """Bytes of the tensor storages reachable from the bookkeeping's kept undo state, not counting
    the live objects (the optimizer, the schedulers, their parameters and state)."""
    stop = {id(o) for o in live}
    seen, storages, total = set(), set(), 0
    stack = list(gc.get_referents(lr))
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in stop:
            continue
        seen.add(id(o))
        if isinstance(o, (type, types.ModuleType, types.FunctionType, types.CodeType, types.MethodType,
                          types.BuiltinFunctionType, logging.Logger)):
            continue  # code and modules reach everything
        if torch.is_tensor(o):
            st = o.untyped_storage()
            if st.data_ptr() not in storages:
                storages.add(st.data_ptr())
                total += st.nbytes()
            continue
        stack.extend(gc.get_referents(o))
    return total


def _live(opt, sched):
    out = [opt, sched, opt.param_groups, opt.state] + list(getattr(sched, "_schedulers", []))
    for g in opt.param_groups:
        out += g["params"]
        out += [v for v in g.values() if torch.is_tensor(v)]
    for s in opt.state.values():
        out += [v for v in s.values() if torch.is_tensor(v)]
    return out


class _WarmupFactor:
    """A callable LR lambda that keeps the optimizer: LambdaLR's state_dict() holds its ``__dict__``."""

    def __init__(self, opt):
        self.optimizer, self.warmup = opt, 3

    def __call__(self, step):
        return min(1.0, (step + 1) / self.warmup)


UNDO_MEMORY_CASES = {**{n: SCHEDULERS[n] for n in ("sequential", "chained", "onecycle")},
                     "lambda-object": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _WarmupFactor(opt))}


@pytest.mark.parametrize("name", list(UNDO_MEMORY_CASES))
def test_what_a_commit_keeps_for_the_undo_does_not_grow_with_the_optimizer_state(name):
    """The scheduler's state is copied, never the optimizer that its children (or an LR lambda
    object) hold: the same bytes (none: float learning rates) for a model 10x larger."""
    kept = []
    for scale in (1, 10):
        opt = _optimizer(scale)
        sched = UNDO_MEMORY_CASES[name](opt)
        lr = _bookkeeping(opt, sched)
        lr.launched(RoundKind.COMMIT)
        lr.step_owed()
        kept.append(_snapshot_tensor_bytes(lr, _live(opt, sched)))
    assert kept[0] == kept[1] == 0, kept


def test_a_tensor_learning_rate_is_undone_in_place():
    """torch's schedulers write a tensor ``lr`` in place; the undo does too (the group keeps its
    tensor object), and what it keeps is the settings' clones: a few scalars."""
    opt = _optimizer(tensor_lr=True)
    sched = SCHEDULERS["sequential"](opt)
    lr_objects = [g["lr"] for g in opt.param_groups]
    lr = _bookkeeping(opt, sched)
    before = settings(opt)
    lr.launched(RoundKind.COMMIT)
    lr.step_owed()
    assert settings(opt) != before
    assert 0 < _snapshot_tensor_bytes(lr, _live(opt, sched)) <= 64
    lr.collected(True)
    assert settings(opt) == before
    assert all(g["lr"] is o for g, o in zip(opt.param_groups, lr_objects))


def test_the_undo_reverts_exactly_what_the_skipped_step_changed():
    """Between the step and the commit's collection (a phase), the caller's code changes a setting
    the scheduler never writes and overrides a learning rate the step wrote; the undo puts back
    the step's own changes only: the scheduler's state and group 0's rate."""
    opt = _optimizer()
    sched = SCHEDULERS["onecycle"](opt)  # writes lr and betas at every step
    lr = _bookkeeping(opt, sched)
    before = settings(opt)
    lr.launched(RoundKind.COMMIT)
    lr.step_owed()
    stepped = settings(opt)
    assert stepped[0]["betas"] != before[0]["betas"] and stepped[0]["lr"] != before[0]["lr"]
    opt.param_groups[0]["weight_decay"] = 0.5  # e.g. a weight-decay schedule of the caller's
    opt.param_groups[1]["lr"] = 0.123  # the caller's own override, after the step
    lr.collected(True)
    after = settings(opt)
    assert after[0]["weight_decay"] == 0.5 and after[1]["lr"] == 0.123  # theirs stays
    assert after[0]["lr"] == before[0]["lr"] and after[0]["betas"] == before[0]["betas"]
    assert after[1]["betas"] == before[1]["betas"]
    assert sched.last_epoch == 0  # its own state is back
    sched.step()
    assert settings(opt)[0]["lr"] == stepped[0]["lr"]  # and it steps on from there as stock would


class _NoProtocol:
    """A user's scheduler with step() only: its state cannot be saved and loaded."""

    def __init__(self, opt):
        self.optimizer, self.n = opt, 0

    def step(self):
        self.n += 1
        for g in self.optimizer.param_groups:
            g["lr"] = 0.02 / (1 + self.n)


class _Uncopyable(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, opt):
        super().__init__(opt, lambda s: 1.0 / (1.0 + s))
        self.lock = threading.Lock()  # in its state_dict(); deepcopy cannot copy it


@pytest.mark.parametrize("cls", [_NoProtocol, _Uncopyable])
def test_a_scheduler_without_an_undo_is_stepped_when_its_commit_is_known_applied(cls, caplog):
    """No ``state_dict()`` / ``load_state_dict()`` (or a state that cannot be copied): warned once,
    and stepped at the collection of each applied commit, before the next round is launched: every
    round still uses the settings of a scheduler stepped on applied commits only."""
    opt = _optimizer()
    sched = cls(opt)
    with caplog.at_level(logging.WARNING, logger="ds_acco"):
        used, read = _run(_bookkeeping(opt, sched), opt)
    want, _, _ = _reference(cls)
    assert used == want
    assert read == want  # read right after step(): the step is not taken yet (it lags a phase)
    warnings = [r.getMessage() for r in caplog.records if "cannot be undone" in r.getMessage()]
    assert len(warnings) == 1 and cls.__name__ in warnings[0] and "fix" in warnings[0], warnings


def test_a_step_the_caller_takes_for_the_commit_in_flight_is_undone_with_it():
    """Accelerate's scheduler (and so the HF Trainer's) is stepped by the caller right after the
    step() that launched a commit: undone when that commit is skipped, kept when it is applied;
    with no commit in flight, only taken."""
    opt = _optimizer()
    sched = SCHEDULERS["sequential"](opt)
    lr = LRBookkeeping(lambda: pytest.fail("no scheduler to step"), lambda: None, lambda: opt)  # the engine owns none
    lr.caller_step(sched, sched.step)  # before any commit
    used = []
    for t in range(STEPS):
        used.append(settings(opt))
        lr.launched(RoundKind.COMMIT)
        lr.caller_step(sched, sched.step)
        lr.collected(t in SKIPPED)
    want, final, _ = _reference(SCHEDULERS["sequential"], steps_before=1)
    assert used == want
    assert settings(opt) == final


INCREMENT = 32  # Megatron's step(increment=...): samples per iteration


def _megatron_step(sched, inverse=True):
    """The DeepSpeed adapter's step under Megatron's protocol: step(increment=n), returning its
    inverse step(increment=-n) (``inverse``) or nothing."""
    def step():
        sched.step(increment=INCREMENT)
        return (lambda: sched.step(increment=-INCREMENT)) if inverse else None
    return step


def _megatron_reference(skipped):
    opt = _optimizer()
    sched = MegatronLikeScheduler(opt)
    used = []
    for t in range(STEPS):
        used.append(settings(opt))
        if t not in skipped:
            sched.step(increment=INCREMENT)
    return used, sched.num_steps


def test_a_load_that_does_not_restore_is_found_on_a_copy_and_the_inverse_step_is_used(caplog):
    """Megatron's load_state_dict() adds the loaded step count to the current one: loading the
    state from before a step would double the count. Tried on a copy of the scheduler first (the
    real one and the param groups untouched), it is not used; the adapter's inverse step is."""
    opt = _optimizer()
    sched = MegatronLikeScheduler(opt)
    lr = LRBookkeeping(_megatron_step(sched), lambda: sched, lambda: opt)
    with caplog.at_level(logging.WARNING, logger="ds_acco"):
        used, read = _run(lr, opt)
    want, num_steps = _megatron_reference(SKIPPED)
    assert used == want  # lr and weight_decay of every group, bit for bit
    assert sched.num_steps == num_steps
    assert not [r for r in caplog.records if "cannot be undone" in r.getMessage()]
    assert not load_restores(sched, opt, {**sched.state_dict(), "num_steps": 0})
    torch_sched = SCHEDULERS["sequential"](opt)
    before = copied_state(torch_sched, opt)
    torch_sched.step()
    assert load_restores(torch_sched, opt, before)


def test_a_load_that_does_not_restore_without_an_inverse_is_warned_and_deferred(caplog):
    """No inverse either: the first skipped commit's step stays (one warning says the schedule runs
    one step ahead from there), and from then on the scheduler is stepped only once a commit is
    known applied, so later skips cost nothing more."""
    opt = _optimizer()
    sched = MegatronLikeScheduler(opt)
    lr = LRBookkeeping(_megatron_step(sched, inverse=False), lambda: sched, lambda: opt)
    with caplog.at_level(logging.WARNING, logger="ds_acco"):
        used, _ = _run(lr, opt)
    want, num_steps = _megatron_reference(SKIPPED[1:])  # the first skip is not undone
    assert used == want and sched.num_steps == num_steps
    warnings = [r.getMessage() for r in caplog.records if "cannot be undone" in r.getMessage()]
    assert len(warnings) == 1 and "MegatronLikeScheduler" in warnings[0] and "one step ahead" in warnings[0]


def test_capture_settings_is_what_the_undo_compares():
    """The undo compares captured settings (tensors cloned): a capture shares no tensor with the groups."""
    opt = _optimizer(tensor_lr=True)
    captured = capture_settings(opt)
    assert all(c["lr"] is not g["lr"] and torch.equal(c["lr"], g["lr"]) for c, g in zip(captured, opt.param_groups))
