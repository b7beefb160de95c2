"""Bytes on the wire per optimizer step: ACCO's all-gathers send parameters in the model dtype,
as stock ZeRO-1 / FSDP2 do, whatever dtype gradients travel in; its reduces send gradients in the
same dtype as stock's. (ACCO has two rounds per step, each with one reduce and one gather.)"""
import pytest

import wire_workers
from dist import run_ranks

ACCO = {"enabled": True, "mode": "acco"}
BF16 = {"bf16": {"enabled": True}}
CASES = {
    # name: (DeepSpeed settings, the stock run to compare with, gradient dtype, parameter dtype)
    "fp32": ({}, {}, "torch.float32", "torch.float32"),
    "bf16": (BF16, BF16, "torch.bfloat16", "torch.bfloat16"),
    # DeepSpeed routes bf16 + fp32 accumulation to its BF16_Optimizer; stock ZeRO-1 bf16 that
    # communicates in fp32 is the comparable stock run.
    "bf16-fp32-accum": ({**BF16, "data_types": {"grad_accum_dtype": "fp32"}},
                        {**BF16, "communication_data_type": "fp32"}, "torch.float32", "torch.bfloat16"),
    "bf16-comm-fp32": ({**BF16, "communication_data_type": "fp32"}, {**BF16, "communication_data_type": "fp32"},
                       "torch.float32", "torch.bfloat16"),
    "fp32-comm-bf16": ({"communication_data_type": "bf16"}, {"communication_data_type": "bf16"},
                       "torch.bfloat16", "torch.float32"),
}


def summarize(per_step):
    """(kind, dtype) -> bytes, for each step."""
    out = []
    for calls in per_step:
        totals = {}
        for kind, dtype, nbytes in calls:
            totals[(kind, dtype)] = totals.get((kind, dtype), 0) + nbytes
        out.append(totals)
    return out


@pytest.fixture(scope="module")
def deepspeed_runs():
    cases = []
    for extra, stock_extra, _, _ in CASES.values():
        cases += [{"extra": extra, "acco": ACCO}, {"extra": stock_extra}]
    cases += [{"extra": BF16, "acco": {"enabled": True, "mode": "dpu"}}, {"extra": BF16}]
    out = run_ranks(wire_workers.deepspeed_cases, cases=cases)[0]
    runs = {name: (out[2 * i], out[2 * i + 1]) for i, name in enumerate(CASES)}
    runs["dpu"] = (out[-2], out[-1])
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_gathers_in_the_model_dtype(deepspeed_runs, name):
    acco, stock = deepspeed_runs[name]
    _, _, grad_dtype, param_dtype = CASES[name]
    for a, s in zip(summarize(acco["per_step"]), summarize(stock["per_step"])):
        print(name, "acco", a, "stock", s)
        stock_gather = s[("gather", param_dtype)]
        # every gather is in the model dtype, and each round gathers what stock gathers per step
        assert {k for k in a if k[0] == "gather"} == {("gather", param_dtype)}
        assert a[("gather", param_dtype)] == 2 * stock_gather
        # gradients: two rounds of the buffer in the gradient dtype; stock reduces the same bytes once
        assert {k for k in a if k[0] == "reduce"} == {("reduce", grad_dtype)}
        stock_reduce = sum(v for k, v in s.items() if k[0] == "reduce")
        assert {k for k in s if k[0] == "reduce"} == {("reduce", grad_dtype)}
        assert a[("reduce", grad_dtype)] == 2 * stock_reduce


def test_dpu_sends_stock_bytes_per_step(deepspeed_runs):
    acco, stock = deepspeed_runs["dpu"]
    assert summarize(acco["per_step"]) == summarize(stock["per_step"])


def test_fsdp_gathers_bf16_parameters_with_fp32_gradients():
    acco, stock = run_ranks(wire_workers.fsdp_cases, accos=[ACCO, None])[0]
    for a, s in zip(summarize(acco["per_step"]), summarize(stock["per_step"])):
        print("fsdp acco", a, "stock", s)
        assert {k for k in s if k[0] == "gather"} == {("gather", "torch.bfloat16")}
        assert {k for k in a if k[0] == "gather"} == {("gather", "torch.bfloat16")}
        assert {k for k in a if k[0] == "reduce"} == {("reduce", "torch.float32")}
        # FSDP pads each parameter's shard; ACCO's buffer has the same per-rank padded segments
        assert a[("gather", "torch.bfloat16")] == 2 * s[("gather", "torch.bfloat16")]
