"""DeepSpeed's Adams (DeepSpeedCPUAdam, FusedAdam) take the settings captured at a round's launch,
whatever a scheduler writes on the compute thread while the round runs.

Accelerate and the HF Trainer step their scheduler right after the ``step()`` that launched a
commit, while the commit runs on the lane. Torch's SGD/Adam/AdamW steps are functional there
(they read the captured settings); DeepSpeed's Adams take their real step, which reads
``self.param_groups`` -- parameter by parameter (DeepSpeedCPUAdam) or group by group (FusedAdam).
Here the round is held inside its first kernel call, on the lane's thread, until the compute
thread has stepped the scheduler (the worst timing, made deterministic); the round must give
exactly the parameters of a real step at the launch's rate, taken without any scheduler step in
between, and the scheduler's own write must survive the round.

Both ops run on CPU: DeepSpeedCPUAdam's AVX op, and FusedAdam's CPU op (DeepSpeed's CPU accelerator
builds ``csrc/cpu/adam/fused_adam.cpp``; its CUDA op needs a GPU). Each case runs in a fresh process:
the C++ optimizers keep process-wide state.
"""
import threading

import pytest
import torch

from dist import run_ranks
from ds_ops import op_unavailable
from timeouts import scaled

SIZES = (1031, 37, 5)
STEPS = 3
OPS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder"}


class _HeldFirstCall:
    """Wraps a kernel: the first call of each round signals ``entered`` and waits for ``release``
    (the compute thread steps its scheduler meanwhile), then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.entered, self.release, self.armed = kernel, threading.Event(), threading.Event(), False

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            self.entered.set()
            if not self.release.wait(scaled(60)):
                raise TimeoutError("the compute thread never released the round")
        return self.kernel(*args)

    def arm(self):
        self.entered.clear()
        self.release.clear()
        self.armed = True


class _CpuAdamOp:
    """DeepSpeedCPUAdam's op module with its ``adam_update`` held (the other entries unchanged)."""

    def __init__(self, op):
        self._op, self.adam_update = op, _HeldFirstCall(op.adam_update)

    def __getattr__(self, name):
        return getattr(self._op, name)


def _build(op):
    torch.manual_seed(3)
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]  # two params: read twice per group
    if op == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(groups, lr=0.01, weight_decay=0.1)
    else:
        from deepspeed.ops.adam import FusedAdam
        opt = FusedAdam(groups, lr=0.01, weight_decay=0.1)
    # halves the rate at every step: a step at the next step's rate is far from right
    return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)


def _hold(opt, op) -> _HeldFirstCall:
    if op == "cpu_adam":
        opt.ds_opt_adam = _CpuAdamOp(opt.ds_opt_adam)
        return opt.ds_opt_adam.adam_update
    opt.multi_tensor_adam = _HeldFirstCall(opt.multi_tensor_adam)
    return opt.multi_tensor_adam


def _settings(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _case(op, round_kind):
    reason = op_unavailable(OPS[op])
    if reason is not None:
        return reason
    import ds_acco.deepspeed.functional  # noqa: F401 -- the DeepSpeed adapter registers its Adams with the core
    from ds_acco.comm.lane import CommLane
    from ds_acco.core.step.shard_optimizer import ShardOptimizer
    params, opt, sched = _build(op)
    ref_params, ref_opt, ref_sched = _build(op)
    shard = ShardOptimizer(opt, params)
    if round_kind == "estimate" and shard.functional:
        return f"{op}'s estimate is functional here: it never reads the param groups"
    held = _hold(opt, op)
    lane = CommLane(timeout_s=scaled(60))
    try:
        for step in range(STEPS):
            grads = [torch.randn(n) for n in SIZES]
            outs = [torch.empty(n) for n in SIZES]
            settings = shard.settings()  # at the launch, on the compute thread
            held.arm()
            if round_kind == "commit":
                handle = lane.submit("commit", lambda: shard.commit([g.clone() for g in grads], settings=settings))
            else:
                handle = lane.submit("estimate", lambda: shard.estimate_into(grads, outs, settings=settings))
            assert held.entered.wait(scaled(60)), "the round never reached the optimizer's kernel"
            sched.step()  # the caller's scheduler, on the compute thread, while the round is inside its step
            stepped = _settings(opt)
            held.release.set()
            lane.wait(handle)
            kept = _settings(opt)
            assert [{k: g[k] for k in s} for g, s in zip(kept, stepped)] == stepped, \
                "the round changed the settings the scheduler wrote"
            for p, g in zip(ref_params, grads):  # stock: the optimizer's own step, nothing written in between
                p.grad = g.clone()
            ref_opt.step()
            ref_sched.step()
            if round_kind == "estimate":
                for out, r in zip(outs, ref_params):
                    assert torch.equal(out, r.detach()), f"step {step}: {(out - r).abs().max()} off"
                shard.commit([g.clone() for g in grads], settings=settings)  # moves on as the reference did
            for a, b in zip(params, ref_params):
                assert torch.equal(a.detach(), b.detach()), f"step {step}: {(a - b).abs().max()} off"
            assert _settings(opt) == _settings(ref_opt)  # FusedAdam's 'step' key kept, as its own step keeps it
    finally:
        held.release.set()
        lane.close()
    return None


CASES = [("cpu_adam", "commit"), ("fused_adam", "commit"), ("fused_adam", "estimate")]  # (cpu_adam's estimate: functional)


@pytest.mark.parametrize("op,round_kind", CASES)
def test_a_scheduler_step_during_the_round_does_not_change_it(op, round_kind):
    out = run_ranks(_case, world=1, op=op, round_kind=round_kind, timeout=scaled(300))[0]
    if out is not None:
        pytest.skip(out)
