"""``python -m ds_acco``: command-line tools.

    python -m ds_acco check CONFIG.json     # the resolved "acco" block as JSON, or the errors (exit 2)
    python -m ds_acco check CONFIG.json --world-size 2   # checked for 2 data-parallel ranks
    python -m ds_acco check acco.json       # a config shipped with ds_acco, by name
    python -m ds_acco check CONFIG.json --gas 4   # the trainer supplies gradient_accumulation_steps (Lightning)
    python -m ds_acco configs [NAME]        # paths of the shipped configs (ds_acco.configs)
    python -m ds_acco ab|advise|cluster-test  # moved: exit 2, naming python -m benchmarks ... (a checkout)
    python -m ds_acco run SCRIPT.py ARGS... # ds_acco.install(), then SCRIPT as __main__ (unedited)
    python -m ds_acco run -m MODULE ARGS... # the same for a module (python -m MODULE)

``run`` turns ACCO on in a script you do not edit (HF example scripts, Megatron-DeepSpeed's
pretrain_gpt.py): its ``deepspeed.initialize`` calls honour the config's ``"acco"`` block, exactly
as if the script had called ``ds_acco.install()`` first. ``sys.argv`` is ``[SCRIPT, ARGS...]`` and
the script's directory is first on ``sys.path``, as with ``python SCRIPT.py``. Launchers:
``torchrun --nproc_per_node N -m ds_acco run SCRIPT.py ARGS`` or
``deepspeed --num_gpus N --module ds_acco run SCRIPT.py ARGS`` (the ``--local_rank=K`` that the
deepspeed launcher puts before ``run`` is handed on to the script).

``check`` validates the ``"acco"`` block (every key, with its default when absent) and, when ACCO is
enabled, the DeepSpeed settings it depends on (ZeRO stage, an even ``gradient_accumulation_steps``
in mode ``acco``, fp16 loss-scaling options, bf16 with fp32 accumulation, offload, every refused key
of ``ds_acco/config_keys.py``, the parallel
layouts the config itself asks for: AutoTP, sequence parallelism), through DeepSpeed's own config
parser, without starting any process group, at the data-parallel size ``--world-size N`` (under
tensor / pipeline parallelism: GPUs / (TP x PP)). Without it the size is ``train_batch_size /
(train_micro_batch_size_per_gpu x gradient_accumulation_steps)`` when the config sets all three
(Megatron-DeepSpeed's templates do), else 1. CONFIG is a path or, when no such file exists, the
name of a shipped config. The JSON goes to stdout, notes and errors to stderr.

``--gas K``: the trainer, not the JSON, supplies ``gradient_accumulation_steps`` (Lightning's
``DeepSpeedStrategy`` refuses the key in the config and sets it from ``Trainer(accumulate_grad_batches=K)``,
and ``train_micro_batch_size_per_gpu`` from the loader when absent: 1 here, as ACCO's checks do not
depend on it). The config is checked with K filled in; a config that sets the key to another value
is an error. Without ``--gas``, a config with ACCO enabled and neither ``gradient_accumulation_steps``
nor ``train_batch_size`` fails DeepSpeed's default of 1, and the error names ``--gas``.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from typing import List, Optional

from . import configs

EXIT_OK, EXIT_ERROR = 0, 2
# The A/B runner, the advisor and the emulated cluster are instruments, not part of a training job:
# they live in the checkout's benchmarks/ package, which the library never imports.
MOVED_COMMANDS = ("ab", "advise", "cluster-test")


def _has_auto(value) -> bool:
    """Whether a config holds HF's ``"auto"`` placeholders (filled by the Trainer at run time)."""
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_auto(v) for v in value)
    return value == "auto"


GAS = "gradient_accumulation_steps"


def _from_trainer(raw: dict, gas: Optional[int]) -> dict:
    """``raw`` with the trainer's ``gradient_accumulation_steps`` (``--gas``) filled in."""
    if gas is None:
        return raw
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(f"--gas {gas!r}: the trainer's gradient accumulation must be an integer >= 1 "
                         "(Lightning: Trainer(accumulate_grad_batches=K))")
    if GAS in raw and raw[GAS] != gas:
        raise ValueError(f"{GAS} = {raw[GAS]!r} in the config, but --gas {gas} says the trainer supplies it; fix: "
                         f"remove {GAS} from the config (Lightning refuses it there) or drop --gas")
    return {"train_micro_batch_size_per_gpu": 1, **raw, GAS: gas}


def _gas_hint(given: dict, gas: Optional[int], acco, error: Exception) -> str:
    """Where the fix of an error about the accumulation goes when the trainer supplies it, or may."""
    if GAS not in str(error):
        return ""
    if gas is not None:
        return f"; {GAS} comes from the trainer here (--gas): set it there (Lightning: Trainer(accumulate_grad_batches))"
    if "acco" not in acco.schedule_modes() or GAS in given or "train_batch_size" in given:
        return ""
    return (f"; the config has no {GAS}: if your trainer supplies it (Lightning: Trainer(accumulate_grad_batches=K)), "
            "check with --gas K")


def check(path: str, out=None, err=None, world_size: Optional[int] = None, gas: Optional[int] = None) -> int:
    """Validate the config at ``path`` (or the shipped config of that name) for ``world_size``
    data-parallel ranks (None: inferred, see the module docstring), with ``gas`` as the
    ``gradient_accumulation_steps`` the trainer supplies (None: the config's own); print the
    resolved block (stdout) or the errors (stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    from .config import (ACCO_KEY, BATCH_KEYS, acco_config_of, data_parallel_size, deepspeed_config_at,
                         load_ds_config, requested_layout)
    from .config_keys import check_deepspeed_compat
    from .core.checks.refusals import check_layout

    try:
        found = configs.resolve(path)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_ERROR
    if found != path:
        print(f"{path}: the config shipped with ds_acco, {found}", file=err)
    try:
        raw = load_ds_config(found)
        if not isinstance(raw, dict):
            raise ValueError(f"the top level must be a JSON object, got {type(raw).__name__}")
        acco = acco_config_of(raw)
        given, raw = raw, _from_trainer(raw, gas)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"{path}: error: {exc}", file=err)
        return EXIT_ERROR
    resolved = acco.model_dump(mode="json")
    if acco.enabled and acco.accumulation == "dynamic" and isinstance(raw.get(GAS), int):
        resolved["dynamic"] = acco.dynamic_bounds(raw[GAS]).model_dump(mode="json")
    if gas is not None:
        print(f"{path}: {GAS} = {gas} from the trainer (--gas; Lightning: Trainer(accumulate_grad_batches={gas}))",
              file=err)
    if ACCO_KEY not in raw:
        print(f"{path}: no \"{ACCO_KEY}\" block: stock DeepSpeed ZeRO (the defaults below are what an empty "
              "block means)", file=err)
    elif not acco.enabled:
        print(f"{path}: acco.enabled = false: stock DeepSpeed ZeRO", file=err)
    elif _has_auto(raw):
        print(f"{path}: has \"auto\" values (filled by HF Trainer / Accelerate at run time): DeepSpeed-side checks "
              "skipped; they run when the engine is built", file=err)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # parsing needs no device; keep DeepSpeed from probing
        try:
            size = data_parallel_size(raw, world_size)
            check_deepspeed_compat(acco, deepspeed_config_at(raw, size))
            check_layout(acco, requested_layout(raw))  # what the config alone asks for: AutoTP, Ulysses
        except Exception as exc:  # DeepSpeed's parser raises AssertionError, ValueError, pydantic errors...
            print(f"{path}: error: {exc}{_gas_hint(given, gas, acco, exc)}", file=err)
            return EXIT_ERROR
        if world_size is not None:
            how = "--world-size"
        elif all(k in raw for k in BATCH_KEYS):
            how = "train_batch_size / (train_micro_batch_size_per_gpu x gradient_accumulation_steps)"
        else:
            how = "the default; pass --world-size N to check for N data-parallel ranks"
        print(f"{path}: checked at data-parallel size {size} ({how})", file=err)
    print(json.dumps({ACCO_KEY: resolved}, indent=2), file=out)
    return EXIT_OK


def list_configs(name: Optional[str] = None, out=None, err=None) -> int:
    """Print the path of every shipped config, one per line (or of the one named ``name``)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        paths = [configs.path(name)] if name else [configs.path(n) for n in configs.names()]
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_ERROR
    print("\n".join(paths), file=out)
    return EXIT_OK


def moved_command(command: str, err=None) -> int:
    """``python -m ds_acco ab|advise|cluster-test``: these left the library; say where they went."""
    err = err or sys.stderr
    print(f"'python -m ds_acco {command}' moved out of the installed library: run 'python -m benchmarks {command} "
          "...' from the root of a ds_acco checkout (benchmarks/ is not in the wheel; see BENCHMARKS.md)", file=err)
    return EXIT_ERROR


RUN_USAGE = ("usage: python -m ds_acco run SCRIPT.py [ARGS...] | python -m ds_acco run -m MODULE [ARGS...]: "
             "runs SCRIPT (or MODULE) as __main__ after ds_acco.install()")


def run_script(argv: List[str], err=None) -> int:
    """``python -m ds_acco run SCRIPT.py ARGS`` / ``run -m MODULE ARGS``: ``ds_acco.install()``, then
    the script as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``. Its exit status is ours."""
    err = err or sys.stderr
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(RUN_USAGE, file=err)
        return EXIT_OK if argv and argv[0] in ("-h", "--help") else EXIT_ERROR
    from . import install
    install()
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]  # runpy replaces [0] with the module's path
        sys.path.insert(0, os.getcwd())  # as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return EXIT_OK
    script, rest = argv[0], argv[1:]
    if not os.path.exists(script):
        print(f"error: no such script: {script}\n{RUN_USAGE}", file=err)
        return EXIT_ERROR
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python SCRIPT.py does
    runpy.run_path(script, run_name="__main__")
    return EXIT_OK


def _split_launcher_args(argv: List[str]) -> tuple:
    """The deepspeed launcher's ``--module`` mode puts ``--local_rank=K`` before our command."""
    lead = []
    while argv and argv[0].startswith("--local_rank"):
        lead.append(argv.pop(0))
        if lead[-1] == "--local_rank" and argv:
            lead.append(argv.pop(0))
    return lead, argv


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lead, argv = _split_launcher_args(argv)
    if argv and argv[0] == "run":  # the script parses its own options: no argparse here
        rest = argv[1:]
        if lead and rest:
            at = 2 if rest[0] == "-m" else 1
            rest = rest[:at] + lead + rest[at:]
        return run_script(rest)
    if argv and argv[0] in MOVED_COMMANDS:  # before argparse: their own options must not be parsed here
        return moved_command(argv[0])
    p = argparse.ArgumentParser(prog="python -m ds_acco", description="ds_acco: ACCO for DeepSpeed ZeRO-1.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="validate a DeepSpeed config's \"acco\" block; print it resolved as JSON")
    c.add_argument("config", help="path to a DeepSpeed JSON config, or the name of a shipped one (e.g. acco.json)")
    c.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="data-parallel size to check at (GPUs / (tensor x pipeline parallel size)); default: "
                   "train_batch_size / (micro batch x gradient_accumulation_steps) when all three are set, else 1")
    c.add_argument("--gas", type=int, default=None, metavar="K",
                   help="the trainer supplies gradient_accumulation_steps = K, not the config (Lightning: "
                   "Trainer(accumulate_grad_batches=K)); checked with K filled in")
    c = sub.add_parser("configs", help="print the paths of the configs shipped with ds_acco")
    c.add_argument("name", nargs="?", help="print only this one's path (e.g. acco.json)")
    sub.add_parser("run", help="ds_acco.install(), then run SCRIPT.py ARGS (or -m MODULE ARGS) as __main__",
                   add_help=False)
    for name in MOVED_COMMANDS:
        sub.add_parser(name, help=f"moved: python -m benchmarks {name} in a checkout", add_help=False)
    args = p.parse_args(argv)
    if args.command == "configs":
        return list_configs(args.name)
    return check(args.config, world_size=args.world_size, gas=args.gas)


__all__ = ["check", "moved_command", "list_configs", "main", "run_script"]
