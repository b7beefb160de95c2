"""Rank functions for tests/integration/test_exports.py: a real ``accelerate.Accelerator`` (DeepSpeed
plugin) and a real ``transformers.Trainer`` train a tiny GPT-2 with ACCO; the model is then
exported through every path a user has, and a fresh process reloads each export and evaluates it.

After ``A·T`` micro-batches in fixed mode the commit round of step T-1 is in flight and the model's
parameters are the estimate θ̃_T (the last phase was an estimate phase): an export that reads the
parameters as they are gets θ̃, not the committed θ_T that an evaluation inside
``ds_acco.committed_weights`` sees.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import ds_acco

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 2  # token rows per micro-batch


def _rows(seed: int, n: int = ROWS):
    from hf_workers import SEQ, VOCAB
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def micro_batch(rank: int, i: int):
    return _rows(1000 * rank + i + 7)


def eval_rows():
    return _rows(424242, 4)


def eval_loss(model) -> float:
    """The held-out loss of ``model`` (a bare GPT-2) as a float: the same computation in any process."""
    x = eval_rows()
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss)


def snapshot(module) -> dict:
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


def _accelerator(gas: int, acco: dict | None):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from hf_workers import _reset_accelerate
    ds_acco.install()
    sys.path.insert(0, REPO)
    from examples.finetune_hf_trainer import fix_accelerate_on_cpu_host
    fix_accelerate_on_cpu_host()
    _reset_accelerate()  # several Accelerators, one after the other, in this process
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    if acco is not None:
        cfg["acco"] = {"enabled": True, **acco}
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=gas)


def _prepared(gas: int, acco: dict | None):
    from hf_workers import build_model
    accelerator = _accelerator(gas, acco)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    engine, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, engine, opt, sched


def _train(accelerator, engine, opt, sched, start: int, stop: int, on_micro_batch=None):
    """Accelerate's documented loop over micro-batches ``start..stop-1``; returns the losses."""
    from hf_workers import accelerate_micro_batch
    rank = int(os.environ["RANK"])
    losses = []
    engine.train()  # once, as an epoch starts: an export in the loop is followed by a forward, nothing else
    for i in range(start, stop):
        x = micro_batch(rank, i)
        forward = lambda: engine(input_ids=x, labels=x).loss  # noqa: E731
        losses.append(accelerate_micro_batch(accelerator, engine, opt, sched, forward))
        if on_micro_batch is not None:
            on_micro_batch(i)
    return losses


def accelerate_exports(case: dict, out_dir: str) -> dict:
    """Train ``gas * steps`` micro-batches, then export through each path, one at a time, each
    starting from the state the loop left (the model back on the estimate between two exports).
    Returns where each export lies, the in-loop evaluation on θ and the estimate for contrast."""
    gas, steps = case["gas"], case["steps"]
    accelerator, engine, opt, sched = _prepared(gas, case.get("acco", {}))
    rank = accelerator.process_index
    unwrapped = accelerator.unwrap_model(engine)
    _train(accelerator, engine, opt, sched, 0, gas * steps)
    schedule = getattr(engine.optimizer, "schedule", None)
    out = {"engine": type(engine).__name__, "num_processes": accelerator.num_processes,
           "in_flight": None if schedule is None else str(schedule.round_in_flight),
           "estimate": snapshot(unwrapped), "paths": {}, "live_between": []}

    def back_to_the_loop_state():
        engine.train()  # what the next training call does: the live weights the loop left
        out["live_between"].append(all(torch.equal(p, out["estimate"][n]) for n, p in snapshot(unwrapped).items()))

    path = os.path.join(out_dir, "get_state_dict.pt")
    state = accelerator.get_state_dict(engine)  # every rank, as Accelerate's docs do
    if accelerator.is_main_process:
        torch.save(state, path)
    out["paths"]["get_state_dict"] = ("state_dict", path)
    back_to_the_loop_state()

    path = os.path.join(out_dir, "unwrapped_state_dict.pt")
    if accelerator.is_main_process:  # rank 0 alone: no collective, no wait on a peer
        torch.save(unwrapped.state_dict(), path)
    out["paths"]["unwrap_model().state_dict"] = ("state_dict", path)
    accelerator.wait_for_everyone()
    back_to_the_loop_state()

    path = os.path.join(out_dir, "save_pretrained")
    if accelerator.is_main_process:
        unwrapped.save_pretrained(path)
    out["paths"]["save_pretrained"] = ("pretrained", path)
    accelerator.wait_for_everyone()
    back_to_the_loop_state()

    path = os.path.join(out_dir, "save_16bit_model")
    engine.save_16bit_model(path)  # every rank, as DeepSpeed's docs say
    out["paths"]["save_16bit_model"] = ("state_dict", os.path.join(path, "pytorch_model.bin"))
    back_to_the_loop_state()

    path = os.path.join(out_dir, "checkpoint")
    engine.save_checkpoint(path, tag="final")
    out["paths"]["zero_to_fp32"] = ("zero", path)
    back_to_the_loop_state()

    # The in-loop evaluation, on θ (the README's way), and the committed weights it ran on.
    with ds_acco.committed_weights(engine):
        out["committed"] = snapshot(unwrapped)
        out["eval_loss"] = eval_loss(unwrapped)
    out["global_steps"] = engine.global_steps
    accelerator.wait_for_everyone()
    if rank != 0:
        out["paths"] = {}
    engine.destroy()
    return out


def load_export(kind: str, path: str):
    """A fresh bare GPT-2 holding what one export wrote."""
    from transformers import GPT2LMHeadModel

    from hf_workers import build_model
    if kind == "pretrained":
        return GPT2LMHeadModel.from_pretrained(path)
    if kind == "zero":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(path, tag="final")
    else:
        state = torch.load(path, weights_only=True)
    model = build_model()
    model.load_state_dict(state)
    return model


def reload_and_evaluate(paths: dict) -> dict:
    """In a fresh process: each export reloaded, its weights and its held-out loss."""
    out = {}
    for name, (kind, path) in paths.items():
        model = load_export(kind, path)
        out[name] = {"weights": snapshot(model), "eval_loss": eval_loss(model)}
    return out


# -- training goes on after an export, bit for bit --------------------------------------------------
def accelerate_export_mid_loop(case: dict, out_dir: str) -> dict:
    """Two runs of ``gas * steps`` micro-batches: one that only evaluates on θ (inside
    ``committed_weights``) after micro-batch ``at``, one that exports there instead (rank 0:
    ``unwrap_model(model).state_dict()``; every rank: ``get_state_dict``) and goes on training.
    The export must be that θ, and the run must go on exactly as the first."""
    gas, steps, at = case["gas"], case["steps"], case["at"]
    out = {}
    for name in ("evaluated", "exported"):
        accelerator, engine, opt, sched = _prepared(gas, case.get("acco", {}))
        unwrapped = accelerator.unwrap_model(engine)
        seen = {}

        def at_micro_batch(i, name=name, engine=engine, accelerator=accelerator, unwrapped=unwrapped, seen=seen):
            if i not in at:
                return
            if name == "evaluated":
                seen[f"kind{i}"] = str(engine.optimizer.schedule.round_in_flight)
                with ds_acco.committed_weights(engine):
                    seen[i] = snapshot(unwrapped)
                return
            if accelerator.is_main_process:
                path = os.path.join(out_dir, f"mid{i}.pt")
                torch.save(unwrapped.state_dict(), path)
                seen[i] = {n: t.clone() for n, t in torch.load(path, weights_only=True).items()}
            state = accelerator.get_state_dict(engine)
            seen[f"all{i}"] = {n: state[n] for n, _ in unwrapped.named_parameters()}

        losses = _train(accelerator, engine, opt, sched, 0, gas * steps, at_micro_batch)
        with ds_acco.committed_weights(engine):
            final = snapshot(unwrapped)
        out[name] = {"losses": losses, "final": final, "seen": seen, "global_steps": engine.global_steps}
        engine.destroy()
    return out


# -- HF Trainer --------------------------------------------------------------------------------------
def trainer_exports(case: dict) -> dict:
    """``Trainer.train()`` with ACCO, then ``trainer.evaluate()`` and exports: the Trainer's
    ``save_model`` (every rank), ``trainer.model.save_pretrained`` (rank 0) and Accelerate's
    ``get_state_dict`` (every rank), each from the state ``train()`` left."""
    from transformers import Trainer, TrainingArguments, set_seed

    from hf_workers import SEQ, VOCAB, _Rows, build_model
    ds_acco.install()
    sys.path.insert(0, REPO)
    from examples.finetune_hf_trainer import fix_accelerate_on_cpu_host
    fix_accelerate_on_cpu_host()
    os.environ["OMP_NUM_THREADS"] = "1"
    set_seed(0)
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, VOCAB, (128, SEQ), generator=g)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
          "acco": {"enabled": True, **case.get("acco", {})}}
    out_dir = case["out_dir"]
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=ds, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=case["gas"], learning_rate=3e-3, weight_decay=0.0, adam_beta2=0.99,
        max_grad_norm=0.0, lr_scheduler_type="linear", max_steps=case["steps"], logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to=[], dataloader_num_workers=0, seed=0, data_seed=0,
        disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=build_model(), args=args, train_dataset=_Rows(rows), eval_dataset=_Rows(rows[:8]))
    trainer.train()
    engine = trainer.model_wrapped
    model = trainer.model
    is_main = trainer.is_world_process_zero()
    out = {"engine": type(engine).__name__, "in_flight": str(engine.optimizer.schedule.round_in_flight),
           "estimate": snapshot(model), "paths": {}, "live_between": []}

    def back_to_the_loop_state():
        engine.train()
        out["live_between"].append(all(torch.equal(p, out["estimate"][n]) for n, p in snapshot(model).items()))

    path = os.path.join(out_dir, "pretrained")
    if is_main:
        model.save_pretrained(path)
    out["paths"]["model.save_pretrained"] = ("pretrained", path)
    trainer.accelerator.wait_for_everyone()
    back_to_the_loop_state()

    path = os.path.join(out_dir, "save_model")
    trainer.save_model(path)
    out["paths"]["Trainer.save_model"] = ("pretrained", path)
    back_to_the_loop_state()

    path = os.path.join(out_dir, "get_state_dict.pt")
    state = trainer.accelerator.get_state_dict(engine)
    if is_main:
        torch.save(state, path)
    out["paths"]["accelerator.get_state_dict"] = ("state_dict", path)
    trainer.accelerator.wait_for_everyone()
    back_to_the_loop_state()

    out["trainer_eval_loss"] = trainer.evaluate()["eval_loss"]  # the Trainer's own, on θ (ds_acco.install())
    with ds_acco.committed_weights(engine):
        out["committed"] = snapshot(model)
        out["eval_loss"] = eval_loss(model)
    if not is_main:
        out["paths"] = {}
    engine.destroy()
    return out


# -- FSDP2 ----------------------------------------------------------------------------------------
def _slow_estimate(acco, seconds: float):
    """The estimate of an optimizer without a functional step (snapshot, real step on the master
    shards, read, restore) held ``seconds`` inside, with the shards on θ̃. Returns one event per
    estimate round, in order (the estimate of step t is the (t+1)-th): set once that round is inside."""
    import itertools
    import threading
    so = acco.driver.shard_optimizer
    inner, inside, calls = so.estimate, [threading.Event() for _ in range(64)], itertools.count()

    def estimate(grads, read, groups=None, **kw):
        entered = inside[next(calls)]

        def slow_read():
            out = read()
            entered.set()
            time.sleep(seconds)
            return out
        return inner(grads, slow_read, groups, **kw)
    so.estimate = estimate
    return inside


def fsdp_exports(case: dict, out_dir: str) -> dict:
    """Two AccoFSDP runs of ``gas * steps`` micro-batches: one evaluates on θ (inside
    ``committed_weights``) after each micro-batch in ``at``, the other exports there instead
    (rank 0 alone: ``model.state_dict()``, its local shards; every rank: ``get_model_state_dict``
    full) and, after the loop, writes the full state dict (rank 0) for a fresh process to reload."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fixtures import batch
    from fsdp_workers import build, feed, live_snapshot
    from workers import install_slow_lane
    rank, total, at = int(os.environ["RANK"]), case["gas"] * case["steps"], case["at"]
    full = StateDictOptions(full_state_dict=True)
    out = {}
    for name in ("evaluated", "exported"):
        model, acco = build(case)
        inside = None
        if name == "exported":  # each round starts late: an export right after a launch meets it unfinished
            install_slow_lane(None, 0.3, schedule=acco.schedule)
            inside = _slow_estimate(acco, 1.0) if case.get("slow_estimate") else None
        seen = {}

        def at_micro_batch(i, name=name, model=model, acco=acco, seen=seen, inside=inside):
            if i not in at:
                return
            if inside is not None and str(acco.schedule.round_in_flight) == "RoundKind.ESTIMATE":
                step = acco.schedule.inflight.step
                assert inside[step].wait(60), f"the estimate round of step {step} never reached its step"
                # the master shards are on θ̃ now, for a second
            if name == "evaluated":
                seen[f"kind{i}"] = str(acco.schedule.round_in_flight)
                with ds_acco.committed_weights(acco):
                    seen[i] = live_snapshot(model)  # fp32, no mixed precision: the masters' values
                    seen[f"local{i}"] = {n: p.to_local().clone() for n, p in model.acco_test_masters.items()}
                return
            if rank == 0:  # rank 0 alone: FSDP's sharded state dict, no collective
                seen[f"local{i}"] = {n: t.to_local().clone() for n, t in model.state_dict().items()}
            seen[i] = {n: t.clone() for n, t in get_model_state_dict(model, options=full).items()}

        losses = feed(model, acco, 0, total, at_micro_batch)
        run = {"losses": losses, "seen": seen, "in_flight": str(acco.schedule.round_in_flight)}
        if name == "exported":
            state = get_model_state_dict(model, options=full)  # after the loop, a commit in flight
            if rank == 0:
                torch.save(state, os.path.join(out_dir, "fsdp_full.pt"))
        with ds_acco.committed_weights(acco):
            run["final"] = live_snapshot(model)
            with torch.no_grad():
                device = next(model.parameters()).device
                run["eval_loss"] = float(model(*(t.to(device) for t in batch(0, 999))))
        run["global_steps"] = acco.global_steps
        acco.close()
        out[name] = run
    return out


def reload_tiny_and_evaluate(path: str) -> dict:
    """In a fresh process: a plain TinyNet with the exported state dict, and its held-out loss."""
    from fixtures import TinyNet, batch
    model = TinyNet()
    model.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        loss = float(model(*batch(0, 999)))
    return {"weights": snapshot(model), "eval_loss": loss}


# -- a plain DeepSpeed loop: the hold's edges ------------------------------------------------------
def _engine(acco: dict):
    from fixtures import TinyNet, ds_config, make_optimizer
    model = TinyNet(seed=0)
    engine, *_ = ds_acco.initialize(model=model, optimizer=make_optimizer("adamw")(model),
                                    config=ds_config(4, {"enabled": True, **acco}))
    return engine


def _feed(engine, start: int, stop: int, after_step=None) -> list:
    """Micro-batches ``start..stop-1`` of this rank's data; ``after_step(i)`` after each ``step()``."""
    from fixtures import batch
    rank, losses = int(os.environ["RANK"]), []
    for i in range(start, stop):
        loss = engine(*(t.to(engine.device) for t in batch(rank, i)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(i)
    return losses


def _loss(module) -> float:
    from fixtures import batch
    device = next(module.parameters()).device
    return float(module(*(t.to(device) for t in batch(0, 999))))


def ds_hold_edges() -> dict:
    """Fixed mode, after a loop that ends with a commit in flight, on rank 0 alone: an export, an
    evaluation-mode forward after it (on θ, what was exported), a training forward (back on θ̃),
    a deep copy of the model (inert hooks: no effect on the engine), and the model after
    ``destroy()`` (θ, no hooks of ours left). Rank 1 only trains and destroys."""
    import copy
    engine = _engine({"mode": "acco"})
    module, schedule = engine.module, engine.optimizer.schedule
    _feed(engine, 0, 12)
    out = {"in_flight": str(schedule.round_in_flight)}
    if int(os.environ["RANK"]) == 0:
        estimate = snapshot(module)
        copied = copy.deepcopy(module)
        copied.state_dict()  # a copy's export touches nothing of the engine's
        out["held_after_copies"] = getattr(schedule, "holds_committed_weights", False)
        out["copy_is_estimate"] = _equal_dicts(snapshot(copied), estimate)
        exported = {n: t.clone() for n, t in module.state_dict().items()}
        out["exported"] = exported
        module.eval()
        with torch.no_grad():
            out["eval_after_export"] = _loss(module)  # an evaluation right after the export: on θ
        out["eval_weights"] = snapshot(module)
        module.train()
        with torch.no_grad():
            _loss(module)  # training mode: the hold ends before this forward
        out["train_forward_on_estimate"] = _equal_dicts(snapshot(module), estimate)
        try:  # AutoTP's consolidation (accelerator.get_state_dict) reads the parameters, not a state_dict()
            engine._consolidated_16bit_state_dict()
        except ValueError:  # not AutoTP here: DeepSpeed refuses, after the hold
            pass
        out["consolidation_holds"] = _equal_dicts(snapshot(module), out["exported"])
    with ds_acco.committed_weights(engine):
        out["committed"] = snapshot(module)
        out["committed_loss"] = _loss(module) if int(os.environ["RANK"]) == 0 else None
    engine.destroy()
    out["after_destroy"] = {n: t.clone() for n, t in module.state_dict().items()}
    out["hooks_after_destroy"] = sum(len(m._state_dict_pre_hooks) for m in module.modules())
    return out


def _equal_dicts(a: dict, b: dict) -> bool:
    return all(torch.equal(t, b[n]) for n, t in a.items())


def ds_dynamic_export(case: dict) -> dict:
    """Dynamic accumulation, every round a commit (dpu) that starts ``slow`` seconds late: rank 0
    exports alone right after the loop (its commit round unfinished: refused at once, no wait),
    then once that round has finished (no collective: the hold takes it), then every rank
    evaluates inside ``committed_weights`` (the agreed drain)."""
    engine = _engine(case["acco"])
    schedule = engine.optimizer.schedule
    from workers import install_slow_lane
    install_slow_lane(engine, case["slow"])
    _feed(engine, 0, case["micro_batches"])
    out = {"in_flight": str(schedule.round_in_flight)}
    if int(os.environ["RANK"]) == 0:
        import time as clock
        handle = schedule.inflight.handle
        try:
            engine.module.state_dict()
            out["refused"] = None
        except RuntimeError as exc:
            out["refused"] = f"{type(exc).__name__}: {exc}"
        out["unfinished_after_refusal"] = not handle.done()  # the refusal did not wait for the round
        out["estimate_left_alone"] = not getattr(schedule, "holds_committed_weights", False)
        deadline = clock.monotonic() + 120
        while not handle.done() and clock.monotonic() < deadline:
            clock.sleep(0.05)
        out["exported"] = {n: t.clone() for n, t in engine.module.state_dict().items()}
    with ds_acco.committed_weights(engine):
        out["committed"] = snapshot(engine.module)
    engine.destroy()
    return out
