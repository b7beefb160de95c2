"""Dynamic accumulation's learning-rate rule: the factor a round applies and how a step uses it
(the end-to-end schedule is replayed against the reference in tests/deepspeed/test_dynamic.py)."""
import pytest
import torch

from ds_acco.core.round.rounds import RoundContext, RoundKind
from ds_acco.core.step.shard_optimizer import ShardOptimizer


def _ctx(power):
    return RoundContext(groups=[], shard_optimizer=None, process_group=None, rank=0, world=2, gas_scale=0.25,
                        clip_grad=0.0, nonfinite="skip", reduce_scatter=False, drift_every=0, chunk_elems=1024,
                        lr_power=power, nominal_phase_micro_batches=4, commit_phases=2)


def test_factor_compares_each_round_with_what_fixed_accumulation_gives_it():
    sqrt, linear = _ctx(0.5), _ctx(1.0)
    assert linear.lr_factor(RoundKind.ESTIMATE, 4) == 1.0  # one phase of 2 ranks x 2
    assert linear.lr_factor(RoundKind.COMMIT, 8) == 1.0  # a commit sums both phases
    assert linear.lr_factor(RoundKind.COMMIT, 24) == 3.0
    assert sqrt.lr_factor(RoundKind.ESTIMATE, 16) == 2.0
    assert _ctx(0.0).lr_factor(RoundKind.COMMIT, 24) == 1.0


def _shards(kind, lr):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(77))]
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.1) if kind == "adamw"
           else torch.optim.SGD(params, lr=lr, momentum=0.9) if kind == "sgd" else torch.optim.RMSprop(params, lr=lr))
    return params, opt


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_a_scaled_step_is_the_step_at_the_scaled_rate_and_leaves_the_groups_rate(kind):
    """Functional steps (AdamW, SGD) read lr × scale; RMSprop (no functional step) takes its real step
    on the round's own copies of the groups. Neither writes the group: both are bit-identical to a
    step of an optimizer built with the scaled rate."""
    grads = [torch.randn(300), torch.randn(77)]
    params, opt = _shards(kind, 0.01)
    ref_params, ref_opt = _shards(kind, 0.04)  # 0.01 x 4, exactly
    shard, ref = ShardOptimizer(opt, params, chunk_elems=64), ShardOptimizer(ref_opt, ref_params, chunk_elems=64)
    lr_object = opt.param_groups[0]["lr"]
    for _ in range(2):  # the second commit has optimizer state
        outs, ref_outs = [torch.empty(300), torch.empty(77)], [torch.empty(300), torch.empty(77)]
        shard.estimate_into(grads, outs, lr_scale=4.0)
        ref.estimate_into(grads, ref_outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
        shard.commit([g.clone() for g in grads], lr_scale=4.0)
        ref.commit([g.clone() for g in grads])
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
        assert opt.param_groups[0]["lr"] is lr_object  # never written: another thread may read or write it


class _ReadsLrOnce(torch.optim.RMSprop):
    """RMSprop whose step notes the rate the live group holds while it runs (what another thread sees)."""

    def step(self, closure=None):
        self.live_lrs.append(_lr_value(self.__dict__["param_groups"][0]["lr"]))
        return super().step(closure)


def _lr_value(lr):
    return float(lr) if not torch.is_tensor(lr) else lr.item()


@pytest.mark.parametrize("name", ["rmsprop", "rmsprop-subclass", "adam", "adamw", "adagrad"])
def test_a_tensor_rate_is_scaled_out_of_place_for_a_real_step(name):
    """A tensor learning rate (no functional step: the snapshot's real step) takes × lr_scale without the
    caller's tensor or group being written, before, during (as seen by the step itself) or after."""
    make = {"rmsprop": torch.optim.RMSprop, "rmsprop-subclass": _ReadsLrOnce, "adam": torch.optim.Adam,
            "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}[name]
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(30))]
    ref_params = [torch.nn.Parameter(params[0].detach().clone())]
    lr = torch.tensor(0.01)
    opt, ref_opt = make(params, lr=lr), make(ref_params, lr=torch.tensor(0.02))
    opt.live_lrs, ref_opt.live_lrs = [], []
    shard, ref = ShardOptimizer(opt, params), ShardOptimizer(ref_opt, ref_params)
    assert not shard.functional
    for _ in range(2):
        grads = [torch.randn(30)]
        outs, ref_outs = [torch.empty(30)], [torch.empty(30)]
        shard.estimate_into(grads, outs, lr_scale=2.0, settings=shard.settings())
        ref.estimate_into(grads, ref_outs)
        assert torch.equal(outs[0], ref_outs[0])
        assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, torch.tensor(0.01))
        shard.commit([g.clone() for g in grads], lr_scale=2.0)
        ref.commit([g.clone() for g in grads])
        assert torch.equal(params[0], ref_params[0])
    if name == "rmsprop-subclass":
        assert opt.live_lrs and set(opt.live_lrs) == {lr.item()}, opt.live_lrs


def test_a_group_without_a_rate_cannot_be_scaled():
    """An optimizer that computes its own rate (lr None) with lr_scale ≠ 1: refused naming the keys."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["lr"] = None
    with pytest.raises(ValueError, match=r"lr = None.*acco\.estimate\.lr_scale.*fix:"):
        ShardOptimizer(opt, [p]).estimate_into([torch.ones(2)], [torch.empty(2)], lr_scale=2.0)


class _Wrapper(torch.optim.Optimizer):
    """Steps an inner optimizer whose groups it shares (a Lookahead-style wrapper): its step never
    reads ``self.param_groups``, so a round's own settings would not reach it."""

    def __init__(self, inner):
        self.inner, self.param_groups, self.state, self.defaults = inner, inner.param_groups, inner.state, {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_step_that_ignores_the_rounds_groups_is_refused_not_run_at_the_wrong_rate():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = _Wrapper(torch.optim.RMSprop([p], lr=0.1))
    shard = ShardOptimizer(opt, [p])
    out = [torch.empty(3)]
    shard.estimate_into([torch.ones(3)], out)  # lr × 1, the groups' own: nothing to refuse
    with pytest.raises(ValueError, match="does not read the learning rate.*fix:"):
        shard.estimate_into([torch.ones(3)], out, lr_scale=2.0)
    assert torch.equal(p.detach(), torch.zeros(3)) and opt.param_groups[0]["lr"] == 0.1


def test_an_instance_step_override_runs_only_with_the_groups_own_settings():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.RMSprop([p], lr=0.1)
    calls, real = [], opt.step
    opt.step = lambda *a, **k: (calls.append(opt.param_groups[0]["lr"]), real(*a, **k))[1]
    shard = ShardOptimizer(opt, [p])
    shard.commit([torch.ones(3)])
    assert calls == [0.1]
    with pytest.raises(ValueError, match="overridden on the instance.*fix:"):
        shard.estimate_into([torch.ones(3)], [torch.empty(3)], lr_scale=2.0)
    assert calls == [0.1] and opt.param_groups[0]["lr"] == 0.1


def test_a_wrapper_is_refused_before_its_first_commit_changes_anything():
    """An optimizer not known to read its groups is probed on a discarded step before the first commit that
    takes a round's own settings: refused with θ, the state and the live rate as they were."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = _Wrapper(torch.optim.RMSprop([p], lr=0.1))
    shard = ShardOptimizer(opt, [p])
    for lr_scale in (2.0, 1.0):  # a scaled rate, or only the settings captured at launch (a scheduler may step)
        with pytest.raises(ValueError, match="does not read the learning rate.*fix:"):
            shard.commit([torch.ones(3)], lr_scale=lr_scale, settings=shard.settings())
        assert torch.equal(p.detach(), torch.zeros(3)) and not opt.state and opt.param_groups[0]["lr"] == 0.1


def test_an_instance_override_is_refused_at_the_first_round_whatever_the_rates():
    """Refused because the round's settings can differ from the live ones, not when they happen to."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.RMSprop([p], lr=0.1)
    real = opt.step
    opt.step = lambda *a, **k: real(*a, **k)
    shard = ShardOptimizer(opt, [p])
    with pytest.raises(ValueError, match="overridden on the instance.*fix:"):
        shard.commit([torch.ones(3)], settings=shard.settings())
    assert torch.equal(p.detach(), torch.zeros(3)) and not opt.state


class _HeavyBall(torch.optim.Optimizer):
    """A user-defined optimizer (not torch's: probed) reading its group as a whole, one way per ``how``."""

    def __init__(self, params, lr, how):
        super().__init__(params, {"lr": lr, "momentum": 0.5})
        self.how = how

    def step(self, closure=None):
        for group in self.param_groups:
            h = {"dict": lambda: dict(group), "splat": lambda: {**group}, "kwargs": lambda: (lambda **k: k)(**group),
                 "items": lambda: {k: v for k, v in group.items()}, "copy": lambda: group.copy()}[self.how]()
            for p in h["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(h["momentum"]).add_(p.grad)
                p.data.add_(buf, alpha=-h["lr"])


@pytest.mark.parametrize("how", ["dict", "splat", "kwargs", "items", "copy"])
def test_a_step_reading_its_group_whole_takes_the_rounds_rate_and_is_not_refused(how):
    p, ref_p = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt, ref = _HeavyBall([p], 0.1, how), _HeavyBall([ref_p], 0.2, how)
    shard, ref_shard = ShardOptimizer(opt, [p]), ShardOptimizer(ref, [ref_p])
    for _ in range(2):
        shard.commit([torch.ones(3)], lr_scale=2.0, settings=shard.settings())
        ref_shard.commit([torch.ones(3)])
        assert torch.equal(p, ref_p) and opt.param_groups[0]["lr"] == 0.1


class _Counts(torch.optim.RMSprop):
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"].add_(1)  # in place, as a step may update a tensor setting
        return super().step(closure)


def test_a_tensor_setting_a_kept_step_updates_in_place_is_kept():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = _Counts([p], lr=0.1)
    count = opt.param_groups[0]["count"] = torch.tensor(0)
    shard = ShardOptimizer(opt, [p])
    for _ in range(3):
        shard.estimate_into([torch.ones(3)], [torch.empty(3)], lr_scale=2.0, settings=shard.settings())
        shard.commit([torch.ones(3)], settings=shard.settings())
    assert opt.param_groups[0]["count"] is count and count.item() == 3  # the estimates' are dropped


def test_a_round_view_resolves_each_attribute_once(monkeypatch):
    """A step reads ``self.state`` once per parameter: the view's lookup must not grow with them."""
    import inspect
    from ds_acco.core.step import shard_optimizer
    calls = []
    real = inspect.getattr_static
    monkeypatch.setattr(shard_optimizer.inspect, "getattr_static", lambda *a: (calls.append(a[1]), real(*a))[1])
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(200)]
    shard = ShardOptimizer(torch.optim.Adagrad(params, lr=0.1, foreach=False), params)
    shard.commit([torch.ones(2) for _ in params], lr_scale=2.0)
    assert calls and len(calls) == len(set(calls)) < 50, len(calls)


@pytest.mark.parametrize("kind", ["torch", "transformers"])
def test_an_adafactor_estimate_is_adafactors_step_at_the_scaled_rate_on_the_same_shard(kind):
    """Adafactor (no functional step; its update depends on the shard's shape and norm) on one flat shard:
    an estimate round at lr × 2 gives what a copy of the optimizer stepped at lr × 2 gives, bit for bit,
    after commits at lr (with state), and the live groups keep lr."""
    import copy
    if kind == "torch":
        make = lambda ps: torch.optim.Adafactor(ps, lr=0.01)  # noqa: E731
    else:
        from transformers.optimization import Adafactor
        make = lambda ps: Adafactor(ps, lr=0.01, relative_step=False, scale_parameter=False,  # noqa: E731
                                    warmup_init=False)
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(300))]
    opt = make(params)
    shard = ShardOptimizer(opt, params)
    assert not shard.functional
    for _ in range(3):
        grads = [torch.randn(300)]
        ref = copy.deepcopy(opt)
        ref.param_groups[0]["lr"] = 0.02
        ref_params = ref.param_groups[0]["params"]
        ref_params[0].grad = grads[0].clone()
        ref.step()
        outs = [torch.empty(300)]
        shard.estimate_into(grads, outs, lr_scale=2.0, settings=shard.settings())
        assert torch.equal(outs[0], ref_params[0].detach()) and not torch.equal(outs[0], params[0].detach())
        assert opt.param_groups[0]["lr"] == 0.01
        shard.commit([torch.randn(300)], settings=shard.settings())
