"""DeepSpeed's Adam optimizers as functional estimates (see :mod:`ds_acco.core.step.functional_step`):
DeepSpeedCPUAdam's AVX kernel and FusedAdam's CUDA kernel, transcribed op for op so that θ̃ equals
what their step would compute. Their real step (every commit, and an estimate the transcription
does not cover) runs, as any optimizer's, on the round's own param groups
(:class:`ds_acco.core.step.shard_optimizer.RoundView`): both read their settings from ``self.param_groups``
only, so the settings captured at the round's launch are what the step uses, whatever a scheduler
writes on the compute thread meanwhile.
Registered with the core when this adapter is imported (the core knows no DeepSpeed class)."""
from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

import torch
from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from deepspeed.ops.adam.fused_adam import FusedAdam

from ..core.step import functional_step
from ..core.step.chunking import local
from ..core.step.functional_kernels import Workspace, chunk_ranges, flat_view
from ..core.step.functional_step import GROUP_PARAMS, is_number, plain_tensors

FUSED_ADAM_DEVICES = ("cuda",)  # FusedAdam's op is CUDA-only (a test runs its emulation on CPU)


def _adam_groups_ok(optimizer) -> bool:
    return all(not g.get("amsgrad", False) and all(is_number(g[k]) for k in ("lr", "eps", "weight_decay"))
               and all(is_number(b) for b in g["betas"]) for g in optimizer.param_groups)


class _CpuAdamEstimate:
    """DeepSpeedCPUAdam with fp32 parameters and states, built for AVX2 / AVX-512."""

    def supports(self, optimizer) -> bool:
        return (_adam_groups_ok(optimizer) and getattr(optimizer, "fp32_optimizer_states", True)
                and plain_tensors(optimizer, (torch.float32,), "cpu") and _cpu_adam_simd_width() > 0)

    def estimate(self, optimizer, items: Sequence[tuple], groups: Sequence[dict], ws: Workspace) -> None:
        steps = _shared_steps(optimizer, "cpu_adam", items, groups)
        for (p, pl, g, ol, group), step in zip(items, steps):
            _cpu_adam(pl, g, ol, group, optimizer.state.get(p) or {}, step, optimizer.adam_w_mode, ws)


class _FusedAdamEstimate:
    """DeepSpeed's FusedAdam with fp32 parameters on CUDA."""

    def supports(self, optimizer) -> bool:
        return _adam_groups_ok(optimizer) and all(plain_tensors(optimizer, (torch.float32,), d)
                                                  for d in FUSED_ADAM_DEVICES)

    def estimate(self, optimizer, items: Sequence[tuple], groups: Sequence[dict], ws: Workspace) -> None:
        steps = _shared_steps(optimizer, "fused_adam", items, groups)
        for (p, pl, g, ol, group), step in zip(items, steps):
            _fused_adam(pl, g, ol, group, optimizer.state.get(p) or {}, step, optimizer.adam_w_mode, ws)


# -- DeepSpeedCPUAdam: Adam_Optimizer::Step_AVX (csrc/includes/cpu_adam.h) --------------------
def _f32(x) -> float:
    """The float32 value of ``x``, as a Python float (exact in double)."""
    return torch.tensor(x, dtype=torch.float32).item()


class _CpuAdamMirror:
    """The C++ ``Adam_Optimizer``'s running powers β^t (``IncrementStep``), which a step uses
    for the bias corrections and which Python cannot read: replayed here from the same calls.

    It starts as the C++ object does (step 0, β^t = 1, the constructor's betas), and after each
    estimate it stands where the commit's identical calls will leave the C++ object. If the
    optimizer stepped before the first estimate in this process (without a reload), its β^t
    came from repeated float products where the mirror takes ``pow``: a few ulps of the bias
    correction, not more.
    """

    def __init__(self, beta1: float, beta2: float):
        self.step, self.b1, self.b2, self.b1t, self.b2t = 0, _f32(beta1), _f32(beta2), 1.0, 1.0

    def increment(self, step: int, beta1: float, beta2: float) -> Tuple[float, float]:
        beta1, beta2 = _f32(beta1), _f32(beta2)
        if beta1 != self.b1 or beta2 != self.b2:
            self.step, self.b1, self.b2 = step, beta1, beta2
            self.b1t, self.b2t = _f32(beta1 ** step), _f32(beta2 ** step)
        elif step == self.step + 1:
            self.step += 1
            self.b1t, self.b2t = _f32(self.b1t * beta1), _f32(self.b2t * beta2)
        elif step != self.step:
            self.b1t, self.b2t = _f32(beta1 ** step), _f32(beta2 ** step)
            self.step = step
        return self.b1t, self.b2t


_CPU_ADAM_MIRRORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shared_steps(optimizer, kind: str, items, groups=None) -> List:
    """Per-item step data that depends on the other parameters of the call (``groups``: the param
    groups as the step reads them, :func:`ds_acco.core.step.functional_step.step_groups`; default the optimizer's)."""
    groups = optimizer.param_groups if groups is None else groups
    if kind == "cpu_adam":
        mirror = _CPU_ADAM_MIRRORS.get(optimizer)
        if mirror is None:
            b1, b2 = optimizer.defaults["betas"]
            mirror = _CPU_ADAM_MIRRORS[optimizer] = _CpuAdamMirror(b1, b2)
        by_id = {id(p): i for i, (p, _, g, _, _) in enumerate(items) if g is not None}
        out: List = [None] * len(items)
        for group in groups:  # step()'s order of IncrementStep calls
            for p in group[GROUP_PARAMS]:
                i = by_id.get(id(p))
                if i is None:
                    continue
                step = int((optimizer.state.get(p) or {}).get("step", 0)) + 1
                out[i] = (step,) + mirror.increment(step, *group["betas"])
        return out
    if kind == "fused_adam":
        # FusedAdam.step() counts steps in the state of the *last* parameter with a gradient of
        # each group (starting from group['step'] when that state is new); fp32 only: +1.
        out = [None] * len(items)
        with_grad = {id(p): i for i, (p, _, g, _, _) in enumerate(items) if g is not None}
        for group in groups:
            mine = [p for p in group[GROUP_PARAMS] if id(p) in with_grad]
            if not mine:
                continue
            last = optimizer.state.get(mine[-1]) or {}
            step = int(last.get("step", group.get("step", 0))) + 1
            for p in mine:
                out[with_grad[id(p)]] = step
        return out
    return [None] * len(items)


def _fma(a: torch.Tensor, b: float, c, out: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``out ← fl32(a·b + c)`` as an FMA: a·b is exact in float64 (a, b float32), one rounding
    of the sum in float64, then to float32 (a double rounding: wrong by an ulp only when the
    float64 sum falls exactly half-way between two floats, about 2^-28 of the time)."""
    d.copy_(a).mul_(b)
    d.add_(c)
    return out.copy_(d)


def _cpu_adam(p, g, out, group, state, step_info, adamw, ws):
    step, b1t, b2t = step_info
    beta1, beta2 = (_f32(b) for b in group["betas"])
    lr, eps, wd = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
    if group["bias_correction"]:
        bias_correction1 = _f32(1 - b1t)
        # ``1 / sqrt(1 - _betta2_t)`` in float
        bias_correction2 = _f32(1 / _f32(_f32(1 - b2t) ** 0.5))
    else:
        bias_correction1 = bias_correction2 = 1.0
    betta1_minus1, betta2_minus1 = _f32(1 - beta1), _f32(1 - beta2)
    step_size = _f32(-lr / bias_correction1)
    w_decay = _f32(_f32(-lr) * wd)
    exp_avg, exp_avg_sq = _state_flat(state, "exp_avg"), _state_flat(state, "exp_avg_sq")
    # Step_8/Step_4/Step_AVX<1> cover the first numel - numel % W elements with SIMD FMAs; the
    # last numel % W go through Step_1's scalar loop, where the compiler contracts the moment
    # updates the other way round: m = fma(m, β1, g·(1-β1)) instead of fma(g, 1-β1, m·β1).
    simd_end = p.numel() - p.numel() % _cpu_adam_simd_width()
    ranges = [(s, n, False) for s, n in chunk_ranges(simd_end, ws.chunk)]
    if simd_end < p.numel():
        ranges.append((simd_end, p.numel() - simd_end, True))
    for s, n, scalar_tail in ranges:
        pc, gc, oc = p.narrow(0, s, n), g.narrow(0, s, n), out.narrow(0, s, n)
        gb, mb, vb = ws.get(0, p, n), ws.get(1, p, n), ws.get(2, p, n)
        d = ws.get(4, p, n, torch.float64)
        tgt = _target(oc, p, ws, 3, n)
        grad = gc
        if wd > 0 and not adamw:
            grad = _fma(pc, wd, gc, gb, d)
        m_old = None if exp_avg is None else exp_avg.narrow(0, s, n)
        v_old = None if exp_avg_sq is None else exp_avg_sq.narrow(0, s, n)
        if scalar_tail:  # fewer than W elements: small temporaries
            m_new = grad * betta1_minus1 if m_old is None else _fma(m_old, beta1, grad * betta1_minus1, mb, d)
            g2b = (grad * grad) * betta2_minus1
            v_new = g2b if v_old is None else _fma(v_old, beta2, g2b, vb, d)
            mb.copy_(m_new)
            vb.copy_(v_new)
        else:
            if m_old is None:
                mb.zero_()
                vb.zero_()
            else:
                torch.mul(m_old, beta1, out=mb)
                torch.mul(v_old, beta2, out=vb)
            _fma(grad, betta1_minus1, mb, mb, d)
            g2 = torch.mul(grad, grad, out=gb)
            _fma(g2, betta2_minus1, vb, vb, d)
        # torch's float32 sqrt need not be correctly rounded (the C++ kernel's is): take it in
        # float64 (a double rounding that is innocuous for sqrt) then round to float32.
        den = gb.copy_(d.copy_(vb).sqrt_())
        _fma(den, bias_correction2, eps, den, d)
        upd = torch.div(mb, den, out=gb)
        base = pc
        if wd > 0 and adamw:
            base = _fma(pc, w_decay, pc, tgt, d)
        _fma(upd, step_size, base, tgt, d)
        if tgt is not oc:
            oc.copy_(tgt)


_SIMD_WIDTHS = {"-D__AVX512__": 16, "-D__AVX256__": 8}
_cpu_adam_width: Optional[int] = None


def _state_flat(state: dict, key: str) -> Optional[torch.Tensor]:
    t = state.get(key)
    return None if t is None else flat_view(local(t), f"state '{key}'")


def _target(out: torch.Tensor, like: torch.Tensor, ws: Workspace, slot: int, n: int) -> torch.Tensor:
    """Where a chunk of the result is computed: the output itself when it has the working dtype."""
    return out if out.dtype == like.dtype else ws.get(slot, like, n)

def _cpu_adam_simd_width() -> int:
    """Floats per SIMD vector of the cpu_adam op (as DeepSpeed's builder chooses it); 0 when the
    op was built for a kernel this module does not reproduce (scalar, SVE, NEON)."""
    global _cpu_adam_width
    if _cpu_adam_width is None:
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder
            _cpu_adam_width = _SIMD_WIDTHS.get(CPUAdamBuilder().simd_width(), 0)
        except Exception:  # pragma: no cover - DeepSpeed absent or its probe failed
            _cpu_adam_width = 0
    return _cpu_adam_width


# -- DeepSpeed FusedAdam: AdamFunctor (csrc/adam/multi_tensor_adam.cu) -----------------------
def _fused_adam(p, g, out, group, state, step, adam_w_mode, ws):
    beta1, beta2 = (_f32(b) for b in group["betas"])
    lr, eps, decay = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
    if group["bias_correction"]:
        bc1, bc2 = _f32(1 - beta1 ** step), _f32(1 - beta2 ** step)
    else:
        bc1 = bc2 = 1.0
    one_minus_b1, one_minus_b2 = _f32(1 - beta1), _f32(1 - beta2)
    exp_avg, exp_avg_sq = _state_flat(state, "exp_avg"), _state_flat(state, "exp_avg_sq")
    for s, n in chunk_ranges(p.numel(), ws.chunk):
        pc, gc, oc = p.narrow(0, s, n), g.narrow(0, s, n), out.narrow(0, s, n)
        gb, mb, vb = ws.get(0, p, n), ws.get(1, p, n), ws.get(2, p, n)
        tgt = _target(oc, p, ws, 3, n)
        tmp = ws.get(3, p, n)  # scratch; when it is also tgt, it is dead before tgt is written
        grad = gc
        if not adam_w_mode:  # ADAM_MODE_0 (L2): g = g + decay·p
            grad = torch.mul(pc, decay, out=gb).add_(gc)
        # m = β1·m + (1-β1)·g ; v = β2·v + (1-β2)·g·g, each product rounded, as written
        torch.mul(grad, one_minus_b1, out=tmp)
        (mb.zero_() if exp_avg is None else torch.mul(exp_avg.narrow(0, s, n), beta1, out=mb)).add_(tmp)
        torch.mul(grad, one_minus_b2, out=tmp).mul_(grad)
        (vb.zero_() if exp_avg_sq is None else torch.mul(exp_avg_sq.narrow(0, s, n), beta2, out=vb)).add_(tmp)
        # update = (m/bc1) / (sqrt(v/bc2) + eps) [+ decay·p] ; p = p - lr·update
        den = torch.div(vb, bc2, out=gb).sqrt_().add_(eps)
        upd = torch.div(mb, bc1, out=vb).div_(den)
        if adam_w_mode:
            upd.add_(torch.mul(pc, decay, out=mb))
        torch.sub(pc, upd.mul_(lr), out=tgt)
        if tgt is not oc:
            oc.copy_(tgt)


functional_step.register_estimate(DeepSpeedCPUAdam, _CpuAdamEstimate())
functional_step.register_estimate(FusedAdam, _FusedAdamEstimate())
