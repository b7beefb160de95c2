"""Functions that run inside spawned ranks (importable by the spawn start method)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ds_acco
from fixtures import TinyNet, TokenNet, batch, ds_config, make_optimizer, make_scheduler, token_batch


def snapshot(module):
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


def train(case: dict, use_ds_acco: bool = True):
    """Train one case for gas*steps micro-batches; return losses and committed θ_T."""
    import deepspeed
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    model = TinyNet(seed=0)
    cfg = ds_config(case.get("gas", 4), case.get("acco"), clip=case.get("clip", 0.0), **case.get("extra", {}))
    init = ds_acco.initialize if use_ds_acco else deepspeed.initialize
    if case.get("fp16_on_cpu"):
        # DeepSpeed refuses fp16 where oneDNN lacks fp16 kernels; torch's CPU fp16 kernels run
        # this tiny model, so the real fp16 path (loss scaler, fp16 weights) can be exercised.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    if case["optimizer"].startswith("ds:"):  # DeepSpeed's config-built optimizer
        cfg["optimizer"] = DS_OPTIMIZERS[case["optimizer"]]
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        opt = make_optimizer(case["optimizer"])(model)
        sched = make_scheduler(case.get("schedule"))
        try:
            engine, _, _, _ = init(model=model, optimizer=opt, lr_scheduler=sched(opt) if sched else None,
                                   config=cfg)
        except ValueError as exc:
            if case.get("refused"):  # the case expects a refusal at initialize: report its message
                return {"refused": str(exc)}
            raise
    if case.get("sim_scaler"):
        install_dynamic_scaler(engine, case["sim_scaler"])
    lane_log = install_gated_lane(engine, case["gated"]) if case.get("gated") else None
    if lane_log is not None:
        try:
            return _train_loop(engine, case, rank, lane_log)
        except Exception as exc:  # a gate timed out: report it (and the log) instead of erroring the spawn
            lane_log.release_all()
            try:
                engine.destroy()
            except Exception:
                pass
            return {"lane_error": f"{type(exc).__name__}: {exc}", "lane_log": lane_log.events}
    return _train_loop(engine, case, rank, None)


def _train_loop(engine, case, rank, lane_log):
    loss_scales, rounds = [], {}
    losses, boundaries, lrs = [], [], []
    probes = {}
    n = case.get("gas", 4) * case["steps"]
    for i in range(n):
        x, y = batch(rank, i)
        if [rank, i] in [list(p) for p in case.get("nan_at", ())]:
            x = x.clone()
            x[0, 0] = float("nan")  # a non-finite gradient on one rank
        dtype = next(engine.module.parameters()).dtype
        if lane_log is not None:
            lane_log.before_micro_batch(i)
        loss = engine(x.to(engine.device, dtype), y.to(engine.device, dtype))  # the device: scripts/gpu_check.py
        engine.backward(loss)
        if [rank, i] in [list(p) for p in case.get("inf_grad_at", ())]:
            # an infinite (not NaN) gradient entry on one rank: written into the accumulated gradient
            # (p.grad is a view of ACCO's accumulator), so the round's global norm is +inf, not NaN
            with torch.no_grad():
                next(engine.module.parameters()).grad.view(-1)[0] = float("inf")
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        if i in case.get("override_at", {}):  # a loss scale set from outside, mid-phase
            engine.optimizer.override_loss_scale(case["override_at"][i])
        if lane_log is not None:
            lane_log.after_micro_batch(i)
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
        if hasattr(engine.optimizer, "schedule"):
            loss_scales.append(float(engine.optimizer.loss_scale))
            for r in engine.optimizer.schedule.recent_rounds:
                rounds[(r.kind.value, r.step)] = r.skipped
        if i in case.get("probe_at", ()):
            with ds_acco.committed_weights(engine):
                probes[i] = (engine.global_steps, snapshot(engine.module))
    if lane_log is not None:
        lane_log.end_of_data()
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
        steps = engine.global_steps
        final_fp32 = master_weights(engine) if next(engine.module.parameters()).dtype != torch.float32 else final
    if hasattr(engine.optimizer, "schedule"):
        for r in engine.optimizer.schedule.recent_rounds:
            rounds[(r.kind.value, r.step)] = r.skipped
    if lane_log is not None:
        lane_log.release_all()
    out = {"lane_error": None, "param_dtype": str(next(engine.module.parameters()).dtype), "skipped_steps": engine.skipped_steps, "losses": losses, "lane_log": lane_log.events if lane_log else None,
           "memory": memory_facts(engine) if hasattr(engine.optimizer, "schedule") else None, "final": final, "final_fp32": final_fp32, "global_steps": steps, "boundaries": boundaries, "lrs": lrs,
           "probes": probes, "optimizer": type(engine.optimizer).__name__, "loss_scales": loss_scales,
           "rounds": sorted(rounds.items()), "metrics": [dict(m) for m in getattr(engine, "acco_metrics_history", [])]}
    engine.destroy()
    return out


def master_weights(engine):
    """The committed fp32 master θ (full, gathered from the ZeRO shards; a collective: every rank
    calls it). With bf16/fp16 weights this is θ_T itself; the module holds its rounding."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}


def install_dynamic_scaler(engine, args: dict) -> None:
    """Give an fp32 engine DeepSpeed's fp16 dynamic loss scaler (fp16 itself cannot run
    everywhere): the loss is scaled in backward, G carries the scale, rounds divide it out and
    the scaler is updated once per committed step -- the fp16 code path, in exact fp32."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    opt = engine.optimizer
    opt.loss_scaler = DynamicLossScaler(**args)
    opt.dynamic_loss_scale = True
    opt.schedule.sync_accumulated_loss_scale()  # nothing accumulated yet (G is 0): G starts at this scale


def train_cases(cases, use_ds_acco=True):
    return [train(c, use_ds_acco) for c in cases]


DS_OPTIMIZERS = {
    # Single param group: matches fixtures.make_optimizer("adamw1").
    "ds:adamw-torch": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "weight_decay": 0.1,
                                                   "torch_adam": True}},
    "ds:adamw-fused": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    # DeepSpeed's "Adam" (FusedAdam's CPU op here) in L2 mode: torch Adam's step, as make_optimizer("adam")
    "ds:adam-fused": {"type": "Adam", "params": {"lr": 0.02, "betas": [0.9, 0.999], "adam_w_mode": False}},
}


class GatedLog:
    """Gates every communication round until the compute lane has computed a whole micro-batch
    that *started after the round was submitted*, and logs who did what, in order.

    Events: ("mb start", i) before the forward of micro-batch i, ("mb end", i) after its
    step(); ("round submit", k), ("round start", k) (on the lane, before the gate),
    ("gate open", k, i) (opened by micro-batch i), ("round end", k). The micro-batch whose
    backward/step submitted a round does not count (it started before the submit). A compute
    lane that blocked on the round in flight (in backward, step or the forward) never finishes
    such a micro-batch, the gate never opens, and the round fails on its gate timeout (short and
    scaled: the test fails in seconds with that message instead of hanging). Rounds submitted
    after the last micro-batch started are opened by :meth:`end_of_data` (nothing could overlap
    them) and reported as such."""

    def __init__(self, gate_timeout_s: float):
        import threading
        self.lock = threading.Lock()
        self.events = []
        self.gates = []  # (k, threading.Event, position of its submit in events)
        self.gate_timeout_s = gate_timeout_s

    def log(self, *event):
        with self.lock:
            self.events.append(event)
            return len(self.events) - 1

    def before_micro_batch(self, i):
        self.log("mb start", i)

    def after_micro_batch(self, i):
        with self.lock:
            self.events.append(("mb end", i))
            started = self.events.index(("mb start", i))
            for k, gate, submitted_at in self.gates:
                if not gate.is_set() and started > submitted_at:
                    self.events.append(("gate open", k, i))
                    gate.set()

    def end_of_data(self):
        """No more micro-batches: open the gates still closed (the final drain needs them)."""
        with self.lock:
            for k, gate, _ in self.gates:
                if not gate.is_set():
                    self.events.append(("gate open", k, "end of data"))
                    gate.set()

    def release_all(self):
        for _, gate, _ in self.gates:
            gate.set()


class GateTimeout(RuntimeError):
    """A gated round's gate never opened (not a TimeoutError: the lane would report that as its own
    comm_timeout_s, hiding this message)."""


def install_gated_lane(engine, gate_timeout_s: float = 5.0):
    import threading
    log = GatedLog(gate_timeout_s)
    lane = engine.optimizer.schedule.lane
    inner_submit = lane.submit

    def submit(name, fn, **kwargs):
        gate = threading.Event()
        with log.lock:
            k = len(log.gates)
            log.events.append(("round submit", k))
            log.gates.append((k, gate, len(log.events) - 1))

        def gated():
            log.log("round start", k)
            if not gate.wait(log.gate_timeout_s):
                raise GateTimeout(
                    f"gated lane: round {k} ('{name}') waited {log.gate_timeout_s:.0f} s and no micro-batch that started "
                    "after its submit finished: the compute lane is blocked on the round in flight (no overlap)")
            out = fn()
            log.log("round end", k)
            return out
        return inner_submit(name, gated, **kwargs)

    lane.submit = submit
    return log


def memory_facts(engine):
    """What ACCO allocates beyond stock ZeRO-1: no DeepSpeed buckets or hooks, one comm buffer."""
    opt = engine.optimizer
    storages = {g.grads.untyped_storage().data_ptr() for g in opt.schedule.groups}
    return {
        "grad_hooks": len(opt._grad_acc_hooks),
        "ipg_buffers": sum(len(b.buffer) for b in opt.ipg_buckets.values()),
        "averaged_gradients": len(opt.averaged_gradients),
        "accum_dtype": str(opt.accum_dtype), "comm_dtype": str(opt.comm_dtype),
        "comm_bytes": sum(g.comm.numel() * g.comm.element_size() for g in opt.schedule.groups),
        # one full-size buffer of the wider of the gradient and model dtypes
        "buffer_bytes": sum(g.live.numel() * max(g.live.element_size(), opt.comm_dtype.itemsize)
                            for g in opt.schedule.groups),
        "grads_are_views": all(p.grad is not None and p.grad.untyped_storage().data_ptr() in storages
                               for p in engine.module.parameters()),
    }


def init_errors(cases):
    """Try ds_acco.initialize with each (config overrides, model kind); return the error messages."""
    out = []
    for overrides, kind in cases:
        cfg = ds_config(4, {"enabled": True, "mode": "acco"})
        for k, v in overrides.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        if kind == "pipeline":
            from deepspeed.pipe import PipelineModule
            model = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss())
        else:
            model = TinyNet()
        opt = None if kind == "no-optimizer" else make_optimizer("adamw")(model)
        try:
            engine, *_ = ds_acco.initialize(model=model, optimizer=opt, model_parameters=model.parameters(),
                                            config=cfg)
            out.append(f"NO ERROR ({type(engine.optimizer).__name__})")
            engine.destroy()
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
        except Exception as exc:  # reported so the test can show it
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def install_slow_lane(engine, seconds, schedule=None):
    """Every round sleeps ``seconds`` on the lane first (an injected slow network). ``schedule``:
    an AccoFSDP's (default: the DeepSpeed engine's)."""
    import time
    lane = (schedule or engine.optimizer.schedule).lane
    inner_submit = lane.submit

    def submit(name, fn, **kwargs):
        def slow():
            time.sleep(seconds)
            return fn()
        return inner_submit(name, slow, **kwargs)
    lane.submit = submit


def train_until(case: dict):
    """Feed micro-batches until ``case['steps']`` commits; return what a replay needs.
    ``case['save']``: (dir, n) saves tag 'step<n>' right after the step() that committed the n-th
    step; ``case['resume']``: (dir, n) loads it first and goes on (its micro-batch index too)."""
    import os
    import time
    rank = int(os.environ["RANK"])
    model = TokenNet(seed=0) if case.get("tokens") else TinyNet(seed=0)
    cfg = ds_config(case.get("gas", 4), case["acco"], clip=case.get("clip", 0.0), **case.get("extra", {}))
    opt = make_optimizer(case["optimizer"])(model)
    sched = make_scheduler(case.get("schedule"))
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched(opt) if sched else None,
                                         config=cfg)
    if case.get("slow_lane"):
        install_slow_lane(engine, case["slow_lane"])
    schedule = engine.optimizer.schedule
    sleep = case.get("sleep", {}).get(str(rank), 0.0)
    i, losses, shares, aligned = 0, [], [], []
    if case.get("resume"):
        path, client = engine.load_checkpoint(case["resume"][0], tag=f"step{case['resume'][1]}")
        assert path is not None
        i = client["fed"][rank]
    save_dir, save_at = case.get("save", (None, None))
    while engine.global_steps < case["steps"]:
        if case.get("tokens"):
            x, y, mask = token_batch(rank, i)
            loss = engine(x, y, mask)
            engine.backward(loss, weight=float(mask.sum()))
        else:
            loss = engine(*batch(rank, i))
            engine.backward(loss)
        if sleep:
            time.sleep(sleep)
        if case.get("finish_rounds_first"):  # let the round in flight finish before the phase can end
            inflight = schedule.inflight
            deadline = time.time() + 60
            while inflight is not None and not inflight.handle.done() and time.time() < deadline:
                time.sleep(0.001)
        engine.step()
        i += 1
        losses.append(loss.item())
        shares.append(getattr(schedule.phases, "shares", None))
        aligned.append(getattr(schedule.phases, "aligned", None))
        if save_dir is not None and engine.global_steps == save_at:
            # Ranks consume their data unevenly in dynamic and shared mode: every rank's position goes
            # into the checkpoint (DeepSpeed writes client_state from rank 0 only).
            fed = [None] * dist.get_world_size()
            dist.all_gather_object(fed, i)
            engine.save_checkpoint(save_dir, tag=f"step{save_at}", client_state={"fed": fed})
            save_dir = None
    with ds_acco.committed_weights(engine):
        final = snapshot(engine.module)
    out = {
        "final": final,
        "losses": losses,
        "shares": shares,  # after each micro-batch (accumulation 'shared')
        "aligned": aligned,  # after each micro-batch: every phase so far had equal shares ('shared')
        "drains_agree_by_protocol": schedule.agrees_drains,  # at the end, before the final drain
        "fed": i,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "phases": [{"kind": p.kind.value, "data_step": p.data_step, "micro_batches": p.tally.micro_batches,
                    "weight": p.tally.weight, "wait_s": p.wait_s, "reason": p.reason} for p in schedule.history],
        "seconds_per_micro_batch": schedule.seconds_per_micro_batch,
        "metrics": engine.acco_metrics_history,
        "max_micro_batches": getattr(schedule.phases, "max_micro_batches", None),
    }
    engine.destroy()
    return out


def train_until_cases(cases):
    return [train_until(c) for c in cases]
