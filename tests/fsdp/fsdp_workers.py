"""Functions that run inside spawned ranks for tests/test_fsdp.py (the FSDP2 adapter)."""
from __future__ import annotations

import contextlib
import os
import shutil
import time

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, batch, ds_config, make_optimizer, make_scheduler


def _rank() -> int:
    return int(os.environ["RANK"])


def sharded_tiny(mp: bool = False, mesh=None, keep_fc2: bool = False):
    """TinyNet with fully_shard on each layer and on the root (default: a mesh over every rank: CPU
    under gloo, the accelerator otherwise, see scripts/gpu_check.py). ``keep_fc2``: fc2 with
    reshard_after_forward=False (a forward without backward leaves it unsharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if mesh is None:
        device_type = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator().type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    low = {True: torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    policy = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low is not None
              else MixedPrecisionPolicy())
    model = TinyNet(seed=0)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not (keep_fc2 and layer is model.fc2))
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def live_snapshot(model):
    """The weights the model's parameters hold (FSDP's resident unsharded parameters; sharded ones
    gathered, a collective), fp32 copies."""
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
            for n, p in model.named_parameters()}


def master_snapshot(model):
    """The committed fp32 master θ, gathered from FSDP's sharded parameters (a collective)."""
    return {n: p.full_tensor().detach().float().cpu().clone() for n, p in model.acco_test_masters.items()}


def build(case, mesh=None):
    from ds_acco.fsdp import AccoFSDP
    model = sharded_tiny(case.get("mp", False), mesh, keep_fc2=case.get("keep_fc2", False))
    # FSDP's sharded fp32 parameters (the ones the optimizer steps): the committed master θ
    model.acco_test_masters = dict(model.named_parameters())
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    cfg = ds_config(case.get("gas", 4), case["acco"], clip=case.get("clip", 0.0), **case.get("extra", {}))
    acco = AccoFSDP(model, opt, cfg, lr_scheduler=sched(opt) if sched else None,
                    sharded_params=case.get("sharded", False))
    return model, acco


def feed(model, acco, start, stop, on_micro_batch=None, sleep=0.0, eval_at=(), sharded_log=None, data_rank=None):
    """Micro-batches ``start..stop-1`` (of rank ``data_rank``'s data; default this rank's). ``eval_at``:
    after those, a forward without backward on the committed weights (an evaluation). ``sharded_log``:
    gets, per micro-batch, whether every parameter was a sharded DTensor after the step (nothing
    unsharded resident)."""
    from torch.distributed.tensor import DTensor
    losses = []
    device = next(model.parameters()).device
    data_rank = _rank() if data_rank is None else data_rank
    for i in range(start, stop):
        loss = model(*(t.to(device) for t in batch(data_rank, i)))
        acco.backward(loss)
        if sleep:
            time.sleep(sleep)
        acco.step()
        losses.append(loss.item())
        if sharded_log is not None:
            sharded_log.append(all(isinstance(p, DTensor) for p in model.parameters()))
        if i in eval_at:
            with ds_acco.committed_weights(acco), torch.no_grad():
                model(*(t.to(device) for t in batch(_rank(), 0)))
        if on_micro_batch is not None:
            on_micro_batch(i)
    return losses


def feed_until_sigterm(model, acco, total, signal_rank, signal_at):
    """Micro-batches ``0..total-1``; global rank ``signal_rank`` sends itself SIGTERM after micro-batch
    ``signal_at``. Returns ``(done, code)``: with ``code`` the SystemExit's (None: not stopped), the
    stop left ``step()`` of micro-batch ``done`` (it is counted, and in a SIGTERM checkpoint)."""
    import signal
    done = 0
    try:
        for i in range(total):
            feed(model, acco, i, i + 1)
            done = i + 1
            if _rank() == signal_rank and i == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit as exc:
        return done, exc.code
    return done, None


def run(case):
    """Train ``gas * steps`` micro-batches (or until ``until`` commits); return θ_T and the record."""
    model, acco = build(case)
    sleep = case.get("sleep", {}).get(str(_rank()), 0.0)
    sharded = []
    if "until" in case:
        losses, i = [], 0
        while acco.global_steps < case["until"]:
            losses += feed(model, acco, i, i + 1, sleep=sleep, sharded_log=sharded)
            i += 1
    else:
        losses = feed(model, acco, 0, case.get("gas", 4) * case["steps"], sleep=sleep, eval_at=case.get("eval_at", ()),
                      sharded_log=sharded)
    with ds_acco.committed_weights(acco):
        final = live_snapshot(model)
        final_fp32 = master_snapshot(model)
    out = {"final": final, "final_fp32": final_fp32, "losses": losses, "global_steps": acco.global_steps,
           "global_samples": acco.driver.host.global_samples, "phases": [p.tally.micro_batches for p in acco.schedule.history],
           "metrics": acco.acco_metrics_history, "boundary_type": type(acco.is_gradient_accumulation_boundary()).__name__,
           "sharded_between": sharded, "b_bytes": acco.buffers.comm.numel(), "skipped_steps": acco.skipped_steps,
           "param_dtype": str(next(iter(model.parameters())).dtype),
           "g_bytes": acco.buffers.grads.numel() * acco.buffers.grads.element_size()}
    acco.close()
    # after close the model is plain FSDP at the committed θ
    with torch.no_grad():
        model(*(t.to(next(model.parameters()).device) for t in batch(_rank(), 0)))
    out["after_close"] = live_snapshot(model)
    return out


def checkpoint_runs(case, ckpt_dir, save_at, total, old_format=False):
    """One run saving after each micro-batch in ``save_at``; then, per save, a fresh model that
    loads it and trains on to ``total`` micro-batches. ``old_format``: also load the last save as a
    checkpoint written before ``global_samples`` was saved (without that key)."""
    model, acco = build(case)
    swapped = []

    def maybe_save(i):
        if i in save_at:
            if i % 2:  # inside committed_weights (an evaluation callback that saves): the export swaps back
                with ds_acco.committed_weights(acco):
                    if acco.schedule.committed.swapped:
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
        steps_loaded, samples_loaded = acco.global_steps, acco.global_samples
        losses = feed(model, acco, i + 1, total)
        with ds_acco.committed_weights(acco):
            final = live_snapshot(model)
        out[i] = {"losses": losses, "final": final, "global_steps": acco.global_steps, "loaded_steps": steps_loaded,
                  "loaded_samples": samples_loaded}
        acco.close()
    if old_format:
        out["old_format"] = _load_without_global_samples(case, os.path.join(ckpt_dir, f"mb{save_at[-1]}"),
                                                         ckpt_dir + "_old")
    out["files"] = sorted(os.listdir(ckpt_dir))
    return out


def _load_without_global_samples(case, path, old_dir):
    """Load a copy of checkpoint ``path`` whose rank files lack ``global_samples`` (as written before it
    was counted): the global steps and samples it loads."""
    if _rank() == 0:
        shutil.copytree(path, old_dir)
        for name in os.listdir(old_dir):
            if name.startswith("acco_rank"):
                extras = torch.load(os.path.join(old_dir, name), weights_only=False)
                del extras["global_samples"]
                torch.save(extras, os.path.join(old_dir, name))
    dist.barrier()
    model, acco = build(case)
    acco.load_checkpoint(old_dir)
    out = {"loaded_steps": acco.global_steps, "loaded_samples": acco.global_samples}
    acco.close()
    return out


def assert_resumes_exactly(rank_outs, save_at, total, gas) -> None:
    """Checks on :func:`checkpoint_runs`' results (one per rank): each resume continues with the
    uninterrupted run's losses and ends on its weights and step count."""
    for rank_out in rank_outs:
        full = rank_out["full"]
        assert full["global_steps"] == total // gas
        for i in save_at:
            resumed = rank_out[i]
            assert resumed["losses"] == full["losses"][i + 1:], f"losses differ after resuming at {i}"
            assert all(torch.equal(resumed["final"][n], full["final"][n]) for n in full["final"])
            assert resumed["global_steps"] == full["global_steps"]


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
    model.fc1.reshard()  # FSDP frees fc1's unsharded weights: the next forward would re-gather the committed θ
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
    out["ckpt"] = checkpoint_runs(ckpt_case, ckpt_dir, save_at, total, old_format=True)
    out["errors"] = config_errors()
    return out


def sharded_params(cases, ckpt_case, ckpt_dir, save_at, total):
    """tests/fsdp/test_sharded_params.py's distributed work in one spawn."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return {"runs": [run(c) for c in cases], "ckpt": checkpoint_runs(ckpt_case, ckpt_dir, save_at, total),
            "edges": sharded_edges(os.path.join(ckpt_dir, "resident"))}


def sharded_edges(resident_ckpt):
    """AccoFSDP(sharded_params=True) at its edges: an optimizer without a functional step, FSDP's
    reset of its sharded parameters (model.to()) with a commit in flight, and a checkpoint of the
    resident layout loaded mid-run (a fresh phase at the loaded shards)."""
    from ds_acco.fsdp import AccoFSDP
    case = {"optimizer": "sgd", "acco": {"enabled": True, "mode": "acco"}, "sharded": True}
    out = {}
    model = sharded_tiny()
    try:
        AccoFSDP(model, torch.optim.RMSprop(model.parameters(), lr=0.01), ds_config(4, case["acco"]),
                 sharded_params=True).close()
        out["rmsprop"] = "NO ERROR"
    except ValueError as exc:
        out["rmsprop"] = str(exc)
    for accumulation in ("dynamic", "shared"):  # per-rank phase lengths: FSDP gathers every micro-batch
        model = sharded_tiny()
        try:
            AccoFSDP(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ds_config(4, dict(case["acco"], accumulation=accumulation)), sharded_params=True).close()
            out[accumulation] = "NO ERROR"
        except ValueError as exc:
            out[accumulation] = str(exc)
    model, acco = build(case)
    feed(model, acco, 0, 4)  # a commit in flight: FSDP gathers the estimate's shard
    out["on_estimate_mid_commit"] = acco.buffers.on_estimate
    try:
        model.to("cpu")
        out["to"] = "NO ERROR"
    except RuntimeError as exc:
        out["to"] = str(exc)
    acco.close()
    resident, racco = build(dict(case, sharded=False))
    feed(resident, racco, 0, 4)
    racco.save_checkpoint(resident_ckpt)
    racco.close()
    model, acco = build(case)
    feed(model, acco, 0, 4)
    acco.load_checkpoint(resident_ckpt)  # another layout: a fresh phase at the loaded committed θ
    out["after_fallback_load"] = {"on_estimate": acco.buffers.on_estimate, "global_steps": acco.global_steps}
    feed(model, acco, 4, 12)
    out["after_fallback_load"]["steps_later"] = acco.global_steps
    acco.close()
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


def data_parallel_meshes(case, layout):
    """ACCO FSDP2 training on a data-parallel mesh laid out as ``layout``:

    - 'world': a 1-D mesh over every rank (2 ranks: the reference);
    - 'subset': ranks 0 and 1 of 3 train over a mesh of their own; rank 2 builds nothing (it only
      enters the mesh group's creation, which torch requires of every rank);
    - '2d': a (dp 2, tp 2) mesh of 4 ranks, each rank's model sharded over its 'dp' sub-mesh
      ({0, 2} and {1, 3}), each data-parallel group trained on the reference's data.

    Then every rank creates one more group over the whole world and sums its rank over it: the
    ranks still agree on the names of the groups they create together. 'world' also closes a
    second AccoFSDP whose round in flight failed (acco.nonfinite 'raise')."""
    from datetime import timedelta
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout == "subset":
        pair = dist.new_group([0, 1])
        mesh = DeviceMesh.from_group(pair, "cpu") if rank in (0, 1) else None
    elif layout == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    out = {"rank": rank}
    if mesh is not None:
        with _late_rounds_group(layout == "2d" and rank == 1):  # after the other group's
            model, acco = build(case, mesh)
        dp_rank = dist.get_rank(mesh.get_group())
        out["dp_ranks"] = dist.get_process_group_ranks(mesh.get_group())
        members = torch.tensor([float(rank)])
        dist.all_reduce(members, group=acco.driver.process_group)  # the rounds' group: who is in it
        out["rounds_group_rank_sum"] = float(members)
        out["losses"] = []
        for i in range(case["gas"] * case["steps"]):
            loss = model(*batch(dp_rank, i))
            acco.backward(loss)
            acco.step()
            out["losses"].append(loss.item())
        with ds_acco.committed_weights(acco):
            out["final"] = live_snapshot(model)
        out["global_steps"] = acco.global_steps
        acco.close()
    if layout == "subset" and mesh is not None:
        out["again"] = subset_again(case, mesh)
        out["bound_device_error"] = bound_device_refusal()
    if layout == "world":
        out["failed_close"] = close_after_failed_round(case, mesh)
    everyone = dist.new_group(list(range(world)), timeout=timedelta(seconds=60))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=everyone)
    out["rank_sum"] = float(total)
    return out


@contextlib.contextmanager
def _late_rounds_group(late: bool):
    """Inside, this rank creates the rounds' group (ds_acco.comm.groups.new_rounds_group) 1 s late
    when ``late``: after its peers, which wait for it in the group's rendezvous."""
    from ds_acco.core import driver
    real = driver.new_rounds_group

    def delayed(*args, **kwargs):
        if late:
            time.sleep(1.0)
        return real(*args, **kwargs)
    driver.new_rounds_group = delayed
    try:
        yield
    finally:
        driver.new_rounds_group = real


def close_after_failed_round(case, mesh):
    """AccoFSDP.close() while the round in flight fails: what it raised, and whether the model is
    plain FSDP again (hooks gone, FSDP's own gradient reduce-scatter back)."""
    from torch.distributed.tensor import DTensor
    case = dict(case, acco=dict(case["acco"], nonfinite="raise"))
    model, acco = build(case, mesh)
    for i in range(case["gas"] // 2):  # one phase: its estimate round is in flight at close()
        x, y = batch(dist.get_rank(), i)
        if i == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        acco.backward(model(x, y))
        acco.step()
    try:
        acco.close()
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    model(*batch(dist.get_rank(), 0)).backward()  # plain FSDP: all-gather, then reduce-scatter
    grads = [p.grad for p in model.parameters()]
    return {"raised": raised, "hooks": len(acco._hooks),
            "plain_fsdp_grads": all(isinstance(g, DTensor) and bool(torch.isfinite(g.to_local()).all())
                                    for g in grads)}


def subset_again(case, mesh):
    """A second engine over the same subset, rank 1 creating its rounds' group late: the group must
    not reuse the first one's name (rank 0 would read that group's stale rendezvous keys meanwhile)."""
    with _late_rounds_group(dist.get_rank() == 1):
        model, acco = build(case, mesh)
    for i in range(case["gas"] * 3 // 2):  # three phases: the first commit is collected
        acco.backward(model(*batch(dist.get_rank(mesh.get_group()), i)))
        acco.step()
    steps = acco.global_steps
    acco.close()
    return steps


def bound_device_refusal():
    """new_rounds_group over a subset when the default group is bound to a device (eager NCCL
    init: torch would split its communicator, which every rank must enter): the error."""
    from datetime import timedelta
    from ds_acco.comm.groups import new_rounds_group
    world = dist.group.WORLD
    world.bound_device_id = torch.device("cuda", 0)  # what init_process_group(device_id=...) leaves
    try:
        new_rounds_group([0, 1], timedelta(seconds=10))
        return "NO ERROR"
    except ValueError as exc:
        return str(exc)
    finally:
        world.bound_device_id = None


# -- checkpoints on data-parallel meshes that are not the whole world ----------------------------
def _job_meshes():
    """4 ranks as two independent jobs: a (job 2, dp 2) mesh whose 'dp' groups {0, 1} and {2, 3}
    each train their own AccoFSDP (their own data: micro-batches by global rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("job", "dp"))["dp"], dist.get_rank() // 2


def _committed(model, acco):
    with ds_acco.committed_weights(acco):
        return live_snapshot(model)


def mesh_checkpoint_saves(case, root, saves, sigterm, total):
    """Each job trains ``total`` micro-batches three times: uninterrupted; saving after the
    micro-batches ``saves[job]`` to ``root/job<j>/mb<i>``; and stopped by a SIGTERM sent to global
    rank ``sigterm[job][0]`` after its micro-batch ``sigterm[job][1]`` (acco.sigterm 'checkpoint',
    one sigterm_checkpoint_dir in both jobs' config). Also: HSDP (fully_shard on the 2-D mesh) is
    still refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from ds_acco.fsdp import AccoFSDP
    mesh, job = _job_meshes()
    rank = dist.get_rank()
    out = {"rank": rank, "job": job}
    hsdp = sharded_tiny(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    try:
        AccoFSDP(hsdp, make_optimizer("sgd")(hsdp), ds_config(4, case["acco"])).close()
        out["hsdp"] = "NO ERROR"
    except ValueError as exc:
        out["hsdp"] = str(exc)

    model, acco = build(case, mesh)
    out["losses"] = feed(model, acco, 0, total)
    out["final"], out["global_steps"] = _committed(model, acco), acco.global_steps
    acco.close()

    model, acco = build(case, mesh)
    in_flight = []

    def save(i):
        if i in saves[job]:
            in_flight.append(acco.schedule.round_in_flight is not None)
            acco.save_checkpoint(os.path.join(root, f"job{job}", f"mb{i}"))
    out["saving_losses"] = feed(model, acco, 0, total, on_micro_batch=save)
    out["saved_with_a_round_in_flight"] = in_flight
    acco.close()

    model, acco = build(case, mesh)
    out["sigterm_dir"] = acco.sigterm_checkpoint_dir
    out["stopped_after"], out["stopped"] = feed_until_sigterm(model, acco, total, *sigterm[job])
    acco.close()
    return out


def mesh_checkpoint_resumes(case, root, saves, stopped_after, total):
    """In fresh processes: each job loads each of its checkpoints (``saves[job]`` under
    ``root/job<j>``, then its SIGTERM checkpoint, taken after micro-batch ``stopped_after[job]``)
    into a new model and trains on to ``total`` micro-batches. Then each job resumes the *other*
    job's last save, on that job's data ('moved': its ranks now have other global ranks)."""
    mesh, job = _job_meshes()
    rank = dist.get_rank()
    other = 1 - job
    out = {"rank": rank, "job": job}
    loads = [(i, os.path.join(root, f"job{job}", f"mb{i}"), i, rank) for i in saves[job]]
    loads.append(("sigterm", None, stopped_after[job], rank))
    loads.append(("moved", os.path.join(root, f"job{other}", f"mb{saves[other][-1]}"), saves[other][-1],
                  rank + 2 * (other - job)))
    for key, path, after, data_rank in loads:  # ``after``: the last micro-batch the checkpoint holds
        model, acco = build(case, mesh)
        acco.load_checkpoint(path or acco.sigterm_checkpoint_dir)
        loaded = acco.global_steps
        losses = feed(model, acco, after + 1, total, data_rank=data_rank)
        out[key] = {"losses": losses, "final": _committed(model, acco), "global_steps": acco.global_steps,
                    "loaded_steps": loaded}
        acco.close()
    return out


# -- close() gives the model back as the user configured it ---------------------------------------
def user_configured_model():
    """TinyNet sharded with settings of the user's own: fc1 resharded after forward (FSDP's default),
    fc2 kept unsharded after forward and after backward, the root as FSDP decides."""
    model = sharded_tiny(keep_fc2=True)
    model.fc2.set_reshard_after_backward(False)
    return model


def fsdp_behaviour(model):
    """What plain FSDP does with ``model``'s settings, per FSDP module: whether its parameters are
    sharded after a forward without backward (reshard_after_forward) and after a forward and
    backward (reshard_after_backward), and whether that backward left reduced, sharded gradients
    (gradient sync on)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    modules = {n or "root": m for n, m in model.named_modules() if isinstance(m, FSDPModule)}

    def sharded():
        return {n: [isinstance(p, DTensor) for p in m.parameters(recurse=False)] for n, m in modules.items()}
    x, y = batch(_rank(), 0)
    with torch.no_grad():
        model(x, y)
    after_forward = sharded()
    for m in modules.values():
        m.reshard()
    model(x, y).backward()
    after_backward = sharded()
    for m in modules.values():
        m.reshard()  # the sharded parameters again: FSDP's reduce-scatter leaves their gradients there
    out = {"after_forward": after_forward, "after_backward": after_backward,
           "reduced_grads": {n: [isinstance(p.grad, DTensor) for p in m.parameters(recurse=False)]
                             for n, m in modules.items()}}
    for p in model.parameters():
        p.grad = None
    return out


def close_gives_fsdp_back():
    """fsdp_behaviour of: a model never given to ACCO (the reference); models given back by close()
    after training with a round in flight (resident and sharded_params layouts); a model AccoFSDP
    refused after it had begun taking FSDP over (an optimizer over other parameters)."""
    from ds_acco.fsdp import AccoFSDP
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {"plain": fsdp_behaviour(user_configured_model())}
    for layout, sharded in (("resident", False), ("sharded", True)):
        model = user_configured_model()
        acco = AccoFSDP(model, make_optimizer("adamw")(model), ds_config(4, {"enabled": True, "mode": "acco"}),
                        sharded_params=sharded)
        feed(model, acco, 0, 6)  # a commit round in flight
        acco.close()
        out[layout] = fsdp_behaviour(model)
    model = user_configured_model()
    try:
        AccoFSDP(model, torch.optim.SGD(TinyNet().parameters(), lr=0.1), ds_config(4, {"enabled": True}))
        out["refused"] = "NO ERROR"
    except ValueError as exc:
        out["refusal"] = str(exc)
        try:
            out["refused"] = fsdp_behaviour(model)
        except RuntimeError as exc:  # e.g. ACCO's guard against FSDP's re-gather left in place
            out["refused"] = f"{type(exc).__name__}: {exc}"
    return out


# -- the exit path after a CommTimeoutError ------------------------------------------------------
def exit_after_a_timeout(comm_timeout_s):
    """A commit round stalls (gated on the lane), the wait for it in ``step()`` runs out
    (CommTimeoutError), and the program ends: the driver's at-exit hook runs, as at interpreter
    exit. The lane's blocking waits run on a fake clock: a wait for the stalled round runs out at
    once instead of after ``comm_timeout_s``, and a join of the lane's worker returns at once while
    the round is stalled. Returns every wait asked for, in order, among the events of the run."""
    import contextlib
    import io
    import threading
    from concurrent import futures
    from ds_acco.comm import lane as lane_module
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, acco = build({"optimizer": "sgd", "gas": 4,
                         "acco": {"enabled": True, "mode": "acco", "comm_timeout_s": comm_timeout_s}})
    lane = acco.driver.lane
    events, gate, stalled = [], threading.Event(), []
    inner_submit = lane.submit

    def submit(name, fn, **kwargs):
        if not name.startswith("commit"):
            return inner_submit(name, fn, **kwargs)
        handle = inner_submit(name, lambda: (gate.wait(), fn())[1], **kwargs)  # the peers never come
        stalled.append(handle.future)
        return handle
    lane.submit = submit

    def wait(fs, timeout=None):
        events.append(("wait for a round", timeout))
        if any(f in stalled for f in fs) and not gate.is_set():
            return set(), set(fs)  # the fake clock: comm_timeout_s has passed
        return futures.wait(fs, timeout=timeout)
    lane_module.futures = type("FakeClock", (), {"wait": staticmethod(wait)})

    def join(timeout=None, _join=None):
        events.append(("join the lane's worker", timeout))
        _join(timeout=0 if not gate.is_set() else timeout)
    try:
        for i in range(8):
            feed(model, acco, i, i + 1)
            if lane._thread is not None and "join" not in lane._thread.__dict__:
                worker = lane._thread
                worker.join = lambda timeout=None, _join=worker.join: join(timeout, _join)
    except lane_module.CommTimeoutError as exc:
        events.append(("CommTimeoutError", str(exc)))
    stderr = io.StringIO()
    events.append(("exit hook", None))
    with contextlib.redirect_stderr(stderr):
        acco.driver._at_exit()  # what atexit runs at interpreter exit
    events.append(("exit hook returned", None))
    lane_module.futures = futures
    gate.set()  # let the stalled round end before the process group does
    worker.__dict__.pop("join", None)
    worker.join(60)
    return {"events": events, "stderr": stderr.getvalue(), "abandoned": acco.driver.abandoned,
            "worker_ended": not worker.is_alive()}
