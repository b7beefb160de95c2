"""Rank functions for tests/integration/test_one_answer.py: a real ``accelerate.Accelerator`` and a
real ``transformers.Trainer`` driving ACCO, recorded so a test can replay them in the float64
reference.

* :func:`accelerate_run` -- the plain Accelerate loop of Accelerate's docs:
  ``with accelerator.accumulate(model): loss = model(...); accelerator.backward(loss);
  optimizer.step(); scheduler.step(); optimizer.zero_grad()``, with a torch ``LambdaLR`` that
  Accelerate (not DeepSpeed) steps after every optimizer step, on the compute thread.
* :func:`trainer_run` -- ``Trainer.train()`` on a tiny GPT-2 (dropout 0) with a BPE tokenizer
  trained here on the embedded corpus (no hub), HF's linear-decay LR schedule, optionally saving
  a checkpoint and resuming from one. A ``Trainer`` subclass records the token rows each
  micro-batch was computed on, so the reference can replay exactly the Trainer's data.

``gated`` (Accelerate): every communication round is held until the compute lane has finished a
later micro-batch (tests/deepspeed/workers.py ``install_gated_lane``), so a round reads whatever the caller
changed meanwhile -- the worst timing, made deterministic.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR_LAMBDA_DECAY = 0.5  # the Accelerate loop's schedule: lr / (1 + 0.5 s) after s scheduler steps


def _acco_block(case):
    if case.get("acco") is None:
        return {}
    return {"acco": {"enabled": True, "mode": case.get("mode", "acco"), **case["acco"]}}


def _gate(engine, case):
    if not case.get("gated"):
        return None
    from workers import install_gated_lane
    return install_gated_lane(engine, gate_timeout_s=30.0)


def _committed(engine):
    import ds_acco
    if hasattr(engine.optimizer, "driver"):
        with ds_acco.committed_weights(engine):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


# -- Accelerate ---------------------------------------------------------------------------------
def accelerate_run(case: dict) -> dict:
    """``case``: acco (dict of "acco" keys, or None for stock), gas, steps, gated, nan_at ((rank,
    micro-batch) pairs whose input gets a NaN: a non-finite gradient, the step is skipped)."""
    import ds_acco
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from fixtures import TinyNet, make_optimizer

    ds_acco.install()
    sys.path.insert(0, REPO)
    from examples.finetune_hf_trainer import fix_accelerate_on_cpu_host
    fix_accelerate_on_cpu_host()
    _reset_accelerate()  # several Accelerators, one after the other, in this process
    rank = int(os.environ["RANK"])
    gas = case["gas"]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "zero_optimization": {"stage": 1},
           "gradient_clipping": 0.0, **_acco_block(case)}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=gas)
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + LR_LAMBDA_DECAY * s))
    if case.get("expect_error"):
        before = _acco_optimizers_built()
        try:
            accelerator.prepare(model, opt, sched)
        except ValueError as exc:
            return {"error": str(exc), "acco_optimizers_built": _acco_optimizers_built() - before}
        return {"error": None}
    engine, opt, sched = accelerator.prepare(model, opt, sched)
    log = _gate(engine, case)
    from lr_workers import record_used
    used = record_used(engine, engine.optimizer.optimizer) if hasattr(engine.optimizer, "driver") else None
    losses, lrs = [], []
    with warnings.catch_warnings(record=True) as caught:  # torch's scheduler-order warning, if any
        warnings.simplefilter("always")
        _accelerate_loop(accelerator, engine, opt, sched, case, rank, log, losses, lrs)
    order_warnings = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    if log is not None:
        log.end_of_data()
    out = {"final": _committed(engine), "losses": losses, "lrs": lrs, "engine": type(engine).__name__,
           "num_processes": accelerator.num_processes, "used": used, "skipped_steps": engine.skipped_steps,
           "order_warnings": order_warnings,
           "final_lr": [g["lr"] for g in engine.optimizer.param_groups]}
    engine.destroy()
    return out


def _accelerate_loop(accelerator, engine, opt, sched, case, rank, log, losses, lrs):
    from fixtures import batch
    gas, steps = case["gas"], case["steps"]
    for i in range(gas * steps):
        if log is not None:
            log.before_micro_batch(i)
        x, y = batch(rank, i)
        if [rank, i] in [list(p) for p in case.get("nan_at", ())]:
            x = x.clone()
            x[0, 0] = float("nan")
        losses.append(accelerate_micro_batch(accelerator, engine, opt, sched, lambda: engine(x, y)))
        if log is not None:
            log.after_micro_batch(i)
        if accelerator.sync_gradients:
            lrs.append(engine.optimizer.param_groups[0]["lr"])


def accelerate_micro_batch(accelerator, engine, opt, sched, forward) -> float:
    """One micro-batch of Accelerate's documented loop (``forward()`` returns the loss); its loss."""
    with accelerator.accumulate(engine):
        loss = forward()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return float(loss.detach())


def _acco_optimizers_built() -> int:
    import gc
    mod = sys.modules.get("ds_acco.deepspeed.optimizer")
    return 0 if mod is None else sum(isinstance(o, mod.AccoZeroOptimizer) for o in gc.get_objects())


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def accelerate_cases(cases):
    return [accelerate_run(c) for c in cases]


# -- HF Trainer ---------------------------------------------------------------------------------
SEQ, VOCAB, N_EMBD, N_LAYER = 32, 320, 32, 2


def build_tokenizer():
    """A byte-level BPE tokenizer trained here on the embedded corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.data import embedded_corpus
    text = embedded_corpus()[:200_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok), text


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=N_EMBD, n_layer=N_LAYER, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(cfg)


def trainer_run(case: dict) -> dict:
    """``case``: acco (dict or None), gas, steps, out_dir, save_steps (0: none), resume (checkpoint
    dir or None), lr, optim (TrainingArguments.optim; default: the Trainer's)."""
    import ds_acco
    from transformers import Trainer, TrainingArguments, set_seed

    ds_acco.install()
    sys.path.insert(0, REPO)
    from examples.finetune_hf_trainer import fix_accelerate_on_cpu_host
    fix_accelerate_on_cpu_host()
    os.environ["OMP_NUM_THREADS"] = "1"
    set_seed(0)
    tokenizer, text = build_tokenizer()
    ids = torch.tensor(tokenizer(text[:60_000])["input_ids"], dtype=torch.long)
    rows = ids[: (ids.numel() // SEQ) * SEQ].view(-1, SEQ)[:256]
    seen = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                seen.append(inputs["input_ids"].detach().clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
          **_acco_block(case)}
    if case.get("ds_warmup_lr"):  # DeepSpeed's WarmupLR, its values filled by the Trainer (warmup_steps)
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto"}}
    args = TrainingArguments(
        output_dir=case["out_dir"], deepspeed=ds, per_device_train_batch_size=2,
        gradient_accumulation_steps=case["gas"], learning_rate=case.get("lr", 3e-3), weight_decay=0.0,
        adam_beta2=0.99, max_grad_norm=0.0, lr_scheduler_type="linear", max_steps=case["steps"], logging_steps=1,
        save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 1,
        save_only_model=False, eval_strategy="no", report_to=[], dataloader_num_workers=0, seed=0, data_seed=0,
        disable_tqdm=True, use_cpu=True, warmup_steps=case.get("warmup_steps", 0),
        **({"optim": case["optim"]} if case.get("optim") else {}))
    trainer = Recording(model=build_model(), args=args, train_dataset=_Rows(rows))
    trainer.train(resume_from_checkpoint=case.get("resume"))
    engine = trainer.model_wrapped
    out = {"final": _committed(engine), "seen": seen, "engine": type(engine).__name__,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h],
           "lrs": [h.get("learning_rate") for h in trainer.state.log_history if "loss" in h],
           "global_step": trainer.state.global_step,
           # ACCO: each committed step's own norm (its round computed it), oldest first
           "commit_grad_norms": [m["grad_norm"] for m in getattr(engine, "acco_metrics_history", [])],
           "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
           # the estimate's lr_scale the schedule runs (the optimizer family's default unless the block sets it)
           "estimate_lr_scale": getattr(getattr(getattr(engine.optimizer, "schedule", None), "context", None),
                                        "estimate_lr_scale", None),
           "sync_warmup_steps": getattr(getattr(engine, "_acco_config", None), "sync_warmup_steps", None)}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def trainer_cases(cases):
    return [trainer_run(c) for c in cases]
