"""An independent single-process reference of ACCO.md's recurrences ("The exact schedule in
fixed mode"), in float64, sharing no code with ds_acco.

It simulates ``world`` ranks feeding micro-batches ``m_0, m_1, ...`` (``batch(rank, i)``) and
returns θ_T for mode 'sync' (stock ZeRO-1), 'acco' or 'dpu'. The estimate uses a deep copy
of the model and optimizer, so the discarded state cannot leak back.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch

# The estimate's learning-rate factor: the library's defaults (the look-ahead estimate, docs/estimate.md: 2, and
# 1.5 under SGD), written here on their own, not imported (a test checks they agree), and the paper's.
DEFAULT_LR_SCALE = 2.0
SGD_LR_SCALE = 1.5
PAPER_LR_SCALE = 1.0


def default_lr_scale(opt: torch.optim.Optimizer) -> float:
    """The library's default lr_scale for ``opt`` where the test's block sets none: SGD's, or the
    look-ahead's (the normalised family's tests set theirs)."""
    return SGD_LR_SCALE if isinstance(opt, torch.optim.SGD) else DEFAULT_LR_SCALE


def _global_mean_grad(model: torch.nn.Module, params: Dict[str, torch.Tensor], batches) -> Dict[str, torch.Tensor]:
    """Mean over ``batches`` of the gradient of ``model(*batch)`` at ``params``."""
    work = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in work.named_parameters():
            p.copy_(params[n])
    total = {n: torch.zeros_like(p) for n, p in work.named_parameters()}
    for batch in batches:
        work.zero_grad(set_to_none=True)
        loss = work(*[b.double() for b in batch])
        loss.backward()
        for n, p in work.named_parameters():
            total[n] += p.grad
    return {n: g / len(batches) for n, g in total.items()}


class _Trainer:
    """θ and S of the reference, with ``Opt(θ, S, g)`` kept or discarded."""

    def __init__(self, model, make_optimizer, make_scheduler, clip):
        self.model = copy.deepcopy(model).double()
        self.opt = make_optimizer(self.model)
        self.sched = make_scheduler(self.opt) if make_scheduler else None
        self.clip = clip

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _apply(self, model, opt, grads, lr_factor=1.0):
        if self.clip > 0:
            norm = torch.sqrt(sum((g.double()**2).sum() for g in grads.values()))
            factor = max(1.0, (float(norm) + 1e-6) / self.clip)
            grads = {n: g / factor for n, g in grads.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * lr_factor
        opt.step()
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr

    def commit(self, grads, lr_factor=1.0):
        self._apply(self.model, self.opt, grads, lr_factor)
        if self.sched is not None:
            self.sched.step()

    def estimate(self, grads, lr_factor=1.0, committed_second_moment=False):
        if committed_second_moment and self.opt.state:
            return self._estimate_committed_v(grads, lr_factor)
        model, opt = copy.deepcopy((self.model, self.opt))
        self._apply(model, opt, grads, lr_factor)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def _estimate_committed_v(self, grads, lr_factor):
        """Adam / AdamW's step written out, with v̂ = v_t / (1 - β2^t) (the committed second
        moment, not updated) and m updated as usual (docs/estimate.md)."""
        if self.clip > 0:
            norm = torch.sqrt(sum((g.double()**2).sum() for g in grads.values()))
            factor = max(1.0, (float(norm) + 1e-6) / self.clip)
            grads = {n: g / factor for n, g in grads.items()}
        decoupled = isinstance(self.opt, torch.optim.AdamW)
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        out = self.params()
        for group in self.opt.param_groups:
            lr, (b1, b2), eps, wd = group["lr"] * lr_factor, group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                n = name_of[id(p)]
                st = self.opt.state[p]
                t = int(st["step"])
                theta, g = p.detach().clone(), grads[n].clone()
                if decoupled:
                    theta = theta * (1 - lr * wd)
                elif wd:
                    g = g + wd * p.detach()
                m = b1 * st["exp_avg"] + (1 - b1) * g
                v = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
                denom = v.sqrt() / (1 - b2 ** t) ** 0.5 + eps
                out[n] = theta - lr / (1 - b1 ** (t + 1)) * m / denom
        return out

    def delay_compensated(self, g_first, theta, est, lam):
        """DC-ASGD-a on the first-half mean gradient: g + λ g ⊙ g ⊙ (θ_t − θ̃_t) / (√v̂_t + ε), v̂_t the
        committed Adam second moment bias-corrected for t steps; unchanged before the first commit."""
        if not lam or not self.opt.state:
            return g_first
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        out = dict(g_first)
        for group in self.opt.param_groups:
            b2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                n, st = name_of[id(p)], self.opt.state[p]
                vhat = st["exp_avg_sq"] / (1 - b2 ** int(st["step"]))
                out[n] = g_first[n] + lam * g_first[n] * g_first[n] * (theta[n] - est[n]) / (vhat.sqrt() + eps)
        return out


def reference_run(model: torch.nn.Module, batch: Callable[[int, int], tuple], *, world: int, gas: int, steps: int,
                  mode: str, make_optimizer: Callable, make_scheduler: Optional[Callable] = None,
                  clip: float = 0.0, estimate_log: Optional[List] = None,
                  skip_estimate=(), skip_commit=(), stock_steps_first: int = 0,
                  lr_scale: Optional[float] = None, committed_second_moment: bool = False,
                  delay_compensation: float = 0.0, sync_warmup_steps: int = 0,
                  sum_ranks: bool = False) -> Dict[str, torch.Tensor]:
    """θ_T after ``steps`` optimizer steps of ``gas`` micro-batches per rank.

    The estimate variants of mode 'acco' (docs/estimate.md): ``lr_scale`` (the estimate's learning
    rate × this; default the library's for the optimizer, :func:`default_lr_scale`, PAPER_LR_SCALE = 1 for the paper's estimate), ``committed_second_moment`` (Adam's v̂ from the committed state), ``delay_compensation``
    (λ of the commit's DC-ASGD-a term), ``sync_warmup_steps`` (the first that many steps are stock's,
    then ACCO bootstraps from there: θ̃ = θ). ``sum_ranks``: every gradient is the ranks' sum of their
    mean gradients (DeepSpeed's ``gradient_allreduce_op: "sum"``), world × the global mean.

    ``skip_estimate`` / ``skip_commit``: steps whose round had a non-finite gradient: the
    estimate falls back to θ_t; the commit leaves θ, S and the LR schedule unchanged.
    ``stock_steps_first``: first that many stock (synchronous) steps on the first micro-batches,
    then ``steps`` steps of ``mode`` from there (a fresh bootstrap at those θ, S and LR schedule)
    on the micro-batches that follow: a stock ZeRO-1 checkpoint resumed under ``mode``.
    """
    tr = _Trainer(model, make_optimizer, make_scheduler, clip)
    lr_scale = default_lr_scale(tr.opt) if lr_scale is None else lr_scale

    def _mean_grad(model, params, batches):  # the reduction: the mean over every rank, or world x it
        grads = _global_mean_grad(model, params, batches)
        return {n: g * world for n, g in grads.items()} if sum_ranks else grads
    first = gas * stock_steps_first  # micro-batch index where ``mode`` starts

    def mb(t, lo, hi):  # micro-batches lo..hi-1 of step t, all ranks
        return [batch(r, first + gas * t + i) for r in range(world) for i in range(lo, hi)]

    for t in range(stock_steps_first):
        tr.commit(_mean_grad(tr.model, tr.params(), [batch(r, gas * t + i) for r in range(world) for i in range(gas)]))

    if mode == "sync":  # stock ZeRO-1: one step per ``gas`` micro-batches, at the current θ, no delay
        for t in range(steps):
            grads = _mean_grad(tr.model, tr.params(), mb(t, 0, gas))
            if t not in skip_commit:
                tr.commit(grads)
        return tr.params()
    if mode == "acco":
        h = gas // 2
        est = tr.params()  # θ̃_0 = θ_0
        for t in range(steps):
            theta = tr.params()
            if t < sync_warmup_steps:  # stock's step; ACCO then starts here with θ̃ = θ
                grads = _mean_grad(tr.model, theta, mb(t, 0, gas))
                if t not in skip_commit:
                    tr.commit(grads)
                est = tr.params()
                continue
            g_first = _mean_grad(tr.model, est, mb(t, 0, h))  # at θ̃_t
            g_second = _mean_grad(tr.model, theta, mb(t, h, gas))  # at θ_t
            comp = tr.delay_compensated(g_first, theta, est, delay_compensation)
            # θ̃_{t+1}, S discarded
            est = theta if t in skip_estimate else tr.estimate(g_first, lr_scale, committed_second_moment)
            if estimate_log is not None:
                estimate_log.append(est)
            if t not in skip_commit:
                tr.commit({n: (comp[n] + g_second[n]) / 2 for n in g_first})  # pooled: equal counts per half
        return tr.params()
    if mode == "dpu":
        history = [tr.params()]  # θ_0, θ_1, ...
        for t in range(steps):
            at = history[max(t - 1, 0)]  # phase 0 and 1 at θ_0; phase k ≥ 1 at θ_{k-1}
            if t not in skip_commit:
                tr.commit(_mean_grad(tr.model, at, mb(t, 0, gas)))
            history.append(tr.params())
        return tr.params()
    raise ValueError(mode)


# The schedules a run could have followed: its own mode must be clearly the nearest. 'acco-no-estimate'
# is ACCO with θ̃_{t+1} = θ_t (the estimate dropped): the first halves computed at the committed θ.
REFERENCE_MODES = ("acco", "acco-no-estimate", "dpu", "sync")


def rel_distance(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    """‖got − want‖ / ‖want‖ over all parameters, in float64."""
    num = sum(float(((got[n].double() - want[n].double()) ** 2).sum()) for n in want)
    den = sum(float((want[n].double() ** 2).sum()) for n in want)
    return (num / den) ** 0.5


def mode_references(model, batch, *, steps: int, skip_estimate=(), skip_commit=(), **kwargs):
    """θ_T of every schedule in REFERENCE_MODES on the same data (kwargs as for reference_run)."""
    out = {}
    for mode in REFERENCE_MODES:
        if mode == "acco-no-estimate":
            out[mode] = reference_run(model, batch, steps=steps, mode="acco", skip_estimate=range(steps),
                                      skip_commit=skip_commit, **kwargs)
        else:
            out[mode] = reference_run(model, batch, steps=steps, mode=mode, skip_commit=skip_commit,
                                      skip_estimate=skip_estimate if mode == "acco" else (), **kwargs)
    return out


def nearest_own_reference(final: Dict[str, torch.Tensor], refs: Dict[str, Dict[str, torch.Tensor]], own: str,
                          margin: float = 0.5, label: str = "") -> Dict[str, float]:
    """Distances of ``final`` to every reference; asserts the one of mode ``own`` is below
    ``margin`` times the nearest other one (a run that lost its mode's distinguishing feature,
    e.g. the estimate, lands nearer another schedule or in between). Prints the distances."""
    dist = {mode: rel_distance(final, ref) for mode, ref in refs.items()}
    others = {m: d for m, d in dist.items() if m != own}
    nearest = min(others, key=others.get)
    print(f"{label}: relative distance to the float64 references: "
          + ", ".join(f"{m} {d:.2e}" for m, d in dist.items())
          + f" (own/nearest other = {dist[own] / others[nearest]:.2f})")
    assert dist[own] < margin * others[nearest], (
        f"{label}: distance to its own ({own}) reference {dist[own]:.2e} is not below {margin} x the distance to "
        f"the nearest other schedule ({nearest}: {others[nearest]:.2e}); all: "
        + ", ".join(f"{m} {d:.2e}" for m, d in dist.items()))
    return dist


def _grad_sum(model, params, batches, weight):
    """(Σ gradients of model(*batch) at params, Σ weights) over ``batches``."""
    work = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in work.named_parameters():
            p.copy_(params[n])
    total = {n: torch.zeros_like(p) for n, p in work.named_parameters()}
    w = 0.0
    for b in batches:
        work.zero_grad(set_to_none=True)
        work(*[t.double() for t in b]).backward()
        for n, p in work.named_parameters():
            total[n] += p.grad
        w += weight(b)
    return total, w


def reference_replay(model: torch.nn.Module, batch: Callable[[int, int], tuple], *, phases_per_rank: List[List[int]],
                     steps: int, mode: str, make_optimizer: Callable, make_scheduler: Optional[Callable] = None,
                     clip: float = 0.0, weight: Optional[Callable] = None, lr_power: float = 0.0,
                     nominal_phase: int = 1, lr_scale: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """θ_T given how many micro-batches every phase of every rank had (phase 0 first).

    ``lr_power``: each update's learning rate × (its micro-batches, all ranks / the fixed-mode
    count: ``nominal_phase`` micro-batches per rank per phase) ** lr_power; an estimate's also ×
    ``lr_scale`` (as in :func:`reference_run`).

    Rank r's phase p consumes its next ``phases_per_rank[r][p]`` micro-batches. Gradients are
    summed and divided by the global weight (``weight(batch)``, default 1 per micro-batch).
    ACCO: step t's first half is phase 2t (at θ̃_t), its second half phase 2t+1 (at θ_t).
    DPU: step k is phase k, computed at θ_{max(k-1, 0)}.
    """
    weight = weight or (lambda b: 1.0)
    tr = _Trainer(model.double(), make_optimizer, make_scheduler, clip)
    lr_scale = default_lr_scale(tr.opt) if lr_scale is None else lr_scale
    starts = [[sum(counts[:p]) for p in range(len(counts))] for counts in phases_per_rank]

    def phase(p):
        return [batch(r, i) for r, counts in enumerate(phases_per_rank) for i in
                range(starts[r][p], starts[r][p] + counts[p])]

    def lr_factor(*phases):
        count = sum(counts[p] for counts in phases_per_rank for p in phases)
        return (count / (nominal_phase * len(phases_per_rank) * len(phases))) ** lr_power

    if mode == "acco":
        est = tr.params()
        for t in range(steps):
            theta = tr.params()
            g1, w1 = _grad_sum(tr.model, est, phase(2 * t), weight)
            g2, w2 = _grad_sum(tr.model, theta, phase(2 * t + 1), weight)
            est = tr.estimate({n: g / w1 for n, g in g1.items()}, lr_factor(2 * t) * lr_scale)
            tr.commit({n: (g1[n] + g2[n]) / (w1 + w2) for n in g1}, lr_factor(2 * t, 2 * t + 1))
        return tr.params()
    if mode == "dpu":
        history = [tr.params()]
        for k in range(steps):
            g, w = _grad_sum(tr.model, history[max(k - 1, 0)], phase(k), weight)
            tr.commit({n: v / w for n, v in g.items()}, lr_factor(k))
            history.append(tr.params())
        return tr.params()
    raise ValueError(mode)


def replay_scales(skipped_flags, **args) -> List[float]:
    """DeepSpeed's dynamic loss scaler fed the same per-step overflow flags: the scale after each step."""
    from unittest import mock
    from deepspeed.runtime.fp16 import loss_scaler
    scaler = loss_scaler.DynamicLossScaler(**args)
    out = []
    with mock.patch.object(loss_scaler.dist, "get_rank", return_value=1):  # its log line asks for a rank
        for flag in skipped_flags:
            scaler.update_scale(flag)
            out.append(scaler.cur_scale)
    return out


def check_real_fp16(run: dict, model: torch.nn.Module, batch: Callable[[int, int], tuple], *, world: int, gas: int,
                    steps: int, fp16: dict, make_optimizer: Callable, label: str = "fp16") -> float:
    """Assert that a real fp16 ACCO run (tests/deepspeed/workers.py's or fsdp_workers.py's result; DeepSpeed's
    ``fp16`` block ``fp16`` with a scale that overflows first) skipped its overflowing steps, moved its
    loss scale as DeepSpeed's scaler does, and ended nearest to ACCO's float64 θ_T with the same skips,
    within fp16's error. Returns the relative error."""
    import math
    flags = [m["skipped"] for m in run["metrics"]]
    args = {"init_scale": 2.0 ** fp16["initial_scale_power"], "scale_window": fp16["loss_scale_window"],
            "min_scale": fp16["min_loss_scale"], "delayed_shift": fp16["hysteresis"], "consecutive_hysteresis": False}
    scales = [m["loss_scale"] for m in run["metrics"]]
    assert scales == replay_scales(flags, **args), f"{label}: loss scales {scales} are not DeepSpeed's for {flags}"
    skipped_commits = tuple(m["step"] - 1 for m in run["metrics"] if m["skipped"])
    assert 1 <= len(skipped_commits) < steps and run["skipped_steps"] == len(skipped_commits), \
        f"{label}: skipped commits {skipped_commits}, skipped_steps {run['skipped_steps']}"
    assert flags.count(False) >= steps // 2, f"{label}: the scale never came down to one that fits fp16: {flags}"
    skipped_estimates = tuple(step for (kind, step), skipped in run["rounds"] if kind == "estimate" and skipped)
    assert all(torch.isfinite(t).all() for t in run["final"].values()), f"{label}: non-finite weights"
    want = reference_run(model, batch, world=world, gas=gas, steps=steps, mode="acco",
                         make_optimizer=make_optimizer, skip_estimate=skipped_estimates, skip_commit=skipped_commits)
    # 5e-3 alone would not tell ACCO from stock ZeRO-1 (7.5e-3 apart on the tests' problem): the committed
    # fp32 master must be clearly nearest to ACCO's θ_T, every reference taking the same skipped steps.
    refs = mode_references(model, batch, world=world, gas=gas, steps=steps, make_optimizer=make_optimizer,
                           skip_estimate=skipped_estimates, skip_commit=skipped_commits)
    nearest_own_reference(run["final_fp32"], refs, "acco", label=label)
    num = math.sqrt(sum(float((run["final"][n].double() - want[n]).pow(2).sum()) for n in want))
    den = math.sqrt(sum(float(want[n].pow(2).sum()) for n in want))
    # fp16 compute: ~1e-3 relative; an unscaled or mixed-scale update would be off by factors of 2
    assert num / den < 5e-3, f"{label}: relative error {num / den:.2e} vs the reference (skipped commits " \
                             f"{skipped_commits}, estimates {skipped_estimates})"
    print(f"{label}: skipped commits {skipped_commits}, estimates {skipped_estimates}, scales {scales}, "
          f"rel. error vs reference {num / den:.2e}")
    return num / den
