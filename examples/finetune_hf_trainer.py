"""Fine-tune a small GPT-2 with the Hugging Face ``Trainer`` and ACCO, through ``ds_acco.install()``.

    deepspeed --num_gpus 2 examples/finetune_hf_trainer.py --deepspeed_config ds_configs/acco.json
    torchrun --nproc_per_node 2 examples/finetune_hf_trainer.py --max-steps 20

The only ACCO-specific line is ``ds_acco.install()`` before the ``Trainer`` is built: the Trainer
(through Accelerate) calls ``deepspeed.initialize`` itself, and the installed router hands it to
ds_acco when the config's ``"acco"`` block is enabled. Without the block (``ds_configs/zero1.json``)
this is a plain HF + DeepSpeed ZeRO-1 run.

``TrainingArguments`` is the source of truth for the batch, the accumulation and the optimizer's
hyper-parameters: the keys HF fills from it (micro-batch size, ``gradient_accumulation_steps``,
the optimizer's lr / betas / eps / weight decay, ``gradient_clipping``) are set
to ``"auto"`` in the config given; the config contributes the ZeRO stage, the optimizer type and
the ``"acco"`` block. ACCO's mode ``acco`` needs an even ``--gradient-accumulation-steps``.

The model is the reference GPT-2 of :mod:`benchmarks.gpt` with random initialisation (256 bytes); the
data is the embedded standard-library docstring corpus of :mod:`benchmarks.data`, or ``--data-path``.
Nothing is downloaded. Rank 0 prints ``FINETUNE_RESULT {json}`` at the end (the losses the
Trainer logged, the held-out loss evaluated on committed weights, the engine's classes).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the library, and the demo model and corpus (benchmarks/), from the checkout

from ds_acco import configs  # noqa: E402
from benchmarks.gpt import gpt2_config  # noqa: E402  (the reference model's GPT2Config)

RESULT_TAG = "FINETUNE_RESULT"
# Keys HF's DeepSpeed integration fills from TrainingArguments when they are "auto".
_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
_AUTO_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", default=configs.path("acco.json"),
                   help="DeepSpeed JSON config; its 'acco' block switches ACCO on")
    p.add_argument("--output-dir", default=None, help="Trainer output dir (default: a temporary directory)")
    p.add_argument("--data-path", default="embedded",
                   help="'embedded' (default, no network), a local .txt/.json/.jsonl/.csv/.parquet path, or a hub "
                        "dataset name[:config] (needs 'datasets' and network)")
    p.add_argument("--max-steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--per-device-batch-size", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--gradient-accumulation-steps", type=int, default=4, help="even for ACCO's mode 'acco'")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--train-sequences", type=int, default=0,
                   help="use only this many training sequences (0: all); keeps smoke runs small")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-install", action="store_true", help="skip ds_acco.install() (shows what happens without it)")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's and transformers' INFO logging")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher; ignored")
    args = p.parse_args(argv)
    if args.max_steps < 1:
        p.error("--max-steps must be >= 1")
    return args


def hf_config(path: str) -> dict:
    """The DeepSpeed config at ``path`` with the keys HF fills from TrainingArguments set to "auto"."""
    with open(path) as f:
        cfg = json.load(f)
    out = copy.deepcopy(cfg)
    for key in _AUTO_KEYS:
        out[key] = "auto"
    # DeepSpeed derives it; HF's "auto" fill for it can use a world size of 1 (seen with
    # transformers 5.24 under the deepspeed launcher: 16 != 4 * 4 * 2).
    out.pop("train_batch_size", None)
    params = (out.get("optimizer") or {}).get("params")
    if params is not None:
        for key in _AUTO_OPTIMIZER_PARAMS:
            if key in params:
                params[key] = "auto"
    return out


class ByteLMDataset:
    """Rows of byte ids as ``{"input_ids", "labels"}`` (the model shifts the labels itself)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        row = self.rows[i]
        return {"input_ids": row, "labels": row.clone()}


def fix_accelerate_on_cpu_host() -> None:
    """CPU-only hosts: let Accelerate see the DeepSpeed ranks (a no-op where an accelerator exists).

    Accelerate (checked with 1.15) picks a distributed backend only from an accelerator it finds,
    or from ``use_cpu=True`` -- which excludes DeepSpeed. On a CPU-only host under a launcher it
    therefore starts DeepSpeed's process group but records one process: both ranks then read the
    same batches, ``gather`` fails in evaluation, and ``"auto"`` batch sizes use a world of 1.
    Here, that case gets gloo and the real world size, as DeepSpeed itself uses.
    """
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or \
            getattr(PartialState._prepare_backend, "_cpu_host_fix", False):
        return
    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if kind == DistributedType.NO and not cpu:
            return backend or "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    prepare_backend._cpu_host_fix = True
    PartialState._prepare_backend = prepare_backend
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")


def build_model(args):
    """The bare HF model of the reference GPT (the Trainer feeds it ``input_ids`` and ``labels``)."""
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel(gpt2_config(args.seq_length, args.n_embd, args.n_layer, n_head=4))


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import tempfile

    import torch

    torch.set_num_threads(1)
    from benchmarks.data import build_splits
    from ds_acco.install import install  # also exported as ds_acco.install

    if not args.no_install:
        install()  # the one ACCO line: before the Trainer calls deepspeed.initialize

    from transformers import Trainer, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging

    if not args.verbose:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
        hf_logging.set_verbosity_warning()
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

    fix_accelerate_on_cpu_host()
    set_seed(args.seed)
    # make_sequences cuts rows of seq_len + 1 tokens; the Trainer's rows are seq_length long.
    train_rows, heldout_rows = build_splits(args.data_path, seq_len=args.seq_length - 1, holdout=0.02, seed=0)
    if args.train_sequences:
        train_rows = train_rows[:args.train_sequences]
    model = build_model(args)
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp, deepspeed=hf_config(args.deepspeed_config),
            per_device_train_batch_size=args.per_device_batch_size, per_device_eval_batch_size=16,
            gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
            adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant",
            max_steps=args.max_steps, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
            dataloader_num_workers=0, seed=args.seed, data_seed=args.seed, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=ByteLMDataset(train_rows),
                          eval_dataset=ByteLMDataset(heldout_rows))
        trainer.train()
        metrics = trainer.evaluate()  # on committed weights (install() wraps evaluation_loop)
        engine = trainer.model_wrapped
        result = {
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "engine": type(engine).__name__,
            "optimizer": type(getattr(engine, "optimizer", None)).__name__,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "hf_global_step": trainer.state.global_step,
            "engine_global_steps": int(engine.global_steps),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": metrics["eval_loss"],
        }
        if hasattr(engine, "destroy"):
            engine.destroy()  # ACCO: drain the round in flight and stop the communication thread
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{RESULT_TAG} {json.dumps(result, sort_keys=True)}", flush=True)
    return result


if __name__ == "__main__":
    main()
