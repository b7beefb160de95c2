"""Many training runs of the reference GPT at once, one slice of stacked parameters per run (the
fidelity sweep of docs/bench/fidelity-sweep-h200, ``python -m benchmarks.fidelity_sweep``):
stock ZeRO-1 and ACCO's recurrences (shared/ACCO.md, fixed mode) with estimate variants, for the
fidelity sweep. Each run is the same computation as a 2-rank job of benchmarks (same initial
weights from the same seed, the same per-rank micro-batch streams, the same DeepSpeed
WarmupCosineLR and AdamW), with the micro-batch gradients of a half pooled into one mean.

A run's variant (per-run tensors, so every run of a group advances in the same kernels):
  stock        the whole batch of step t at θ_t
  lr_scale c   θ̃_{t+1} = Opt(θ_t, S_t, ḡ̃_t) with the learning rate times c (c = 1: the paper)
  keep_v       the estimate reuses the committed second moment v_t (bias-corrected for t steps)
               instead of updating it with the half-batch gradient (paper's update at t = 0)
  dc λ         the commit's first-half gradients compensated for their delay (DC-ASGD-a, its
               Hessian's diagonal g ⊙ g scaled by the committed RMS): ḡ̃ + λ ḡ̃ ⊙ ḡ̃ ⊙ (θ_t − θ̃_t) / (√v̂_t + ε)
  warm K       the first K steps run stock's schedule, then ACCO from θ_K with θ̃_K = θ_K: the library's
               "sync_warmup_steps": K (-1: the LR warm-up's steps)

One-round variants (issue 42; docs/estimate.md, "One round per step: the predictors"): one commit
round per step, hidden behind the whole next step; the whole batch of step t is computed at a point
P_t, θ_{t+1}, S_{t+1} = Opt(θ_t, S_t, clip(ḡ(P_t))), and P_{t+1} is made from θ_t, θ_{t-1}, S_t and
P_t only (what round t-1 holds): P_0 = P_1 = θ_0.
  dpu          P_{t+1} = θ_t (plain DPU: one step stale)
  ext c        P_{t+1} = θ_t + c·(θ_t − θ_{t-1})
  nag c        P_{t+1} = θ_t − c·η_t·(wd·θ_t + m̂_t / (√v̂_t + ε)): AdamW's step with the next gradient
               forecast by the bias-corrected momentum, v kept (t ≥ 1)
  ef γ         P_{t+1} = θ_t + (θ_t − θ_{t-1}) + γ·(θ_t − P_t): ext 1 with the last prediction's miss fed back
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn.functional as F

from benchmarks.sim_optimizers import SimOptimizer, check_variants

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@dataclass
class Variant:
    name: str
    stock: bool = False
    lr_scale: float = 1.0
    keep_v: bool = False
    dc: float = 0.0
    warm: int = 0
    predict: str = ""  # one-round predictor: "dpu", "ext", "nag", "ef" ("" : not a one-round run)
    pc: float = 1.0  # its coefficient (c of ext / nag, γ of ef)


PREDICTORS = ("dpu", "ext", "nag", "ef")

VARIANTS = {
    "stock": Variant("stock", stock=True),
    "paper": Variant("paper"),
    "keep_v": Variant("keep_v", keep_v=True),
    "dc": Variant("dc", dc=2.0),
    "warm": Variant("warm", warm=-1),  # -1: the schedule's warm-up steps
    "warm20": Variant("warm20", warm=20),  # longer synchronous starts (issue 43 item 4: the normalised families)
    "warm40": Variant("warm40", warm=40),
    "la1.5": Variant("la1.5", lr_scale=1.5),
    "la2": Variant("la2", lr_scale=2.0),
    # the look-ahead with stock's schedule through the LR warm-up: the simulator's form of the library's
    # "sync_warmup_steps" set to the scheduler's warm-up (issue 43's high-LR candidates)
    "la2+warm": Variant("la2+warm", lr_scale=2.0, warm=-1),
    "la1.5+warm": Variant("la1.5+warm", lr_scale=1.5, warm=-1),
    "la1.25": Variant("la1.25", lr_scale=1.25),
    "la0.5": Variant("la0.5", lr_scale=0.5),  # below the paper's (issue 43 item 4: the normalised families)
    "la0": Variant("la0", lr_scale=0.0),  # θ̃_{t+1} = θ_t: the first half one step stale
    "keep_v+la1.5": Variant("keep_v+la1.5", keep_v=True, lr_scale=1.5),
    "dpu": Variant("dpu", predict="dpu"),
    "ext1": Variant("ext1", predict="ext", pc=1.0),
    "ext1.5": Variant("ext1.5", predict="ext", pc=1.5),
    "ext2": Variant("ext2", predict="ext", pc=2.0),
    "nag": Variant("nag", predict="nag", pc=1.0),
    "nag2": Variant("nag2", predict="nag", pc=2.0),
    "ef": Variant("ef", predict="ef", pc=0.5),
}


@dataclass
class Setting:
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    seq_len: int = 32
    micro_batch: int = 4
    gas: int = 8
    world: int = 2
    steps: int = 1000
    warmup: int = 50
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip: float = 1.0
    cos_min_ratio: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8  # per rank, of 16 sequences
    corpus: str = "embedded"  # benchmarks.data.load_text_dataset's source ("stdlib-source": 12 MB)
    bf16: bool = False  # forward and backward under bf16 autocast; weights, gradients, AdamW in fp32
    optimizer: str = "adamw"  # or one of benchmarks.sim_optimizers (adam, sgd, adafactor, lion)


class Stack:
    """R GPT-2s (transformers' GPT2LMHeadModel layout, benchmarks.gpt.CausalLM) as stacked tensors."""

    NAMES = None
    autocast = contextlib.nullcontext  # run_group's Setting.bf16: torch.autocast to bf16

    def __init__(self, models: List[torch.nn.Module], device):
        named = [dict(m.named_parameters()) for m in models]
        self.names = list(named[0])
        self.p = {n: torch.stack([d[n].detach() for d in named]).to(device).requires_grad_(True) for n in self.names}
        cfg = models[0].lm.config
        self.L, self.D, self.H = cfg.n_layer, cfg.n_embd, cfg.n_head
        self.eps = cfg.layer_norm_epsilon

    def loss(self, params: Dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """rows [R, B, T+1]: per-run mean next-token cross-entropy, [R]."""
        R, B, T1 = rows.shape
        T = T1 - 1
        x, y = rows[:, :, :-1], rows[:, :, 1:]
        pre = "lm.transformer."
        wte, wpe = params[pre + "wte.weight"], params[pre + "wpe.weight"]
        V = wte.shape[1]
        offs = (torch.arange(R, device=rows.device) * V).view(R, 1, 1)
        h = F.embedding(x + offs, wte.reshape(R * V, self.D)) + wpe[:, :T].unsqueeze(1)  # [R,B,T,D]
        h = h.reshape(R, B * T, self.D)

        def ln(t, name):
            w, b = params[name + ".weight"], params[name + ".bias"]
            return F.layer_norm(t, (self.D,), eps=self.eps) * w.unsqueeze(1) + b.unsqueeze(1)

        def conv(t, name):  # transformers' Conv1D: t @ W + b
            return torch.baddbmm(params[name + ".bias"].unsqueeze(1), t, params[name + ".weight"])

        hd = self.D // self.H
        for i in range(self.L):
            blk = f"{pre}h.{i}."
            a = conv(ln(h, blk + "ln_1"), blk + "attn.c_attn")  # [R, BT, 3D]
            q, k, v = a.split(self.D, dim=-1)
            q, k, v = (z.reshape(R * B, T, self.H, hd).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o = o.transpose(1, 2).reshape(R, B * T, self.D)
            h = h + conv(o, blk + "attn.c_proj")
            m = F.gelu(conv(ln(h, blk + "ln_2"), blk + "mlp.c_fc"), approximate="tanh")
            h = h + conv(m, blk + "mlp.c_proj")
        h = ln(h, pre + "ln_f")
        logits = torch.bmm(h, wte.transpose(1, 2))  # tied lm_head, [R, BT, V]
        ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(R, B * T)
        return ce.mean(1)

    def grads_at(self, point: Dict[str, torch.Tensor], rows: torch.Tensor):
        """Per-run mean gradient at ``point`` (stacked values), and the per-run losses."""
        leaves = {n: t.detach().requires_grad_(True) for n, t in point.items()}
        with self.autocast():
            losses = self.loss(leaves, rows).float()
        gs = torch.autograd.grad(losses.sum(), [leaves[n] for n in self.names])
        return dict(zip(self.names, gs)), losses.detach()


def _rsum(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).sum(1)


def _bc(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.view(-1, *([1] * (like.dim() - 1)))


def predict_next(kind: Dict[str, torch.Tensor], pc: torch.Tensor, theta, prev, point, m, v, t: int, lr: float,
                 s: Setting, decay: Dict[str, bool]):
    """Each one-round run's P_{t+1} (module docstring) from what round t-1 leaves on every rank: θ_t, θ_{t-1},
    P_t and AdamW's m_t, v_t; a run whose predictor is "dpu" (or none) gets θ_t."""
    out = {}
    for n, th in theta.items():
        d = th - prev[n]
        c = _bc(pc, th)
        p = th
        if bool(kind["ext"].any()):
            p = torch.where(_bc(kind["ext"], th), th + c * d, p)
        if bool(kind["ef"].any()):
            p = torch.where(_bc(kind["ef"], th), th + d + c * (th - point[n]), p)
        if bool(kind["nag"].any()) and t >= 1:  # no committed state before the first commit: P_1 = θ_0
            wd = s.weight_decay if decay[n] else 0.0
            mhat = m[n] / (1 - s.beta1 ** t)
            vhat = v[n] / (1 - s.beta2 ** t)
            p = torch.where(_bc(kind["nag"], th), th - (c * lr) * (wd * th + mhat / (vhat.sqrt() + s.eps)), p)
        out[n] = p
    return out


def lr_schedule(s: Setting) -> List[float]:
    """DeepSpeed's WarmupCosineLR as the fidelity runs configure it, stepped once per step."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=s.lr)
    sched = WarmupCosineLR(opt, total_num_steps=s.steps, warmup_num_steps=s.warmup, warmup_min_ratio=0.0,
                           cos_min_ratio=s.cos_min_ratio, warmup_type="linear")
    out = []
    for _ in range(s.steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@functools.lru_cache(maxsize=2)
def _splits(seq_len: int, corpus: str = "embedded"):
    from benchmarks.data import build_splits
    return build_splits(corpus, seq_len=seq_len, holdout=0.02, seed=0)


def run_group(setting: Setting, runs: List[tuple], device="cpu", log=None, trace=None) -> List[dict]:
    """Train every (variant name, seed) of ``runs`` under ``setting``; their records. ``trace``, a list:
    gets per step t the stacked points of the two halves and θ_{t+1} (CPU copies, for the tests)."""
    from benchmarks.data import heldout_batches, micro_batches
    from benchmarks.gpt import CausalLM
    s = setting
    dev = torch.device(device)
    R = len(runs)
    variants = [VARIANTS[v] for v, _ in runs]
    seeds = [seed for _, seed in runs]
    train_rows, held = _splits(s.seq_len, s.corpus)
    models = []
    for seed in seeds:
        torch.manual_seed(seed)  # benchmarks.variants.build_model: same initial weights per seed
        models.append(CausalLM(s.seq_len, s.n_embd, s.n_layer, s.n_head))
    st = Stack(models, dev)
    del models
    if s.bf16:  # DeepSpeed's bf16 as the recurrence sees it: bf16 compute, fp32 master weights
        st.autocast = functools.partial(torch.autocast, dev.type, dtype=torch.bfloat16)
    names = st.names
    decay = {n: st.p[n].dim() >= 3 for n in names}  # benchmarks.gpt.param_groups: matrices only
    # data: per seed, each rank's stream (benchmarks.data.micro_batches), gas micro-batches per step
    h = s.gas // 2
    idx_by_seed = {}
    for seed in sorted(set(seeds)):
        streams = [micro_batches(train_rows, s.micro_batch, r, s.world, seed) for r in range(s.world)]
        steps = []
        for _ in range(s.steps):
            per_rank = [[next(st_) for _ in range(s.gas)] for st_ in streams]
            first = torch.cat([mb for r in range(s.world) for mb in per_rank[r][:h]])
            second = torch.cat([mb for r in range(s.world) for mb in per_rank[r][h:]])
            steps.append(torch.stack([first, second]))
        idx_by_seed[seed] = torch.stack(steps)  # [steps, 2, B_half, T+1]
    data = torch.stack([idx_by_seed[seed] for seed in seeds]).to(dev)  # [R, steps, 2, Bh, T+1]
    evals = torch.cat([torch.cat(heldout_batches(held, 16, r, s.world)[:s.eval_batches])
                       for r in range(s.world)]).to(dev)
    lrs = lr_schedule(s)

    f32 = dict(device=dev, dtype=torch.float32)
    stock = torch.tensor([v.stock for v in variants], device=dev)
    warm = torch.tensor([s.warmup if v.warm < 0 else v.warm for v in variants], device=dev)
    c = torch.tensor([v.lr_scale for v in variants], **f32)
    keep_v = torch.tensor([v.keep_v for v in variants], device=dev)
    dc = torch.tensor([v.dc for v in variants], **f32)
    for v_ in variants:
        if v_.predict and v_.predict not in PREDICTORS:
            raise ValueError(f"variant {v_.name}: predictor {v_.predict!r} is none of {PREDICTORS}")
    one = torch.tensor([bool(v_.predict) for v_ in variants], device=dev)  # one-round runs
    any_one = bool(one.any())
    kind = {k: torch.tensor([v_.predict == k for v_ in variants], device=dev) for k in PREDICTORS}
    pc = torch.tensor([v_.pc for v_ in variants], **f32)
    theta = {n: st.p[n].detach().clone() for n in names}
    check_variants(s.optimizer, variants)
    opt = None if s.optimizer == "adamw" else SimOptimizer(s.optimizer, s, theta, decay)
    est = {n: t.clone() for n, t in theta.items()}  # θ̃_0 = θ_0 (one-round runs: P_0 = θ_0)
    prev = theta  # θ_{t-1}, θ_{-1} = θ_0
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    v = {n: torch.zeros_like(t) for n, t in theta.items()}
    lag = torch.zeros(s.steps, R, **f32)
    cos = torch.zeros(s.steps, R, **f32)
    heldout = []
    b1, b2, eps = s.beta1, s.beta2, s.eps

    def clip_divisor(g):  # DeepSpeed's rule, as the rounds apply it: divide by max(1, (norm + 1e-6) / clip)
        norm = torch.sqrt(sum(_rsum(g[n] * g[n]) for n in names))
        return torch.clamp((norm + 1e-6) / s.clip, min=1.0)

    def evaluate(step):
        with torch.no_grad(), st.autocast():
            losses = st.loss(theta, evals.unsqueeze(0).expand(R, -1, -1)).float()
        heldout.append((step, losses.cpu()))

    for t in range(s.steps):
        lr = lrs[t]
        # [R]: this step's first half at θ_t: stock; the K steps of a warm-up and step K, where ACCO starts
        # from θ_K with θ̃_K = θ_K (the library's "sync_warmup_steps": K, pinned by tests/benchmarks/test_multirun.py;
        # in records made at b36ce2e or before, step K's first half was at the estimate of step K-1: the library's K-1)
        sync = stock | (warm >= t)
        first_at = {n: torch.where(_bc(sync, theta[n]), theta[n], est[n]) for n in names}
        g1, _ = st.grads_at(first_at, data[:, t, 0])
        # one-round runs: the second half too at P_t (est holds it)
        second_at = {n: torch.where(_bc(one, theta[n]), est[n], theta[n]) for n in names} if any_one else theta
        g2, _ = st.grads_at(second_at, data[:, t, 1])
        if any_one:  # P_{t+1} from what round t-1 left: θ_t, θ_{t-1}, P_t, S_t (before this step's commit)
            pred = predict_next(kind, pc, theta, prev, est, m, v, t, lr, s, decay)
        # the estimate: Opt(θ_t, S_t, clip(ḡ̃)) with lr·c, state discarded
        f1 = clip_divisor(g1)
        if opt is not None:  # benchmarks.sim_optimizers: the estimate (state discarded), then the commit
            new_est = opt.step(theta, {n: g1[n] / _bc(f1, g1[n]) for n in names}, c * lr, commit=False)
            full = {n: (g1[n] + g2[n]) / 2 for n in names}
            f = clip_divisor(full)
            new_theta = opt.step(theta, {n: full[n] / _bc(f, full[n]) for n in names}, lr, commit=True)
        else:  # AdamW
            step_next = t + 1  # AdamW's step count after this step's commit
            bc1 = 1 - b1 ** step_next
            new_est = {}
            for n in names:
                ge = g1[n] / _bc(f1, g1[n])
                lr_r = _bc(c * lr, ge)
                wd = s.weight_decay if decay[n] else 0.0
                m2 = torch.lerp(m[n], ge, 1 - b1)
                v_paper = (v[n] * b2 + (1 - b2) * ge * ge) / (1 - b2 ** step_next)
                v_kept = v[n] / (1 - b2 ** t) if t >= 1 else v_paper
                vhat = torch.where(_bc(keep_v, ge), v_kept, v_paper)
                new_est[n] = theta[n] * (1 - lr_r * wd) - (lr_r / bc1) * m2 / (vhat.sqrt() + eps)
            # the commit: the whole batch (halves pooled by count), first half delay-compensated
            full = {}
            rms = {n: (v[n] / (1 - b2 ** t)).sqrt() + eps if t >= 1 else None for n in names}
            for n in names:
                if rms[n] is None:  # no committed second moment yet: nothing to scale by (θ̃_0 = θ_0 anyway)
                    full[n] = (g1[n] + g2[n]) / 2
                    continue
                g1c = g1[n] + _bc(dc, g1[n]) * g1[n] * g1[n] * (theta[n] - est[n]) / rms[n]
                g1c = torch.where(_bc(sync, g1c), g1[n], g1c)
                full[n] = (g1c + g2[n]) / 2
            f = clip_divisor(full)
            bc2 = 1 - b2 ** step_next
            new_theta = {}
            for n in names:
                g = full[n] / _bc(f, full[n])
                wd = s.weight_decay if decay[n] else 0.0
                p = theta[n] * (1 - lr * wd)  # torch AdamW: decay, moments, then the step
                m[n] = torch.lerp(m[n], g, 1 - b1)
                v[n] = v[n] * b2 + (1 - b2) * g * g
                denom = v[n].sqrt() / math.sqrt(bc2) + eps
                new_theta[n] = p - (lr / bc1) * m[n] / denom
        if any_one:
            new_est = {n: torch.where(_bc(one, new_est[n]), pred[n], new_est[n]) for n in names}
        if trace is not None:
            trace.append({"first_at": {n: x.detach().cpu().clone() for n, x in first_at.items()},
                          "second_at": {n: x.detach().cpu().clone() for n, x in second_at.items()},
                          "theta_next": {n: x.detach().cpu().clone() for n, x in new_theta.items()}})
        # lag of the estimate (one-round runs: the prediction) against the commit it stood for
        d2 = sum(_rsum((new_est[n] - new_theta[n]) ** 2) for n in names)
        u2 = sum(_rsum((new_theta[n] - theta[n]) ** 2) for n in names)
        e2 = sum(_rsum((new_est[n] - theta[n]) ** 2) for n in names)
        eu = sum(_rsum((new_est[n] - theta[n]) * (new_theta[n] - theta[n])) for n in names)
        lag[t] = d2.sqrt() / u2.sqrt().clamp_min(1e-30)
        cos[t] = eu / (e2.sqrt() * u2.sqrt()).clamp_min(1e-30)
        prev, theta = theta, new_theta
        # stock (and warm-up) runs: the next first half is at θ_{t+1}; ACCO runs: at θ̃_{t+1}
        est = new_est
        if (t + 1) % s.eval_every == 0:
            evaluate(t + 1)
            if log:
                log(f"step {t + 1}: " + " ".join(f"{float(x):.4f}" for x in heldout[-1][1][:8]))
    out = []
    lag_c, cos_c = lag.cpu(), cos.cpu()
    for r, (vname, seed) in enumerate(runs):
        curve = [(step, float(losses[r])) for step, losses in heldout]
        tail = [l for step, l in curve if step >= 0.7 * s.steps]
        k = s.warmup if variants[r].warm < 0 else variants[r].warm
        acco_steps = [t for t in range(s.steps) if not (variants[r].stock or t < k)]
        out.append({"variant": vname, "seed": seed, "heldout": curve, "tail_mean": sum(tail) / len(tail),
                    "lag_median": float(lag_c[acco_steps, r].median()) if acco_steps else None,
                    "cos_median": float(cos_c[acco_steps, r].median()) if acco_steps else None})
    return out


if __name__ == "__main__":  # a quick look: python -m benchmarks.multirun --steps 20 --variants stock,paper
    import argparse
    import json
    import time
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="stock,paper")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--lr-mult", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optimizer", default="adamw", help="or adam, sgd, adafactor, lion (benchmarks.sim_optimizers)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    s = Setting(steps=a.steps, warmup=min(50, max(2, a.steps // 10)), eval_every=max(1, a.steps // 4), lr=1e-3 * a.lr_mult,
                optimizer=a.optimizer)
    runs = [(v, int(seed)) for seed in a.seeds.split(",") for v in a.variants.split(",")]
    t0 = time.time()
    res = run_group(s, runs, a.device, log=print)
    print(json.dumps([{k: r[k] for k in ("variant", "seed", "tail_mean", "lag_median")} for r in res]))
    print("wall", time.time() - t0)
