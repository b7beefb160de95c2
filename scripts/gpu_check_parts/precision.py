"""The precision, fsdp and tp parts: DeepSpeed's engine in fp32, bf16 and fp16, ds_acco's FSDP2
adapter (its sharded variant included) and a one-rank tensor-parallel mpu, each against the float64
reference (tests/reference.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .checks import EXACT, Checks, rel_error

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 1,
        "min_loss_scale": 1}  # tests/deepspeed/test_loss_scaling.py's: overflows first
FP32_CASE = {"optimizer": "adamw", "schedule": "inv", "clip": 0.05, "steps": 4, "gas": 4}
BF16_CASE = {"optimizer": "adamw-fast", "steps": 6, "gas": 4}  # adamw-fast: the schedules end far apart
FP16_CASE = {"optimizer": "sgd", "steps": 10, "gas": 4, "acco": {"enabled": True, "mode": "acco"}}


def _references(case: dict, mode: Optional[str] = None):
    """Case ``case``'s float64 θ_T of ``mode``, or of every schedule (mode None)."""
    from fixtures import TinyNet, batch, make_optimizer, make_scheduler
    from reference import mode_references, reference_run
    kw = dict(world=1, gas=case["gas"], steps=case["steps"], make_optimizer=make_optimizer(case["optimizer"]),
              make_scheduler=make_scheduler(case.get("schedule")), clip=case.get("clip", 0.0))
    if mode is None:
        return mode_references(TinyNet(seed=0), batch, **kw)
    return reference_run(TinyNet(seed=0), batch, mode=mode, **kw)


def _check_fp32(checks: Checks, name: str, train: Callable[[dict], dict], **case) -> dict:
    errors = {mode: rel_error(train(dict(FP32_CASE, acco={"enabled": True, "mode": mode}, **case))["final"],
                              _references(FP32_CASE, mode)) for mode in ("acco", "dpu")}
    checks.expect(name, all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    return errors


def _check_low_precision(checks: Checks, name: str, run: dict, case: dict, tol: float) -> None:
    from reference import nearest_own_reference

    def nearest_and_close():
        refs = _references(case)
        distances = nearest_own_reference(run["final_fp32"], refs, "acco", label=name)
        err = rel_error(run["final"], refs["acco"])
        assert err < tol, f"{name}: weights {err:.2e} from ACCO's reference (at most {tol:g})"
        return {"distances": distances, "rel_error": err}
    checks.holds(name, nearest_and_close)


def _check_fp16(checks: Checks, name: str, run: dict) -> None:
    from fixtures import TinyNet, batch, make_optimizer
    from reference import check_real_fp16
    checks.holds(name, lambda: check_real_fp16(run, TinyNet(seed=0), batch, world=1, gas=FP16_CASE["gas"],
                                               steps=FP16_CASE["steps"], fp16=FP16,
                                               make_optimizer=make_optimizer("sgd"), label=name))


def check_precision(checks: Checks, device: torch.device, args) -> dict:
    """DeepSpeed's engine: fp32 ACCO and DPU, bf16 and fp16 ACCO (tests/deepspeed/workers.py's runs)."""
    import workers
    fp32 = _check_fp32(checks, "precision.fp32", workers.train)
    bf16_case = dict(BF16_CASE, acco={"enabled": True, "mode": "acco"},
                     extra={"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    bf16 = workers.train(bf16_case)
    _check_low_precision(checks, "precision.bf16", bf16, bf16_case, 1e-2)
    fp16 = workers.train(dict(FP16_CASE, extra={"fp16": FP16}, fp16_on_cpu=device.type == "cpu"))
    _check_fp16(checks, "precision.fp16", fp16)
    return {"fp32_rel_error": fp32, "bf16_param_dtype": bf16["param_dtype"], "fp16_param_dtype": fp16["param_dtype"],
            "fp16_skipped_steps": fp16["skipped_steps"]}


def check_fsdp(checks: Checks, device: torch.device, args) -> dict:
    """ds_acco's FSDP2 adapter on a one-rank mesh of the device (tests/fsdp/fsdp_workers.py's runs)."""
    import fsdp_workers
    fp32 = _check_fp32(checks, "fsdp.fp32", fsdp_workers.run)
    bf16_case = dict(BF16_CASE, mp=True, acco={"enabled": True, "mode": "acco"})
    bf16 = fsdp_workers.run(bf16_case)
    _check_low_precision(checks, "fsdp.bf16", bf16, bf16_case, 3e-2)
    fp16 = fsdp_workers.fp16_run(dict(FP16_CASE, extra={"fp16": FP16}, mp="fp16"))
    _check_fp16(checks, "fsdp.fp16", fp16)
    sharded = _check_fp32(checks, "fsdp.sharded", fsdp_workers.run, sharded=True)
    return {"fp32_rel_error": fp32, "sharded_fp32_rel_error": sharded, "fp16_param_dtype": fp16["param_dtype"],
            "fp16_skipped_steps": fp16["skipped_steps"]}


def check_tp(checks: Checks, device: torch.device, args) -> dict:
    """Tensor parallelism through an ``mpu`` on a one-rank tensor-parallel group (world size 1)."""
    import tp_workers
    from fixtures import batch
    from reference import reference_run
    errors = {}
    for opt in ("sgd", "adamw"):
        case = {"acco": {"enabled": True, "mode": "acco"}, "optimizer": opt, "clip": 0.05, "gas": 4, "steps": 3,
                "tp": 1, "dp": 1}
        got = tp_workers.train_tp(case)["final"]
        want = reference_run(tp_workers.FullNet(seed=0), batch, world=1, gas=4, steps=3, mode="acco",
                             make_optimizer=tp_workers.make_optimizer(opt), clip=0.05)
        errors[opt] = rel_error(tp_workers.gather_full(got, [got]), want)
    checks.expect("tp.reference", all(e < EXACT for e in errors.values()), errors,
                  f"relative error vs the float64 reference above {EXACT:g}: {errors}")
    return {"rel_error": errors}
