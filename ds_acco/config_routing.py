"""An enabled ``"acco"`` block and the engine that gets built: ``DS_ACCO=off`` sets it aside on
purpose; a stock engine built from it is refused, with the launch that routes to ds_acco."""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

from .config_deepspeed import ACCO_KEY

OPT_OUT_ENV = "DS_ACCO"  # DS_ACCO=off: an enabled "acco" block is ignored, DeepSpeed trains stock ZeRO
_opt_out_noted = False


def opted_out(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``DS_ACCO=off`` is set: a user who shares one config between stock and ACCO runs
    trains stock with it on purpose. Any other non-empty value is an error naming the variable."""
    value = (os.environ if environ is None else environ).get(OPT_OUT_ENV, "").strip()
    if value.lower() == "off":
        return True
    if value:
        raise ValueError(f"{OPT_OUT_ENV} = {value!r}: unknown value; fix: {OPT_OUT_ENV}=off to train stock DeepSpeed "
                         "ZeRO with a config whose \"acco\" block is enabled, or unset it (ACCO then runs where the "
                         "launch routes to ds_acco: python -m ds_acco run, DS_ACCO_INSTALL=1, ds_acco.install())")
    return False


def note_opt_out(rank: Optional[int] = None) -> None:
    """Say once per process, on rank 0, that ``DS_ACCO=off`` set an enabled block aside."""
    global _opt_out_noted
    if _opt_out_noted:
        return
    _opt_out_noted = True
    if rank is None:
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(f"ds_acco: {OPT_OUT_ENV}=off: the config's \"acco\" block is enabled but ignored; DeepSpeed trains "
              "stock ZeRO", file=sys.stderr, flush=True)


RUN_THROUGH_DS_ACCO = ("launch the script through ds_acco: `python -m ds_acco run SCRIPT.py ARGS` (`torchrun ... -m "
                       "ds_acco run SCRIPT.py ARGS`, `deepspeed ... --module ds_acco run SCRIPT.py ARGS`, "
                       "`accelerate launch -m ds_acco run SCRIPT.py ARGS`), or set DS_ACCO_INSTALL=1 in its "
                       "environment, or call `import ds_acco; ds_acco.install()` before the code that builds the "
                       "engine (or ds_acco.initialize instead of deepspeed.initialize)")


def stock_engine_refusal(engine_class: str, routing_installed: bool) -> str:
    """Why a stock ``engine_class`` must not be built from a config whose ``"acco"`` block is
    enabled, and the launch fix: DeepSpeed ignores the block, so the run would measure stock ZeRO."""
    head = (f"this DeepSpeed config has \"{ACCO_KEY}\": {{\"enabled\": true}}, but the engine being built is a stock "
            f"{engine_class}: DeepSpeed ignores the \"{ACCO_KEY}\" block, so this run would train stock ZeRO without "
            "ACCO")
    if routing_installed:
        why = ("; ds_acco.install() is in effect, but this engine did not come through it: a deepspeed.initialize "
               "looked up before install() (e.g. `from deepspeed import initialize` in a module imported earlier), "
               "or an engine constructed directly; fix: call ds_acco.install() before the training code imports "
               "deepspeed (or launch through `python -m ds_acco run` or DS_ACCO_INSTALL=1, which install it as "
               "deepspeed is imported), or build the engine with ds_acco.initialize")
    else:
        why = f"; fix: {RUN_THROUGH_DS_ACCO}"
    return (f"{head}{why}. To train stock ZeRO with this config on purpose, set {OPT_OUT_ENV}=off (or "
            f"\"{ACCO_KEY}\": {{\"enabled\": false}}).")
