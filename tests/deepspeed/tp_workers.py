"""Tensor parallelism by hand on 4 gloo ranks (2 data-parallel x 2 tensor-parallel), for
tests/deepspeed/test_tensor_parallel.py.

``TPNet`` is TinyNet's function split Megatron-style over a tensor-parallel group of 2: a
replicated input scale, ``fc1`` column-parallel (its rows and bias split), ``fc2`` row-parallel
(its columns split; the partial outputs all-reduced) with a replicated bias. ``FullNet`` is the
same function unsplit: the float64 reference trains it at data-parallel world 2. Global rank
``r`` is tensor-parallel rank ``r % 2`` of data-parallel rank ``r // 2`` (Megatron's order).
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from fixtures import HIDDEN, IN, OUT, batch  # noqa: F401 -- OUT for the tests

TP, DP = 2, 2


class FullNet(torch.nn.Module):
    """loss = mse(fc2(tanh(fc1(x * scale))), y); the reference's model."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.scale = torch.nn.Parameter(1.0 + 0.3 * torch.randn(IN, generator=g))
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x * self.scale))), y)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPNet(torch.nn.Module):
    """Tensor-parallel rank ``tp_rank``'s part of FullNet(seed); tensor-parallel parameters carry
    ``tensor_model_parallel = True`` (how Megatron marks them, read by DeepSpeed)."""

    def __init__(self, tp_rank: int, group, seed: int = 0, tp: int = TP):
        super().__init__()
        full = FullNet(seed)
        part = HIDDEN // tp
        rows = slice(tp_rank * part, (tp_rank + 1) * part)
        self.group = group
        self.scale = torch.nn.Parameter(full.scale.detach().clone())  # replicated
        self.fc1_weight = torch.nn.Parameter(full.fc1.weight.detach()[rows].clone())  # column-parallel
        self.fc1_bias = torch.nn.Parameter(full.fc1.bias.detach()[rows].clone())
        self.fc2_weight = torch.nn.Parameter(full.fc2.weight.detach()[:, rows].clone())  # row-parallel
        self.fc2_bias = torch.nn.Parameter(full.fc2.bias.detach().clone())  # replicated
        for p in (self.fc1_weight, self.fc1_bias, self.fc2_weight):
            p.tensor_model_parallel = True

    def forward(self, x, y):
        h = torch.tanh(torch.nn.functional.linear(_CopyToTP.apply(x * self.scale, self.group),
                                                  self.fc1_weight, self.fc1_bias))
        out = _ReduceFromTP.apply(torch.nn.functional.linear(h, self.fc2_weight), self.group) + self.fc2_bias
        return torch.nn.functional.mse_loss(out, y)


def assert_replicas_agree(name: str, finals: list, replicated) -> None:
    """Global ranks t and 2 + t (the two data-parallel replicas of tensor-parallel rank t) hold the
    same parameters, and the ``replicated`` ones are the same on both tensor-parallel ranks: exactly."""
    for tp in range(TP):
        for n in finals[tp]:
            assert torch.equal(finals[tp][n], finals[TP + tp][n]), (name, tp, n)
    for n in replicated:
        assert torch.equal(finals[0][n], finals[1][n]), (name, n)


def assert_near_reference(name: str, got: dict, want: dict, model: torch.nn.Module) -> None:
    """``got`` (gathered from the shards) equals the float64 reference ``want`` to 1e-5 relative,
    on a trajectory that moved at least 5e-3 from ``model``'s initial parameters."""
    from reference import rel_distance
    theta0 = {n: p.detach().double() for n, p in model.named_parameters()}
    err, moved = rel_distance(got, want), rel_distance(theta0, want)
    print(f"{name}: relative error {err:.2e} (trajectory moved {moved:.2e})")
    assert moved > 5e-3
    assert err < 1e-5


def gather_full(params: dict, shards: list) -> dict:
    """FullNet's parameters from the tensor-parallel ranks' TPNet parameters (rank order)."""
    return {"scale": params["scale"], "fc1.weight": torch.cat([s["fc1_weight"] for s in shards], 0),
            "fc1.bias": torch.cat([s["fc1_bias"] for s in shards], 0),
            "fc2.weight": torch.cat([s["fc2_weight"] for s in shards], 1), "fc2.bias": params["fc2_bias"]}


class MPU:
    """The slice of Megatron's ``mpu`` DeepSpeed reads, over groups built on every rank in one order
    (``tp`` x ``dp`` ranks; scripts/gpu_check.py uses 1 x 1)."""

    def __init__(self, tp: int = TP, dp: int = DP):
        rank = dist.get_rank()
        self.tp, self.dp = tp, dp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        for ranks in [[d * tp + t for t in range(tp)] for d in range(dp)]:  # tensor-parallel groups
            g = dist.new_group(ranks)
            if rank in ranks:
                self.tp_group = g
        for ranks in [[d * tp + t for d in range(dp)] for t in range(tp)]:  # data-parallel groups
            g = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = g

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_world_size(self):
        return self.tp

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self):
        return self.tp_rank

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_rank(self):
        return self.dp_rank


def train_tp(case: dict):
    """Train TPNet on this rank for gas*steps micro-batches (the data of data-parallel rank
    ``rank // 2``); return the committed parameters and which rounds were skipped."""
    import deepspeed

    import ds_acco
    from fixtures import ds_config
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    mpu = MPU(case.get("tp", TP), case.get("dp", DP))
    model = TPNet(mpu.tp_rank, mpu.tp_group, tp=mpu.tp)
    opt = _optimizer(case["optimizer"], model)
    cfg = ds_config(case["gas"], case.get("acco"), clip=case.get("clip", 0.0))
    try:
        engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    except ValueError as exc:
        if case.get("refused"):
            return {"refused": str(exc)}
        raise
    done, stopped, losses, start = 0, None, [], 0
    if "resume" in case:  # (dir, micro-batch): continue a saved run after that micro-batch
        _, client = engine.load_checkpoint(case["resume"][0], tag=f"mb{case['resume'][1]}")
        start = client["fed"]
    try:
        for i in range(start, case["gas"] * case["steps"]):
            loss = engine(*(t.to(engine.device) for t in batch(mpu.dp_rank, i)))  # scripts/gpu_check.py: a GPU
            losses.append(loss.item())
            engine.backward(loss)
            if [dist.get_rank(), i] in [list(p) for p in case.get("nan_grad_at", ())]:
                with torch.no_grad():  # p.grad is a view of ACCO's accumulator: the round sees it
                    model.fc2_weight.grad.view(-1)[0] = float("nan")
            engine.step()
            done = i + 1
            if "save" in case and done == case["save"][1]:  # mid-phase: a round in flight is saved
                engine.save_checkpoint(case["save"][0], tag=f"mb{done}", client_state={"fed": done})
            if [dist.get_rank(), i] == case.get("sigterm_at"):
                os.kill(os.getpid(), signal.SIGTERM)  # acco.sigterm 'stop': every rank stops at one round
    except SystemExit as exc:
        stopped = exc.code
    if stopped is not None:
        out = {"stopped": stopped, "done": done, "global_steps": engine.global_steps}
        engine.destroy()
        return out
    skipped = engine.skipped_steps
    with ds_acco.committed_weights(engine):
        final = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    steps = engine.global_steps
    engine.destroy()
    return {"final": final, "skipped_steps": skipped, "losses": losses, "global_steps": steps}


def _optimizer(name: str, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)
    raise ValueError(name)


def make_optimizer(name: str):
    return lambda model: _optimizer(name, model)


def train_tp_cases(cases):
    return [train_tp(c) for c in cases]



# -- DeepSpeed AutoTP: the engine splits TinyNet itself ---------------------------------------------
# fc1 column-parallel (its rows and bias split), fc2 row-parallel (its columns split; its bias,
# added after the all-reduce, replicated): the same split as TPNet, done by DeepSpeed's AutoTP from
# the config (no mpu). Global rank r is tensor-parallel rank r % 2 of data-parallel rank r // 2.
AUTOTP_PARTITION = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*fc1\.weight$"], "partition_type": "column"},
    {"patterns": [r".*fc2\.weight$"], "partition_type": "row"}]}


def autotp_config(case: dict, tensor_parallel: dict = None) -> dict:
    from fixtures import ds_config
    tp = {"autotp_size": TP, "partition_config": AUTOTP_PARTITION} if tensor_parallel is None else tensor_parallel
    return ds_config(case["gas"], case.get("acco"), clip=case.get("clip", 0.0), tensor_parallel=tp)


def gather_autotp(shards: list) -> dict:
    """TinyNet's parameters from the tensor-parallel ranks' AutoTP shards (rank order)."""
    return {"fc1.weight": torch.cat([s["fc1.weight"] for s in shards], 0),
            "fc1.bias": torch.cat([s["fc1.bias"] for s in shards], 0),
            "fc2.weight": torch.cat([s["fc2.weight"] for s in shards], 1), "fc2.bias": shards[0]["fc2.bias"]}


def train_autotp(case: dict) -> dict:
    """Train TinyNet under AutoTP for gas*steps micro-batches (the data of this rank's data-parallel
    rank); return the committed shards. ``case["via"]``: "config" (tensor_parallel.autotp_size),
    "tp_model_init" (deepspeed.tp_model_init, a config without autotp_size: DeepSpeed merges the size
    in while building the engine) or "mesh" (a stock engine on a data x sequence-parallel mesh, whose
    built layout is checked)."""
    import deepspeed
    from deepspeed.utils import groups

    import ds_acco
    from fixtures import TinyNet, make_optimizer as fixture_optimizer
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    model = TinyNet(seed=0)
    opt = fixture_optimizer(case["optimizer"])(model)
    via = case.get("via", "config")
    if via == "mesh":
        return _built_layout_refusal(model, opt, case)
    cfg = autotp_config(case)
    if via == "tp_model_init":
        cfg = autotp_config(case, {"partition_config": AUTOTP_PARTITION})
        deepspeed.tp_model_init(model, tp_size=TP, dtype=torch.float32)
    try:
        engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    except ValueError as exc:
        if case.get("refused"):
            return {"refused": str(exc)}
        raise
    finally:
        if via == "tp_model_init":  # DeepSpeed keeps tp_model_init's arguments for every later initialize
            from deepspeed.runtime.tensor_parallel import init_utils
            init_utils._TP_MODEL_INIT_ARGS = None
    if case.get("refused"):
        engine.destroy()
        return {"built": type(engine).__name__}
    tp_rank, dp_rank = groups.get_tensor_model_parallel_rank(), groups.get_data_parallel_rank()
    for i in range(case["gas"] * case["steps"]):
        loss = engine(*batch(dp_rank, i))
        engine.backward(loss)
        engine.step()
    # AutoTP's export (accelerator.get_state_dict calls it; every rank, the whole model on rank 0),
    # right after the loop: ACCO's last commit round is in flight
    exported = engine._consolidated_16bit_state_dict()
    with ds_acco.committed_weights(engine):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = {"final": final, "tp_rank": tp_rank, "dp_rank": dp_rank, "engine": type(engine).__name__,
           "optimizer": type(engine.optimizer).__name__, "mp_world_size": engine.mp_world_size,
           "global_steps": engine.global_steps, "exported": exported}
    engine.destroy()
    return out


def _built_layout_refusal(model, opt, case: dict) -> dict:
    """A stock engine on a (data 2 x sequence-parallel 2) mesh: what ACCO reads from the groups it
    built, and the refusal that layout gets."""
    import deepspeed
    from deepspeed.utils import groups

    from ds_acco.config import AccoConfig
    from ds_acco.core.checks.refusals import check_layout
    from ds_acco.deepspeed.layout import built_layout as _built_layout
    groups.mpu = None  # the AutoTP engines before this one left DeepSpeed's groups module as the mpu
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=autotp_config(case, {}),
                                           mesh_param=(DP, TP))
    layout = _built_layout(engine, model, None, None)
    engine.destroy()
    groups.mesh_device = None
    try:
        check_layout(AccoConfig(enabled=True), layout)
    except ValueError as exc:
        return {"refused": str(exc), "sequence_parallel": layout.sequence_parallel}
    return {"sequence_parallel": layout.sequence_parallel}


def train_autotp_cases(cases):
    return [train_autotp(c) for c in cases]
