"""Counting the bytes each collective sends (run inside spawned ranks)."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

SMALL = 1024  # elements: the rounds' count tables and norms are smaller; model buffers are not here

_NAMES = {"all_reduce": "reduce", "reduce": "reduce", "reduce_scatter_tensor": "reduce",
          "reduce_scatter_single": "reduce", "all_gather_into_tensor": "gather", "all_gather_single": "gather",
          "_all_gather_base": "gather"}


class WireLog:
    """Wraps torch.distributed's collectives; records (kind, dtype, bytes of the full buffer) of
    every large one. The all-gather's output and the reduce's input are the full buffer."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = []
        self.on = False

    _active = None  # the one log of this process: wrappers installed once, reading the latest log

    def install(self):
        import ds_acco.comm.collectives as coll
        first = WireLog._active is None
        WireLog._active = self
        if not first:
            return
        for name, kind in _NAMES.items():
            inner = getattr(dist, name, None)
            if inner is None:
                continue
            setattr(dist, name, self._wrap(inner, kind))
        coll._all_gather = self._wrap(coll._all_gather, "gather")
        coll._reduce_scatter = self._wrap(coll._reduce_scatter, "reduce")

    def _wrap(self, inner, kind):
        if getattr(inner, "_wire_wrapped", False):
            return inner

        name = inner.__name__

        def call(*args, **kwargs):
            # the full buffer: the all-gather's output, the reduce-scatter's input, the (all-)reduce's tensor
            if name in ("all_reduce", "reduce"):
                t = args[0] if args else kwargs.get("tensor")
            elif kind == "gather":
                t = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
            else:
                t = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
            log = WireLog._active
            if log.on and torch.is_tensor(t) and t.numel() >= SMALL:
                with log.lock:
                    log.calls.append((kind, str(t.dtype), t.numel() * t.element_size()))
            return inner(*args, **kwargs)
        call._wire_wrapped = True
        call.__name__ = name
        return call

    def take(self):
        with self.lock:
            out, self.calls = self.calls, []
        return out


def wide_net():
    """A model of ~20k parameters, so every model buffer is above ``SMALL`` elements."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 96))


def deepspeed_step_bytes(extra: dict, acco=None, gas: int = 2, steps: int = 2, fp16_on_cpu: bool = False):
    """Collectives of ``steps`` optimizer steps after one warm-up step: a list per step."""
    import ds_acco
    log = WireLog()
    log.install()
    if fp16_on_cpu:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    model = wide_net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
           "zero_allow_untested_optimizer": True, **extra}
    if acco is not None:
        cfg["acco"] = acco
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine, *_ = ds_acco.initialize(model=model, optimizer=opt, config=cfg)
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(dist.get_rank())
    per_step = []
    for step in range(steps + 1):
        log.on = step > 0
        for _ in range(gas):
            x = torch.randn(4, 64, generator=g).to(dtype)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        if acco is not None:
            engine.optimizer.drain()  # this step's rounds are over (the lane runs them on its thread)
        if step > 0:
            per_step.append(log.take())
    log.on = False
    numel = sum(p.numel() for p in model.parameters())
    engine.destroy()
    return {"per_step": per_step, "numel": numel}


def deepspeed_cases(cases):
    """``deepspeed_step_bytes(**case)`` for each case, one process per rank for all of them."""
    log = WireLog()
    log.install()
    return [deepspeed_step_bytes(**case) for case in cases]


def fsdp_cases(accos):
    dist.init_process_group("gloo")
    return [fsdp_step_bytes(acco) for acco in accos]


def fsdp_step_bytes(acco=None, gas: int = 2, steps: int = 2):
    """The same for FSDP2 with bf16 parameters and fp32 gradient reduction: stock FSDP2 (one
    reduce-scatter and one all-gather per step) or AccoFSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    log = WireLog()
    log.install()
    model = wide_net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    acco_obj = None
    if acco is not None:
        from ds_acco.fsdp import AccoFSDP
        acco_obj = AccoFSDP(model, opt, {"gradient_accumulation_steps": gas, "acco": acco})
    g = torch.Generator().manual_seed(dist.get_rank())
    per_step = []
    for step in range(steps + 1):
        log.on = step > 0
        for i in range(gas):
            x = torch.randn(4, 64, generator=g)
            loss = model(x).float().pow(2).mean()
            if acco_obj is not None:
                acco_obj.backward(loss)
                acco_obj.step()
            else:
                last = i == gas - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                (loss / gas).backward()
        if acco_obj is None:
            opt.step()
            opt.zero_grad()
        else:
            acco_obj.drain()
        if step > 0:
            per_step.append(log.take())
    log.on = False
    numel = sum(p.numel() for p in wide_net().parameters())
    if acco_obj is not None:
        acco_obj.close()
    return {"per_step": per_step, "numel": numel}
