"""The scale model's equations against hand-computed values, its check against the committed
emulated records, and the advisor's one-round recommendation (no launches: all arithmetic)."""
from __future__ import annotations

import os

import pytest

from benchmarks import advisor, advisor_check, scale_check, scale_model
from benchmarks.scale_model import Link, Setup, step_times

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = Link("test", node_bps=10e9, alpha_s=1e-5)


def _setup(**kw) -> Setup:
    base = dict(params=1e9, gpus=16, gpus_per_node=8, eta=0.5, nvlink_bps=100e9, nvlink_alpha_s=1e-6,
                micro_batch_s=0.1, opt_step_s=0.05, gas=8)
    return Setup(**{**base, **kw})


def test_step_times_by_hand():
    # 2 nodes x 8 GPUs, 2 GB of bf16 per collective. NVLink: 7/8 x 2e9 / (0.5 x 100e9) + 7 hops x 1 us;
    # link: 1/2 x 2e9 / (0.5 x 10e9) + 1 hop x 10 us
    coll = 7 / 8 * 2e9 / 50e9 + 7e-6 + 0.5 * 2e9 / 5e9 + 1e-5
    assert scale_model.collective_s(_setup(), LINK) == pytest.approx(coll, rel=1e-12)
    stock_round = 2 * coll + 0.05  # reduce-scatter + shard step + all-gather
    acco_round = stock_round + 3 * 2 * (7e-6 + 1e-5)  # + three tiny all-reduces
    st = step_times(_setup(), LINK)
    assert st["compute_s"] == pytest.approx(0.8)
    assert st["round_s"] == pytest.approx(acco_round, rel=1e-12)
    assert st["stock"] == pytest.approx(0.8 + stock_round, rel=1e-12)
    assert st["fixed"] == pytest.approx(2 * max(0.4, acco_round), rel=1e-12)  # each half: max(half compute, round)
    assert st["fixed"] == pytest.approx(1.040272, rel=1e-6)
    assert st["one_round"] == pytest.approx(0.8) == st["dpu"]  # one round under the whole step
    assert st["r"] == pytest.approx(acco_round / 0.4, rel=1e-12)
    # where a round fits under half the compute both ACCO modes cost the compute alone
    long = step_times(_setup(gas=32), LINK)
    assert long["fixed"] == pytest.approx(3.2) and long["one_round"] == pytest.approx(3.2)
    # gloo: the reduce costs an all-reduce (f = 2), the all-gather does not change
    gloo = step_times(_setup(reduce_factor=2.0), LINK)
    assert gloo["round_s"] - st["round_s"] == pytest.approx(coll, rel=1e-9)


def test_the_ring_factor_counts_the_nodes():
    # (n-1)/n of the tensor crosses each node's link: 1/2 at 2 nodes, 7/8 at 8
    one_level = lambda s: scale_model.collective_s(s, LINK) - scale_model.collective_s(s, Link("∞", 1e30, 0))  # noqa: E731
    assert one_level(_setup(gpus=16)) == pytest.approx(0.5 * 2e9 / 5e9 + 1e-5, rel=1e-9)
    assert one_level(_setup(gpus=64)) == pytest.approx(7 / 8 * 2e9 / 5e9 + 7e-5, rel=1e-9)
    # one node: NVLink only, nothing on the link
    assert one_level(_setup(gpus=8)) == pytest.approx(0.0, abs=1e-12)


def test_tensor_parallel_inside_the_node_leaves_the_link_load_and_drops_nvlink():
    tp1, tp8 = _setup(gpus=64), _setup(gpus=64, tp=8)
    inter = 7 / 8 * 2e9 / 5e9 + 7e-5
    assert scale_model.collective_s(tp8, LINK) == pytest.approx(inter, rel=1e-9)
    assert scale_model.collective_s(tp1, LINK) > scale_model.collective_s(tp8, LINK)
    # TP 2: four data-parallel ranks per node, each on its half of the tensor over NVLink
    tp2 = _setup(gpus=64, tp=2)
    assert scale_model.collective_s(tp2, LINK) == pytest.approx(3 / 4 * 1e9 / 50e9 + 3e-6 + inter, rel=1e-9)
    assert tp8.dp == 8 and step_times(_setup(gpus=8, tp=8), LINK)["round_s"] == 0.0  # DP 1: no round


def test_derived_compute_optimizer_step_and_accumulation():
    s = Setup(params=7e9, gpus=64)  # H100 bf16 peak at 40% MFU, 4096 tokens per micro-batch
    assert s.t == pytest.approx(6 * 7e9 * 4096 / (989e12 * 0.4))
    assert s.opt_s == pytest.approx(30 * 7e9 / 64 / 3.35e12)  # 30 bytes per shard parameter over HBM
    assert s.accumulation == 16  # 4M tokens / (64 x 4096)
    assert Setup(params=7e9, gpus=1024).accumulation == 2  # at least 2 (fixed needs two halves): 8M tokens
    assert Setup(params=70e9, gpus=64, tp=8).t == pytest.approx(6 * 70e9 * 4096 / (8 * 989e12 * 0.4))
    with pytest.raises(ValueError, match="eta"):
        Setup(params=1e9, gpus=8, eta=1.5)


def test_table_covers_the_grid_and_marks_what_does_not_apply():
    rows = scale_model.table_rows()
    assert len(rows) == 3 * 4 * 2
    by = {(w["model"], w["gpus"], w["link"]): w for w in rows}
    assert by[("70B", 8, "eth100")]["dp"] == 1 and "DP 1" in scale_model._note(by[("70B", 8, "eth100")])
    eth = by[("7B", 64, "eth100")]  # a round under half the step: fixed and one-round both hide it
    assert eth["r"] < 1 and eth["fixed"] == pytest.approx(eth["compute_s"]) == eth["one_round"]
    far = by[("1B", 1024, "eth100")]  # r > 2: fixed's two rounds lose to stock, one-round still gains
    assert far["r"] > 2 and far["fixed"] > far["stock"] > far["one_round"]
    assert scale_model.markdown(rows).count("\n") == 1 + len(rows)
    assert scale_model.markdown(rows, compact=True).count("\n") == 1 + 3 * 3  # one node: nothing to compare


def test_check_against_the_committed_emulated_records():
    res = scale_check.check(os.path.join(REPO, "docs", "bench"))
    assert res["records"] >= 90 and res["out_of_sample"]["n"] >= 200
    assert res["eta"] == pytest.approx(0.62)  # fitted on emulation-one-round (docs/bench/scale-model)
    assert res["in_sample"]["median_abs"] < 0.03
    assert res["out_of_sample"]["median_abs"] < 0.05  # 3.9% recorded
    # the tail too, not only the median: 25.5% at the 90th percentile recorded (30.4% at η 1, the nominal rate)
    assert res["out_of_sample"]["p90_abs"] < 0.27 and res["ideal_eta_1"]["p90_abs"] > 0.27
    # r <= 1: 2.5% median, 28.4% max recorded (the max: 4 ranks sharing 2 cores, emulation-w4-rep)
    assert res["by_r"]["r <= 1"]["median_abs"] < 0.035 and res["by_r"]["r <= 1"]["max_abs"] < 0.30
    assert res["by_r"]["r <= 1"]["p90_abs"] < 0.11  # 8.7% recorded
    assert res["ideal_eta_1"]["median_abs"] > 1.5 * res["out_of_sample"]["median_abs"]  # the calibration matters
    assert {r["mode"] for r in res["rows"]} == {"stock", "fixed", "dpu"}
    # each variant at its own micro-batches per step (ttt-ratio1.5 ran stock at 16 beside ACCO's 8)
    big = [r for r in res["rows"] if "stockgas16" in r["record"]]
    assert len(big) == 3 and {r["gas"] for r in big} == {16} and max(abs(r["error"]) for r in big) < 0.2
    with pytest.raises(ValueError, match="no points"):
        scale_check.fit_eta([])


def test_advisor_recommends_one_round_where_one_round_per_step_is_fastest():
    p = advisor.Probe(micro_batch_s=0.1, all_reduce_s=0.3, all_gather_s=0.2)  # one round 0.5 s
    adv = advisor.advise(p, gas=8, one_round=True)  # stock 1.3 s, fixed 2 x 0.5 s, one-round max(0.8, 0.5) s
    assert adv.predictions["one_round"].step_s == pytest.approx(0.8) == adv.predictions["dpu"].step_s
    assert adv.mode == "one_round" and adv.gradient_accumulation_steps == 8
    assert "1.62x stock" in adv.reason and "+3.61%" in adv.reason
    assert advisor.advise(p, gas=16, one_round=True).mode == "fixed"  # a round fits under each half: fixed
    assert advisor.advise(p, gas=8).mode == "stock"  # by default the one-round mode is left out (it trains worse)
    busy = advisor.Probe(micro_batch_s=0.1, all_reduce_s=0.3, all_gather_s=0.2, micro_batch_overlap_s=0.2,
                         round_overlap_s=0.8)
    assert advisor.predict(busy, 16)["one_round"].step_s == pytest.approx(0.8 + 12 * 0.1)  # W(A)


def test_advisor_check_scores_one_round_on_the_dpu_points():
    probe = {"micro_batch_s": 0.1, "all_reduce_s": 0.3, "all_gather_s": 0.2}
    runs = [{"label": f"r{i}", "world": 2, "gas": 8, "probe": probe,
             "variants": {"stock": {"step_s": 1.3}, "dpu": {"step_s": m}}} for i, m in enumerate((0.8, 1.0))]
    res = advisor_check.out_of_sample(runs)
    one = [r for r in res["rows"] if r["mode"] == "one_round"]
    assert [(r["run"], r["measured"], r["predicted"]) for r in one] == [("r0", 0.8, pytest.approx(0.8)),
                                                                        ("r1", 1.0, pytest.approx(0.8))]
    assert res["out_of_sample"]["mean_abs_error_by_mode"]["one_round"] == pytest.approx(0.1)
    assert res["out_of_sample"]["n"] == 4  # stock and dpu twice: one-round does not count DPU's points again


def test_the_command_prints_the_committed_tables(capsys):
    from benchmarks.__main__ import main
    bench = os.path.join(REPO, "docs", "bench", "scale-model")
    for args, name in ((["--table", "--compact"], "table-compact.md"), (["--table"], "table.md"),
                       (["--table", "--eta", "0.62"], "table-eta0.62.md"),
                       (["--check", os.path.join(REPO, "docs", "bench")], "check.md")):
        assert main(["scale-model", *args]) == 0
        with open(os.path.join(bench, name)) as f:
            assert capsys.readouterr().out == f.read(), name
    assert main(["scale-model", "--links", "eth100,nope"]) == 2
