"""The estimate step without a snapshot: ``functional_step.estimate_into`` must give exactly the
parameters a real ``optimizer.step()`` would, leave every bit of state alone, and allocate only
chunk-sized temporaries. Single process, no distributed setup.

Equality is ``torch.equal`` throughout (bit-identical): any slip in the emulated step (stale
state, weight decay or bias correction missing, step count not advanced, wrong op order) flips
low bits of θ̃ and fails these tests.
"""
import copy
import functools
import importlib
import warnings

import pytest
import torch

from alloc_counter import AllocCounter
from ds_ops import op_unavailable
from ds_acco.core.step import functional_commit, functional_step
from ds_acco.core.step.shard_optimizer import ShardOptimizer, global_norm_sq

TORCH_CONFIGS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-momentum-dampening-maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, dampening=0.3,
                                                                 weight_decay=0.05, maximize=True),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam-amsgrad-l2": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw-wd": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adam-maximize-low-beta1": lambda p: torch.optim.Adam(p, lr=0.01, maximize=True, betas=(0.3, 0.9)),
    "adam-decoupled-flag": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw-foreach-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    "adam-fused-amsgrad-l2-maximize": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1,
                                                                 maximize=True, fused=True),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Chunk-sized ops gain nothing from intra-op threads, and on a busy 2-core runner an
    OpenMP barrier per op costs milliseconds (seconds per test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SIZES = (1031, 37)  # odd sizes: chunk remainders, vector tails
CHUNK = 100
STEPS = 4


def _params():
    return [torch.randn(n, requires_grad=True) for n in SIZES]


def _groups(params):
    return [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.003, "weight_decay": 0.0}]


def _real_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p in params:
        p.grad = None


def _estimate_then_compare(opt, params, chunk=CHUNK, steps=STEPS):
    """Per step: the estimate equals a real step taken on a deep copy; then a real step."""
    for step in range(steps):
        grads = [torch.randn_like(p) for p in params]
        outs = [torch.full_like(p, float("nan")) for p in params]
        functional_step.estimate_into(opt, params, grads, outs, chunk)
        ref = copy.deepcopy(opt)
        ref_params = [p for g in ref.param_groups for p in g["params"]]
        _real_step(ref, ref_params, grads)
        for out, p, r in zip(outs, params, ref_params):
            assert torch.equal(out, r.detach()), f"step {step}: {(out - r).abs().max()} off a real step"
            assert (out != p.detach()).float().mean() > 0.9, "the estimate did not move"
        in_place = [g.clone() for g in grads]  # θ̃ written over the gradient it is computed from
        functional_step.estimate_into(opt, params, in_place, in_place, chunk)
        assert all(torch.equal(a, b) for a, b in zip(in_place, outs))
        _real_step(opt, params, grads)


def _snapshot(opt, params):
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in s.items()}
             for p, s in opt.state.items()}
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups, [p.detach().clone() for p in params], {id(p): {k: id(v) for k, v in s.items()}
                                                                  for p, s in opt.state.items()}


def _assert_unchanged(opt, params, snap):
    state, groups, values, ids = snap
    assert {id(p) for p in opt.state} == set(state)  # no state created, none dropped
    for p, s in opt.state.items():
        assert s.keys() == state[id(p)].keys()
        assert {k: id(v) for k, v in s.items()} == ids[id(p)]  # the same tensor objects
        for k, v in s.items():
            if torch.is_tensor(v):
                assert v.dtype == state[id(p)][k].dtype and torch.equal(v, state[id(p)][k]), k
            else:
                assert v == state[id(p)][k], k
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(p.grad is None for p in params)


# -- torch optimizers ------------------------------------------------------------------------
@pytest.mark.parametrize("name", TORCH_CONFIGS)
def test_estimate_is_bit_identical_to_a_real_step(name):
    torch.manual_seed(0)
    params = _params()
    opt = TORCH_CONFIGS[name](_groups(params))
    assert functional_step.supports(opt)
    _estimate_then_compare(opt, params)  # step 0 without state, then with state


@pytest.mark.parametrize("name", TORCH_CONFIGS)
@pytest.mark.parametrize("after_steps", [0, 2])
def test_estimate_leaves_params_state_and_groups_untouched(name, after_steps):
    torch.manual_seed(1)
    params = _params()
    opt = TORCH_CONFIGS[name](_groups(params))
    for _ in range(after_steps):
        _real_step(opt, params, [torch.randn_like(p) for p in params])
    snap = _snapshot(opt, params)
    outs = [torch.empty_like(p) for p in params]
    functional_step.estimate_into(opt, params, [torch.randn_like(p) for p in params], outs, CHUNK)
    _assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_result_does_not_depend_on_the_chunk(chunk):
    torch.manual_seed(2)
    params = _params()
    opt = TORCH_CONFIGS["adamw-foreach-amsgrad"](_groups(params))
    _estimate_then_compare(opt, params, chunk=chunk, steps=2)


def test_bf16_output_is_the_fp32_result_rounded():
    torch.manual_seed(3)
    params = _params()
    opt = TORCH_CONFIGS["adamw-wd"](_groups(params))
    _real_step(opt, params, [torch.randn_like(p) for p in params])
    grads = [torch.randn_like(p) for p in params]
    fp32 = [torch.empty_like(p) for p in params]
    bf16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    functional_step.estimate_into(opt, params, grads, fp32, CHUNK)
    functional_step.estimate_into(opt, params, grads, bf16, CHUNK)
    assert all(torch.equal(b, f.to(torch.bfloat16)) for b, f in zip(bf16, fp32))


def test_missing_gradient_leaves_the_parameter_as_a_step_would():
    torch.manual_seed(4)
    params = _params()
    opt = TORCH_CONFIGS["adamw-wd"](_groups(params))
    outs = [torch.empty_like(p) for p in params]
    functional_step.estimate_into(opt, params, [torch.randn_like(params[0]), None], outs, CHUNK)
    assert torch.equal(outs[1], params[1].detach())


def test_unsupported_settings_are_refused():
    p = [torch.randn(4, requires_grad=True)]
    assert not functional_step.supports(torch.optim.Adagrad(p))
    assert not functional_step.supports(torch.optim.RMSprop(p))
    assert not functional_step.supports(torch.optim.AdamW(p, differentiable=True))
    assert not functional_step.supports(torch.optim.Adam(p, lr=torch.tensor(0.01)))
    assert not functional_step.supports(torch.optim.SGD(p, lr=0.1, fused=True))

    class MyAdam(torch.optim.Adam):  # a subclass may change step(): refused
        pass
    assert not functional_step.supports(MyAdam(p))
    with pytest.raises(ValueError):
        functional_step.estimate_into(torch.optim.Adagrad(p), p, [torch.ones(4)], [torch.empty(4)])


# -- memory -----------------------------------------------------------------------------------
MEM_CHUNK = 4096
BIG = 1 << 20


@pytest.mark.parametrize("name", ["adam-amsgrad-l2", "adamw-wd", "sgd-momentum-nesterov-wd",
                                  "adam-fused-amsgrad-l2-maximize"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_estimate_allocates_only_chunk_sized_temporaries(name, out_dtype):
    torch.manual_seed(5)
    p = torch.randn(BIG, requires_grad=True)
    opt = TORCH_CONFIGS[name]([p])
    _real_step(opt, [p], [torch.randn_like(p)])
    g, out = torch.randn_like(p), torch.empty(BIG, dtype=out_dtype)
    with AllocCounter() as counter:
        functional_step.estimate_into(opt, [p], [g], [out], MEM_CHUNK)
    assert counter.largest <= MEM_CHUNK, counter.report()
    # all allocations together (an upper bound of the peak): at most 4 fp32 chunk buffers
    assert counter.total_bytes <= 4 * MEM_CHUNK * 4 + 64, counter.report()


def test_the_fallback_is_exact_and_restores_state():
    """Adagrad/RMSprop have no functional step: snapshot → step → copy → restore."""
    torch.manual_seed(6)
    for make in (lambda q: torch.optim.Adagrad(q, lr=0.1), lambda q: torch.optim.RMSprop(q, lr=0.01, momentum=0.5)):
        params = _params()
        opt = make(_groups(params))
        so = ShardOptimizer(opt, params, chunk_elems=CHUNK)
        assert not so.functional
        so.commit([torch.randn_like(p) for p in params], lambda: None)
        grads = [torch.randn_like(p) for p in params]
        snap = _snapshot(opt, params)
        outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        so.estimate_into(grads, outs)
        _assert_unchanged(opt, params, snap)
        committed = so.commit(grads, lambda: [p.detach().clone() for p in params])
        assert all(torch.equal(o, c.to(torch.bfloat16)) for o, c in zip(outs, committed))


def test_the_fallback_cost_is_one_copy_of_the_shard_and_its_state():
    """The documented price of an unsupported optimizer, measured: the snapshot clones θ and
    every state tensor (on top of whatever temporaries the optimizer's own step makes)."""
    p = torch.randn(BIG, requires_grad=True)
    opt = torch.optim.RMSprop([p], lr=0.01, momentum=0.5, centered=True)  # 3 state tensors
    so = ShardOptimizer(opt, [p], chunk_elems=MEM_CHUNK)
    so.commit([torch.randn_like(p)], lambda: None)
    grads, outs = [torch.randn_like(p)], [torch.empty_like(p)]
    with AllocCounter() as counter:
        so.estimate_into(grads, outs)
    clones = [a for a in counter.allocations if a.op == "aten.clone.default" and a.numel == BIG]
    assert len(clones) == 4  # θ + square_avg, momentum_buffer, grad_avg


def test_shard_optimizer_estimate_into_uses_the_functional_path():
    torch.manual_seed(7)
    params = _params()
    opt = TORCH_CONFIGS["adamw-foreach-amsgrad"](_groups(params))
    so = ShardOptimizer(opt, params, chunk_elems=CHUNK)
    assert so.functional
    so.commit([torch.randn_like(p) for p in params], lambda: None)
    grads = [torch.randn_like(p) for p in params]
    outs = [torch.empty_like(p) for p in params]
    snap = _snapshot(opt, params)
    with AllocCounter() as counter:
        so.estimate_into(grads, outs)
    assert counter.largest <= CHUNK  # no snapshot taken
    _assert_unchanged(opt, params, snap)
    old = so.estimate(grads, lambda: [p.detach().clone() for p in params])  # the snapshot path
    committed = so.commit(grads, lambda: [p.detach().clone() for p in params])
    assert all(torch.equal(o, c) and torch.equal(e, c) for o, e, c in zip(outs, old, committed))


@pytest.mark.parametrize("fused", [False, True])
def test_fsdp2_dtensor_parameters_and_state(fused):
    """FSDP2 hands the optimizer DTensor parameters (and so DTensor state): read via to_local()."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of the caller's")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            torch.manual_seed(12)
            shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
            params = [torch.nn.Parameter(shard(torch.randn(33, 5))), torch.nn.Parameter(shard(torch.randn(7)))]
            opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=fused)
            ref = copy.deepcopy(opt)
            ref_params = ref.param_groups[0]["params"]
            so = ShardOptimizer(opt, params, chunk_elems=16)
            assert so.functional and so.functional_commit
            for _ in range(3):
                grads = [shard(torch.randn(p.shape)) for p in params]
                outs = [torch.empty(p.to_local().numel(), dtype=torch.bfloat16) for p in params]
                so.estimate_into(grads, outs)
                committed = so.commit(grads, lambda: [p.to_local().reshape(-1).clone() for p in params])
                assert all(torch.equal(o, c.to(torch.bfloat16)) for o, c in zip(outs, committed))
                _real_step(ref, ref_params, grads)
                assert all(torch.equal(p.to_local(), r.to_local()) for p, r in zip(params, ref_params))
            assert isinstance(opt.state[params[0]]["exp_avg"], type(params[0].data))
        finally:
            dist.destroy_process_group()


# -- gradient norm ----------------------------------------------------------------------------
def test_global_norm_sq_is_chunked_and_exact():
    torch.manual_seed(8)
    grads = [torch.randn(BIG), torch.randn(1031), torch.randn(3, dtype=torch.float64)]
    reference = sum(g.double().pow(2).sum() for g in grads)
    with AllocCounter() as counter:
        got = global_norm_sq(grads, chunk_elems=MEM_CHUNK)
    assert got.dtype == torch.float64
    assert torch.allclose(got, reference, rtol=1e-13, atol=0)
    assert counter.largest <= MEM_CHUNK, counter.report()
    assert counter.total_bytes < BIG, counter.report()  # not even one fp32 copy of the big shard
    assert torch.allclose(global_norm_sq(grads), reference, rtol=1e-13, atol=0)  # default chunk


def test_global_norm_sq_propagates_non_finite():
    assert global_norm_sq([torch.tensor([1.0, float("inf")])], chunk_elems=1).isinf()
    assert global_norm_sq([torch.tensor([float("nan"), 1.0])], chunk_elems=1).isnan()


# -- DeepSpeed optimizers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _cached_cpu_info():
    """DeepSpeedCPUAdam() and DeepSpeed's op builder each probe the CPU with py-cpuinfo, which
    takes a second or more per call; the answer does not change within a test run."""
    try:
        import cpuinfo
    except ImportError:  # pragma: no cover
        yield
        return
    original = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = functools.lru_cache(maxsize=None)(original)
    yield
    cpuinfo.get_cpu_info = original


def _cpu_adam_class():
    """DeepSpeedCPUAdam if its C++ op is available without a minutes-long JIT build."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
        import ds_acco.deepspeed.functional  # noqa: F401 -- the DeepSpeed adapter registers its Adams' estimates
    except Exception as e:  # pragma: no cover
        pytest.skip(f"DeepSpeed unavailable: {e}")
    reason = op_unavailable("CPUAdamBuilder")
    if reason is not None:
        pytest.skip(reason)
    if not functional_step.supports(DeepSpeedCPUAdam([torch.zeros(1, requires_grad=True)])):
        pytest.skip(f"cpu_adam built for {CPUAdamBuilder().simd_width()}: kernel not reproduced (AVX2/AVX-512 only)")
    return DeepSpeedCPUAdam


CPU_ADAM_CONFIGS = {
    "adamw-mode": dict(lr=0.01, weight_decay=0.1),
    "adam-mode-l2": dict(lr=0.01, weight_decay=0.1, adamw_mode=False),
    "no-bias-correction": dict(lr=0.01, bias_correction=False, betas=(0.8, 0.99)),
}
CPU_ADAM_SIZES = (1031, 37, 5)  # numel % 8 (and % 16) != 0: the kernel's scalar tail


def _isolated(fn, **kwargs):
    """Run a DeepSpeedCPUAdam check in a fresh process: the C++ optimizer keeps process-wide state
    (its running β^t, the op's OpenMP set-up) that earlier tests in the same process can disturb --
    in the full suite these checks failed after the benchmark tests while passing alone."""
    from dist import run_ranks
    out = run_ranks(_skip_or_run, world=1, case=fn, kwargs=kwargs)[0]
    if isinstance(out, str):
        pytest.skip(out)


def _skip_or_run(case, kwargs):
    try:
        case(**kwargs)
    except pytest.skip.Exception as e:
        return str(e)
    return None


def _cpu_adam_estimate_case(name):
    cls = _cpu_adam_class()
    torch.manual_seed(9)
    params = [torch.randn(n, requires_grad=True) for n in CPU_ADAM_SIZES]
    # the second group's own betas make the C++ object re-derive β^t with pow at every call
    opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.003, "betas": (0.85, 0.98)}],
              **CPU_ADAM_CONFIGS[name])
    for step in range(STEPS):
        grads = [torch.randn_like(p) for p in params]
        outs = [torch.empty_like(p) for p in params]
        snap = _snapshot(opt, params)
        functional_step.estimate_into(opt, params, grads, outs, CHUNK)
        _assert_unchanged(opt, params, snap)
        in_place = [g.clone() for g in grads]
        functional_step.estimate_into(opt, params, in_place, in_place, CHUNK)
        assert all(torch.equal(a, b) for a, b in zip(in_place, outs))
        _real_step(opt, params, grads)  # DeepSpeedCPUAdam cannot be deep-copied: its C++ state
        for out, p in zip(outs, params):
            assert torch.equal(out, p.detach()), f"step {step}: {(out - p).abs().max()} off"


@pytest.mark.parametrize("name", CPU_ADAM_CONFIGS)
def test_deepspeed_cpu_adam_estimate_is_bit_identical(name):
    _isolated(_cpu_adam_estimate_case, name=name)


def _cpu_adam_single_group_case():
    """One group with the constructor's betas: C++ multiplies β^t step by step (not pow)."""
    cls = _cpu_adam_class()
    torch.manual_seed(10)
    params = [torch.randn(4099, requires_grad=True)]
    opt = cls(params, lr=0.01, betas=(0.9, 0.95))
    for step in range(12):
        grads = [torch.randn_like(params[0])]
        outs = [torch.empty_like(params[0])]
        functional_step.estimate_into(opt, params, grads, outs, 1000)
        _real_step(opt, params, grads)
        assert torch.equal(outs[0], params[0].detach()), f"step {step}"


def test_deepspeed_cpu_adam_single_group_tracks_the_running_beta_powers():
    """One group with the constructor's betas: C++ multiplies β^t step by step (not pow)."""
    _isolated(_cpu_adam_single_group_case)


def test_deepspeed_fused_adam_emulation(monkeypatch):
    """FusedAdam is CUDA-only; here its step is run by a Python transcription of the CUDA kernel
    (float32, every product and sum rounded) on CPU, to check the step bookkeeping (the group's step lives
    in its last parameter's state) and the formulas; on CUDA, nvcc's FMA contraction may move
    results by an ulp."""
    try:
        fused_adam = importlib.import_module("deepspeed.ops.adam.fused_adam")
        ds_functional = importlib.import_module("ds_acco.deepspeed.functional")  # registers FusedAdam's estimate
    except Exception as e:  # pragma: no cover
        pytest.skip(f"DeepSpeed unavailable: {e}")

    def kernel(chunk_size, noop, lists, lr, beta1, beta2, eps, step, mode, bias_correction, decay):
        f = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
        beta1, beta2, lr, eps, decay = f(beta1), f(beta2), f(lr), f(eps), f(decay)
        bc1, bc2 = (f(1 - beta1 ** step), f(1 - beta2 ** step)) if bias_correction else (1.0, 1.0)
        for g, p, m, v in zip(*lists):
            if mode == 0:
                g = p * decay + g
            m.mul_(beta1).add_(g * f(1 - beta1))
            v.mul_(beta2).add_(g * f(1 - beta2) * g)
            update = (m / bc1) / ((v / bc2).sqrt() + eps)
            if mode == 1:
                update = update + p * decay
            p.sub_(update * lr)

    def fake_init(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                  weight_decay=0.0, amsgrad=False, set_grad_none=True):
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                                          eps=eps, weight_decay=weight_decay))
        self.adam_w_mode, self.set_grad_none = int(adam_w_mode), set_grad_none
        self._dummy_overflow_buf, self.multi_tensor_adam = torch.zeros(1, dtype=torch.int), kernel

    monkeypatch.setattr(fused_adam.FusedAdam, "__init__", fake_init)
    monkeypatch.setattr(fused_adam, "multi_tensor_applier", lambda op, noop, lists, *a: op(0, noop, lists, *a))
    monkeypatch.setattr(ds_functional, "FUSED_ADAM_DEVICES", ("cpu",))
    for adam_w_mode in (True, False):
        torch.manual_seed(11)
        params = [torch.randn(n, requires_grad=True) for n in (1031, 37, 5)]
        # two parameters in the first group: only the last one's state counts its steps
        opt = fused_adam.FusedAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.003}],
                                   lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode)
        assert functional_step.supports(opt)
        worst = 0.0
        for step in range(STEPS):
            grads = [torch.randn_like(p) for p in params]
            outs = [torch.empty_like(p) for p in params]
            snap = _snapshot(opt, params)
            functional_step.estimate_into(opt, params, grads, outs, CHUNK)
            _assert_unchanged(opt, params, snap)
            in_place = [g.clone() for g in grads]
            functional_step.estimate_into(opt, params, in_place, in_place, CHUNK)
            assert all(torch.equal(a, b) for a, b in zip(in_place, outs))
            before = [p.detach().clone() for p in params]
            _real_step(opt, params, grads)
            for out, p, b in zip(outs, params, before):
                err = ((out - p) / (p - b)).abs().max().item()  # relative to the update
                worst = max(worst, err)
        assert worst == 0.0, worst  # bit-identical to the transcription


# -- the functional commit (torch SGD/Adam/AdamW) ---------------------------------------------
def _state_signature(opt, params):
    """Per parameter (in order): its state's keys in order, and of each tensor its type, dtype,
    device, shape, strides and requires_grad."""
    return [[(k, type(v), v.dtype, v.device, tuple(v.shape), v.stride(), v.requires_grad) if torch.is_tensor(v)
             else (k, v) for k, v in opt.state[p].items()] if p in opt.state else None for p in params]


def _assert_same_as_real(opt, params, ref, ref_params, where):
    assert _state_signature(opt, params) == _state_signature(ref, ref_params), where
    for p, r in zip(params, ref_params):
        assert torch.equal(p.detach(), r.detach()), f"{where}: parameter {(p - r).abs().max()} off"
        for k, v in opt.state.get(p, {}).items():
            assert torch.equal(v, ref.state[r][k]), f"{where}: state '{k}' {(v - ref.state[r][k]).abs().max()} off"


@pytest.mark.parametrize("name", TORCH_CONFIGS)
def test_commit_in_place_is_bit_identical_to_real_steps(name):
    """From fresh state: N in-place commits give the very parameters and state (values, keys,
    dtypes, devices, layouts) of N real steps; the first step has no gradient for the second
    parameter (it must get no state then, and be left alone)."""
    torch.manual_seed(13)
    params = _params()
    opt = TORCH_CONFIGS[name](_groups(params))
    ref = copy.deepcopy(opt)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    assert functional_commit.supports_commit(opt)
    for step in range(STEPS):
        grads = [torch.randn_like(p) for p in params]
        if step == 0:
            grads[1] = None
        kept = [None if g is None else g.clone() for g in grads]
        functional_commit.commit_in_place(opt, params, grads, CHUNK)
        for p, r, g in zip(ref_params, params, grads):
            p.grad = None if g is None else g.clone()
        ref.step()
        for p in ref_params:
            p.grad = None
        _assert_same_as_real(opt, params, ref, ref_params, f"{name}, step {step}")
        assert all(g is None or torch.equal(g, k) for g, k in zip(grads, kept)), "a gradient was written"
        assert all(p.grad is None for p in params)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_commit_does_not_depend_on_the_chunk(chunk):
    torch.manual_seed(14)
    params = _params()
    opt = TORCH_CONFIGS["adamw-foreach-amsgrad"](_groups(params))
    ref = copy.deepcopy(opt)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    for step in range(2):
        grads = [torch.randn_like(p) for p in params]
        functional_commit.commit_in_place(opt, params, grads, chunk)
        _real_step(ref, ref_params, grads)
        _assert_same_as_real(opt, params, ref, ref_params, f"chunk {chunk}, step {step}")


@pytest.mark.parametrize("name", ["adam-amsgrad-l2", "adamw-wd", "sgd-momentum-nesterov-wd"])
def test_commit_allocates_only_chunk_sized_temporaries(name):
    """The real step allocates shard-sized temporaries (Adam: the denominator; SGD: the decayed
    gradient); the functional commit, once the state exists, at most two chunks."""
    torch.manual_seed(15)
    p = torch.randn(BIG, requires_grad=True)
    opt = TORCH_CONFIGS[name]([p])
    functional_commit.commit_in_place(opt, [p], [torch.randn_like(p)], MEM_CHUNK)  # creates the state
    ref = copy.deepcopy(opt)
    ref_p = ref.param_groups[0]["params"][0]
    g = torch.randn_like(p)
    with AllocCounter() as counter:
        functional_commit.commit_in_place(opt, [p], [g], MEM_CHUNK)
    assert counter.largest <= MEM_CHUNK, counter.report()
    assert counter.total_bytes <= 2 * MEM_CHUNK * 4 + 64, counter.report()
    ref_p.grad = g.clone()
    with AllocCounter() as real:
        ref.step()
    assert real.largest >= BIG, real.report()  # the contrast: torch's own step
    assert torch.equal(p, ref_p) and all(torch.equal(v, ref.state[ref_p][k]) for k, v in opt.state[p].items())


def test_shard_optimizer_commit_is_functional_and_exact():
    torch.manual_seed(16)
    p = torch.randn(BIG, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    ref = copy.deepcopy(opt)
    ref_p = ref.param_groups[0]["params"][0]
    so = ShardOptimizer(opt, [p], chunk_elems=MEM_CHUNK)
    assert so.functional_commit
    for step in range(2):
        g = torch.randn_like(p)
        with AllocCounter() as counter:
            so.commit([g])
        if step:  # the first commit creates the state (as the real step does)
            assert counter.largest <= MEM_CHUNK, counter.report()
        _real_step(ref, [ref_p], [g])
        _assert_same_as_real(opt, [p], ref, [ref_p], f"step {step}")


@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adamw_is_functional_without_a_snapshot(amsgrad):
    """torch's fused AdamW: the estimate runs its fused kernel on window copies (no snapshot of the
    shard and its state, which cost 12 bytes per element with amsgrad), the commit runs it in place;
    both bit-identical to the fused step, over windows that split the tensors."""
    torch.manual_seed(19)
    params = [torch.randn(n, requires_grad=True) for n in (BIG, 1031, 37)]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    ref = copy.deepcopy(opt)
    ref_params = ref.param_groups[0]["params"]
    so = ShardOptimizer(opt, params, chunk_elems=MEM_CHUNK)
    assert so.functional and so.functional_commit
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        snap = _snapshot(opt, params)
        with AllocCounter() as counter:
            so.estimate_into(grads, outs)
        _assert_unchanged(opt, params, snap)
        assert counter.largest <= MEM_CHUNK, counter.report()  # the fallback cloned θ and the state
        assert counter.total_bytes <= (4 if amsgrad else 3) * MEM_CHUNK * 4 + 64, counter.report()
        with AllocCounter() as counter:
            so.commit(grads)
        if step:  # the first commit creates the state (as the real step does)
            assert counter.total_bytes == 0, counter.report()
        _real_step(ref, ref_params, grads)
        _assert_same_as_real(opt, params, ref, ref_params, f"step {step}")
        assert all(torch.equal(o, p.detach().to(torch.bfloat16)) for o, p in zip(outs, params))


@pytest.mark.parametrize("via", ["commit_in_place", "shard_optimizer"])
def test_commit_with_an_lr_scheduler_does_not_warn(via):
    """torch's schedulers warn on ``scheduler.step()`` before any ``optimizer.step()``: they look
    at ``optimizer._opt_called``, which their wrapper of ``step`` sets; the commit must set it."""
    torch.manual_seed(17)
    params = _params()
    opt = TORCH_CONFIGS["adamw-wd"](_groups(params))
    ref = copy.deepcopy(opt)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
        assert functional_commit.supports_commit(opt)  # the scheduler's wrapper is no override
        so = ShardOptimizer(opt, params, chunk_elems=CHUNK)
        for step in range(3):
            grads = [torch.randn_like(p) for p in params]
            if via == "shard_optimizer":
                so.commit(grads)
            else:
                functional_commit.commit_in_place(opt, params, grads, CHUNK)
            sched.step()
            _real_step(ref, ref_params, grads)
            ref_sched.step()
            _assert_same_as_real(opt, params, ref, ref_params, f"step {step}")
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


def _make_hooked(params):
    opt = torch.optim.AdamW(params, lr=0.01)
    opt.calls = []
    opt.register_step_pre_hook(lambda o, a, k: o.calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: o.calls.append("post"))
    return opt


def _make_overridden(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.calls = []
    real = opt.step

    def step(*a, **k):
        opt.calls.append("step")
        return real(*a, **k)
    opt.step = step
    return opt


FALLBACK_CONFIGS = {
    "adagrad": lambda q: torch.optim.Adagrad(q, lr=0.1),
    "sgd-fused": lambda q: torch.optim.SGD(q, lr=0.1, momentum=0.9, fused=True),
    "adamw-step-hooks": _make_hooked,
    "sgd-step-overridden": _make_overridden,
}


@pytest.mark.parametrize("name", FALLBACK_CONFIGS)
def test_unsupported_commits_fall_back_to_the_real_step(name):
    torch.manual_seed(18)
    params = _params()
    opt = FALLBACK_CONFIGS[name](params)
    ref = copy.deepcopy(opt) if name not in ("adamw-step-hooks", "sgd-step-overridden") else FALLBACK_CONFIGS[name](
        [p.detach().clone().requires_grad_() for p in params])
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    assert not functional_commit.supports_commit(opt)
    with pytest.raises(ValueError):
        functional_commit.commit_in_place(opt, params, [torch.randn_like(p) for p in params], CHUNK)
    so = ShardOptimizer(opt, params, chunk_elems=CHUNK)
    assert not so.functional_commit
    for step in range(2):
        grads = [torch.randn_like(p) for p in params]
        so.commit(grads)
        _real_step(ref, ref_params, grads)
        _assert_same_as_real(opt, params, ref, ref_params, f"{name}, step {step}")
    if hasattr(opt, "calls"):
        assert opt.calls == ref.calls and opt.calls, (opt.calls, ref.calls)  # the hooks / override ran
