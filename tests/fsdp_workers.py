"""Functions that run inside spawned ranks for tests/test_fsdp.py (the FSDP2 adapter)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer, make_scheduler


def _rank() -> int:
    return int(os.environ["RANK"])


def sharded_tiny(mp: bool = False):
    """TinyNet with fully_shard on each layer and on the root, on a mesh of every rank: CPU under
    gloo, the accelerator otherwise (scripts/gpu_check.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    device_type = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator().type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    low = {True: torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    policy = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low is not None
              else MixedPrecisionPolicy())
    model = TinyNet(seed=0)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def live_snapshot(model):
    """The weights the model computes with (FSDP's resident unsharded parameters), fp32 copies."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def master_snapshot(model):
    """The committed fp32 master θ, gathered from FSDP's sharded parameters (a collective)."""
    return {n: p.full_tensor().detach().float().cpu().clone() for n, p in model.acco_test_masters.items()}


def build(case):
    from ds_acco.fsdp import AccoFSDP
    model = sharded_tiny(case.get("mp", False))
    # FSDP's sharded fp32 parameters (the ones the optimizer steps): the committed master θ
    model.acco_test_masters = dict(model.named_parameters())
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    cfg = ds_config(case.get("gas", 4), case["acco"], clip=case.get("clip", 0.0), **case.get("extra", {}))
    acco = AccoFSDP(model, opt, cfg, lr_scheduler=sched(opt) if sched else None)
    return model, acco


def feed(model, acco, start, stop, on_micro_batch=None, sleep=0.0):
    losses = []
    device = next(model.parameters()).device
    for i in range(start, stop):
        loss = model(*(t.to(device) for t in batch(_rank(), i)))
        acco.backward(loss)
        if sleep:
            time.sleep(sleep)
        acco.step()
        losses.append(loss.item())
        if on_micro_batch is not None:
            on_micro_batch(i)
    return losses


def run(case):
    """Train ``gas * steps`` micro-batches (or until ``until`` commits); return θ_T and the record."""
    model, acco = build(case)
    sleep = case.get("sleep", {}).get(str(_rank()), 0.0)
    if "until" in case:
        losses, i = [], 0
        while acco.global_steps < case["until"]:
            losses += feed(model, acco, i, i + 1, sleep=sleep)
            i += 1
    else:
        losses = feed(model, acco, 0, case.get("gas", 4) * case["steps"], sleep=sleep)
    with ds_acco.committed_weights(acco):
        final = live_snapshot(model)
        final_fp32 = master_snapshot(model)
    out = {"final": final, "final_fp32": final_fp32, "losses": losses, "global_steps": acco.global_steps,
           "phases": [p.tally.micro_batches for p in acco.schedule.history],
           "metrics": acco.acco_metrics_history, "boundary_type": type(acco.is_gradient_accumulation_boundary()).__name__}
    acco.close()
    # after close the model is plain FSDP at the committed θ
    with torch.no_grad():
        model(*(t.to(next(model.parameters()).device) for t in batch(_rank(), 0)))
    out["after_close"] = live_snapshot(model)
    return out


def checkpoint_runs(case, ckpt_dir, save_at, total):
    """One run saving after each micro-batch in ``save_at``; then, per save, a fresh model that
    loads it and trains on to ``total`` micro-batches."""
    model, acco = build(case)
    swapped = []

    def maybe_save(i):
        if i in save_at:
            if i % 2:  # inside committed_weights (an evaluation callback that saves): the export swaps back
                with ds_acco.committed_weights(acco):
                    if acco.schedule._swapped:
                        swapped.append(i)
                    acco.save_checkpoint(os.path.join(ckpt_dir, f"mb{i}"))
            else:
                acco.save_checkpoint(os.path.join(ckpt_dir, f"mb{i}"))
    losses = feed(model, acco, 0, total, maybe_save)
    with ds_acco.committed_weights(acco):
        final = live_snapshot(model)
    out = {"full": {"losses": losses, "final": final, "global_steps": acco.global_steps}, "swapped_saves": swapped}
    acco.close()
    for i in save_at:
        model, acco = build(case)
        acco.load_checkpoint(os.path.join(ckpt_dir, f"mb{i}"))
        steps_loaded = acco.global_steps
        losses = feed(model, acco, i + 1, total)
        with ds_acco.committed_weights(acco):
            final = live_snapshot(model)
        out[i] = {"losses": losses, "final": final, "global_steps": acco.global_steps, "loaded_steps": steps_loaded}
        acco.close()
    out["files"] = sorted(os.listdir(ckpt_dir))
    return out


def fp16_run(case):
    """AccoFSDP with fp16 compute and DeepSpeed's dynamic loss scaler: per micro-batch the loss
    scale, every round's skip flag, and the committed θ at the end."""
    model, acco = build(case)
    gas, scales, rounds = case.get("gas", 4), [], {}

    def note(i):
        scales.append(acco.loss_scale)
        for r in acco.schedule.recent_rounds:
            rounds[(r.kind.value, r.step)] = r.skipped
    feed(model, acco, 0, gas * case["steps"], on_micro_batch=note)
    with ds_acco.committed_weights(acco):
        final = live_snapshot(model)
        final_fp32 = master_snapshot(model)
    note(None)
    out = {"final": final, "final_fp32": final_fp32, "skipped_steps": acco.skipped_steps, "global_steps": acco.global_steps,
           "loss_scales": scales, "rounds": sorted(rounds.items()), "metrics": acco.acco_metrics_history,
           "param_dtype": str(next(iter(model.parameters())).dtype)}
    acco.close()
    return out


def config_errors():
    """AccoFSDP with bad settings: the error messages."""
    from ds_acco.fsdp import AccoFSDP
    tries = {
        "odd_gas": (ds_config(3, {"enabled": True, "mode": "acco"}), "sgd"),
        "unknown_key": (ds_config(4, {"enabled": True, "mdoe": "acco"}), "sgd"),
        "bad_mode": (ds_config(4, {"enabled": True, "mode": "zero"}), "sgd"),
        "disabled": (ds_config(4, {"enabled": False}), "sgd"),
        "fp16": (ds_config(4, {"enabled": True}, fp16={"enabled": True}), "sgd"),  # on an fp32 model
        "wrong_optimizer": (ds_config(4, {"enabled": True}), "other"),
    }
    out = {}
    for name, (cfg, opt_kind) in tries.items():
        model = sharded_tiny()
        opt = (torch.optim.SGD(TinyNet().parameters(), lr=0.1) if opt_kind == "other"
               else make_optimizer(opt_kind)(model))
        try:
            AccoFSDP(model, opt, cfg).close()
            out[name] = "NO ERROR"
        except ValueError as exc:
            out[name] = str(exc)
    model = sharded_tiny()
    acco = AccoFSDP(model, make_optimizer("sgd")(model), ds_config(4, {"enabled": True}))
    try:
        acco.backward(model(*batch(_rank(), 0)), weight=3.0)
        out["weight"] = "NO ERROR"
    except ValueError as exc:
        out["weight"] = str(exc)
    acco.close()
    model = sharded_tiny()
    acco = AccoFSDP(model, make_optimizer("sgd")(model), ds_config(4, {"enabled": True}))
    feed(model, acco, 0, 3)
    model.state_dict()  # FSDP reshards: the next forward would re-gather the committed θ over the live weights
    try:
        feed(model, acco, 3, 4)
        out["regather"] = "NO ERROR"
    except RuntimeError as exc:
        out["regather"] = str(exc)
    acco.close()
    return out


def everything(ds_cases, fsdp_cases, ckpt_case, ckpt_dir, save_at, total):
    """All of test_fsdp.py's distributed work in one spawn (start-up dominates on 2 busy cores)."""
    import workers
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t0 = time.perf_counter()
    out = {"ds": workers.train_cases(ds_cases)}
    out["ds_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["fsdp"] = [run(c) for c in fsdp_cases]
    out["fsdp_s"] = time.perf_counter() - t0
    out["ckpt"] = checkpoint_runs(ckpt_case, ckpt_dir, save_at, total)
    out["errors"] = config_errors()
    return out


def loss_scaling(ds_cases, fsdp_case, ckpt_dir, save_at, total):
    """test_loss_scaling.py's distributed work in one spawn: DeepSpeed cases, one FSDP2 run, and
    FSDP2 checkpoints saved and resumed."""
    import workers
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {"ds": workers.train_cases(ds_cases), "fsdp": fp16_run(fsdp_case)}
    out["fsdp_ckpt"] = checkpoint_runs(fsdp_case, ckpt_dir, save_at, total)
    return out
