"""Rank functions for tests/deepspeed/test_export_alias.py: what reads an export *later* sees.

A stock ``state_dict()`` tensor aliases the live parameter, which changes only at the next optimizer
step, so a background reader (torch DCP's asynchronous staging, an upload) gets the weights of the
moment of the call as long as it reads before that step. Under ACCO the live parameters turn into the
estimate θ̃ at the next micro-batch. Both run the same loop here (TinyNet, AdamW, A = 4, fixed mode):
stock ZeRO-1 (``acco`` None) and ACCO.
"""
from __future__ import annotations

import os
import threading

import torch

import ds_acco
from export_workers import _feed
from fixtures import TinyNet, ds_config, make_optimizer

GAS = 4


def _engine(acco):
    import deepspeed
    model = TinyNet(seed=0)
    cfg = ds_config(GAS, None if acco is None else {"enabled": True, **acco})
    init = deepspeed.initialize if acco is None else ds_acco.initialize
    engine, *_ = init(model=model, optimizer=make_optimizer("adamw")(model), config=cfg)
    return engine


def _snapshot(module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _committed(engine) -> dict:
    """The weights a stock engine has now, or the newest committed θ of an ACCO engine."""
    with ds_acco.committed_weights(engine):  # a no-op for a stock engine
        return _snapshot(engine.module)


def _gated_stager(gate: threading.Event):
    """torch DCP's own stager, staging in its background thread, which starts copying only once
    ``gate`` is set: the loop goes on meanwhile (ordered by the event, not by timing)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class Gated(DefaultStager):
        def _stage(self, state_dict, **kwargs):
            if not gate.wait(120):
                raise TimeoutError("the test never opened the staging gate")
            return super()._stage(state_dict, **kwargs)
    return Gated(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                use_non_blocking_copy=False))


def _load(path: str, like: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    out = {n: torch.zeros_like(t) for n, t in like.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def ds_async_save(case: dict, out_dir: str) -> dict:
    """Two runs of ``3·A`` micro-batches: one plain, one with two ``dcp.async_save`` calls whose
    background staging reads the ``state_dict()`` tensors a few micro-batches later, and before the
    next optimizer step:

    * save 1, taken at the step boundary after micro-batch 7 (ACCO: the commit of step 2 in flight,
      the model on θ̃_2), staged after micro-batch 8 (ACCO's compute runs on θ̃_2);
    * save 2, taken after micro-batch 8, staged after micro-batch 10 (past ACCO's phase end at 9,
      where θ_2 comes into the live weights).
    Returns the weights each save wrote, the committed weights at each call, the losses and the final
    committed weights of both runs (training must not notice the exports)."""
    import torch.distributed.checkpoint as dcp
    acco = case.get("acco")
    plain = _engine(acco)
    plain_losses = _feed(plain, 0, 3 * GAS)
    plain_final = _committed(plain)
    plain.destroy()

    engine = _engine(acco)
    module, saves = engine.module, {}
    gates = {1: threading.Event(), 2: threading.Event()}

    def save(k: int) -> None:
        path = os.path.join(out_dir, f"rank{os.environ['RANK']}-save{k}")
        expected = _committed(engine)  # θ of this moment (waits for a commit in flight, then restores)
        stager = _gated_stager(gates[k])
        response = dcp.async_save(module.state_dict(), checkpoint_id=path, async_stager=stager, no_dist=True)
        saves[k] = {"path": path, "expected": expected, "response": response, "stager": stager,
                    "kind": str(getattr(getattr(engine.optimizer, "schedule", None), "round_in_flight", None))}

    def after_step(i: int) -> None:
        if i == 7:
            save(1)
        if i == 8:
            gates[1].set()
            saves[1]["response"].staging_completion.result(timeout=120)
            save(2)
        if i == 10:
            gates[2].set()
            saves[2]["response"].staging_completion.result(timeout=120)

    losses = _feed(engine, 0, 3 * GAS, after_step)
    out = {"losses": losses, "plain_losses": plain_losses, "final": _committed(engine), "plain_final": plain_final}
    for k, s in saves.items():
        s["response"].upload_completion.result(timeout=120)
        s["stager"].close()
        out[f"saved{k}"] = _load(s["path"], s["expected"])
        out[f"expected{k}"] = s["expected"]
        out[f"kind{k}"] = s["kind"]
    engine.destroy()
    return out


def _ema_update(ema: dict, weights, decay: float) -> None:
    for n, p in weights:
        ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)


def ds_ema(case: dict) -> dict:
    """An exponential moving average of the weights over ``steps`` optimizer steps.

    Stock: updated after each ``step()`` that ends an optimizer step, over ``parameters()``.
    ACCO: the same update in ``ds_acco.on_commit(engine, fn)`` (once per committed step, with the
    model's parameters on θ_t), and, for contrast, the stock code unchanged (over ``parameters()``
    after ``step()``: the estimate). A second ACCO run gives the committed θ_t at each step boundary
    (``committed_weights``): the sequence the EMA must average."""
    acco, steps, decay = case.get("acco"), case["steps"], case["decay"]
    engine = _engine(acco)
    module = engine.module
    start = _snapshot(module)
    out = {"theta0": start, "hooked_steps": [], "thetas": []}
    ema = {n: t.clone() for n, t in start.items()}
    naive = {n: t.clone() for n, t in start.items()}

    def after_step(i: int) -> None:
        if (i + 1) % GAS == 0:  # stock's optimizer step ended with this step()
            _ema_update(ema if acco is None else naive, module.named_parameters(), decay)
            if acco is None:
                out["thetas"].append(_snapshot(module))  # stock's θ_t

    if acco is not None:
        def on_commit(step: int) -> None:
            out["hooked_steps"].append(step)
            _ema_update(ema, module.named_parameters(), decay)
        ds_acco.on_commit(engine, on_commit)
    _feed(engine, 0, GAS * steps, after_step)
    engine.destroy()  # the last commit lands here (ACCO): its hook runs
    out["ema"], out["naive"] = ema, naive
    if acco is None:
        return out
    reference = _engine(acco)
    _feed(reference, 0, GAS * steps, lambda i: (i + 1) % GAS == 0 and out["thetas"].append(_committed(reference)))
    reference.destroy()
    return out
