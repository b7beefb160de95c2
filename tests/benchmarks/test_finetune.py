"""The short fine-tune fidelity bench (benchmarks/finetune.py, scripts/finetune_fidelity.sh): the
table's arithmetic and refusals, the task's split, and (slow) the driver end to end at a tiny size:
stock and ACCO under the real HF Trainer on 2 ranks, each writing the record the table reads."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import finetune as ft
from benchmarks import finetune_summary as ft_summary
from benchmarks import finetune_task as ft_task

from dist import communicate
from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_launchers import base_env, start, tail  # noqa: E402  (the launcher tests' environment)

SETTINGS = {"max_steps": "60"}
HASHES = {k: "h" for k in ft_summary.PAIRING_KEYS}


def record(variant, seed, loss, acc=0.5, engine=None, **over):
    block = None if variant == "stock" else {"enabled": True}
    r = {"version": ft_summary.RECORD_VERSION, "variant": variant, "seed": seed, "acco": block,
         "engine": engine or ("DeepSpeedEngine" if block is None else "AccoEngine"),
         "heldout_loss": loss, "heldout_accuracy": acc, "settings": SETTINGS, **HASHES}
    r.update(over)
    return r


# -- the table ------------------------------------------------------------------------------------
def test_gap_table_per_seed_median_and_range():
    stock = [2.0, 1.0, 4.0, 1.6, 0.5]
    acco = [2.02, 0.99, 4.4, 1.6, 0.52]  # gaps +1, -1, +10, 0, +4 %
    records = [record("stock", s, v) for s, v in enumerate(stock)] + \
              [record("acco", s, v) for s, v in enumerate(acco)]
    t = ft_summary.gap_table(records, "stock")["variants"]["acco"]
    want = {0: 1.0, 1: -1.0, 2: 10.0, 3: 0.0, 4: 4.0}
    assert t["per_seed"].keys() == want.keys()
    for s, g in want.items():
        assert t["per_seed"][s] == pytest.approx(g, abs=1e-9)
    assert t["n"] == 5 and t["unpaired"] == []
    assert t["median"] == pytest.approx(1.0, abs=1e-9)  # sorted: -1, 0, 1, 4, 10
    assert (t["min"], t["max"]) == (pytest.approx(-1.0, abs=1e-9), pytest.approx(10.0, abs=1e-9))


def test_gap_table_even_count_and_unpaired_seed():
    records = [record("stock", 0, 1.0), record("stock", 1, 1.0),
               record("acco", 0, 1.01), record("acco", 1, 1.03), record("acco", 7, 9.0)]
    t = ft_summary.gap_table(records, "stock")["variants"]["acco"]
    assert t["n"] == 2 and t["unpaired"] == [7]  # seed 7 has no stock run: out of the median, listed
    assert t["median"] == pytest.approx(2.0, abs=1e-9)  # mean of the middle two: (1 + 3) / 2
    text = ft_summary.format_table(ft_summary.gap_table(records, "stock"))
    assert "+2.00%" in text and "+1.00% … +3.00%" in text and "unpaired" in text


def test_gap_of_accuracy_uses_the_same_pairing():
    records = [record("stock", 0, 1.0, acc=0.5), record("acco", 0, 1.0, acc=0.55)]
    t = ft_summary.gap_table(records, "stock", "heldout_accuracy")["variants"]["acco"]
    assert t["per_seed"][0] == pytest.approx(10.0)


@pytest.mark.parametrize("bad, why", [
    ([record("stock", 0, 1.0), record("stock", 0, 1.1)], "two records"),
    ([record("stock", 0, 1.0), record("acco", 0, 1.0, engine="DeepSpeedEngine")], "ds_acco run"),
    ([record("stock", 0, 1.0), record("acco", 0, 1.0, init_hash="other")], "not paired"),
    ([record("stock", 0, 1.0), record("acco", 0, 1.0, data_order_hash="other")], "not paired"),
    ([record("stock", 0, 1.0), record("acco", 0, 1.0, settings={"max_steps": "40"})], "different settings"),
    ([record("acco", 0, 1.0)], "no record of the baseline"),
])
def test_records_that_cannot_be_compared_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        ft_summary.gap_table(bad, "stock")


def test_curve_gives_the_median_gap_per_evaluation_step():
    def run(variant, seed, losses):
        return record(variant, seed, losses[-1], eval_curve=[{"step": 10 * (i + 1), "loss": v} for i, v in enumerate(losses)])
    records = [run("stock", 0, [2.0, 1.0]), run("stock", 1, [2.0, 1.0]), run("stock", 2, [4.0, 1.0]),
               run("acco", 0, [2.02, 1.0]), run("acco", 1, [2.04, 0.99]), run("acco", 2, [4.0, 1.05])]
    curve = ft_summary.curve_table(records, "stock")["acco"]
    assert list(curve) == [10, 20]
    assert curve[10] == pytest.approx(1.0, abs=1e-9)  # gaps 1, 2, 0 %
    assert curve[20] == pytest.approx(0.0, abs=1e-9)  # gaps 0, -1, +5 %


def test_lag_reads_each_commits_report_of_the_step_before():
    history = [{"step": 1}, {"step": 2, "prev_step_estimate_drift": 0.3, "prev_step_estimate_cos": 0.9},
               {"step": 3, "prev_step_estimate_drift": 0.5, "prev_step_estimate_cos": 0.7}]
    lag = ft.estimate_lag(SimpleNamespace(acco_metrics_history=history))
    assert lag == [{"step": 1, "drift": 0.3, "cos": 0.9}, {"step": 2, "drift": 0.5, "cos": 0.7}]
    assert ft.estimate_lag(SimpleNamespace()) == []  # a stock engine has no history
    runs = [record("acco", s, 1.0, drift_median=d, cos_median=c) for s, (d, c) in enumerate([(0.2, 0.9), (0.4, 0.5),
                                                                                             (0.3, 0.8)])]
    assert ft_summary.lag_table(runs) == {"acco": {"drift": 0.3, "cos": 0.8, "n": 3}}


# -- the task -------------------------------------------------------------------------------------
def test_task_split_is_balanced_disjoint_and_whole_steps_per_epoch():
    args = ft.FinetuneArguments()
    train_ids, train_labels, held_ids, held_labels = ft_task.build_task(args)
    k = len(ft_task.TOPICS)
    assert train_labels.bincount(minlength=k).tolist() == [args.passages_per_topic - args.heldout_per_topic] * k
    assert held_labels.bincount(minlength=k).tolist() == [args.heldout_per_topic] * k
    assert train_ids.shape[1] == args.passage_words + 2
    assert int(train_ids.max()) < args.vocab_size and (train_ids[:, 0] == ft_task.CLS_ID).all()
    train_rows = {tuple(r) for r in train_ids.tolist()}
    assert not train_rows & {tuple(r) for r in held_ids.tolist()}  # nothing held out is trained on
    # the defaults (2 ranks x 8 x gas 4) end every epoch on a whole optimizer step
    targs = SimpleNamespace(per_device_train_batch_size=8, world_size=2, dataloader_drop_last=False)
    assert ft.epoch_micro_batches(train_ids.shape[0], targs) % 4 == 0
    assert ft.epoch_micro_batches(2520, targs) == 158  # 315 batches dealt to 2 ranks, the last round padded


def test_passages_carry_no_header_line_naming_the_module():
    text = ft_task.module_text("queue")
    assert "queue.Queue" not in text.splitlines() and "Queue" in text


# -- end to end -----------------------------------------------------------------------------------
@pytest.mark.slow  # two 2-rank HF Trainer jobs under torchrun (~1 min)
def test_driver_runs_stock_and_acco_and_writes_the_table(tmp_path):
    pytest.importorskip("accelerate", reason="HF Trainer's DeepSpeed integration needs accelerate")
    out = tmp_path / "ft"
    tiny = ("--max_steps 2 --eval_steps 1 --pretrain_steps 2 --passage_words 8 --vocab_size 200 "
            "--passages_per_topic 40 --heldout_per_topic 8 --hidden_size 32 --intermediate_size 64 "
            "--num_attention_heads 2 --num_hidden_layers 1")
    variants = '{"stock": null, "acco": {"enabled": true, "estimate": {"lr_scale": 2.0}}}'
    env = base_env(SEEDS="0", ARGS=tiny, VARIANTS=variants, PYTHON=sys.executable, TIMEOUT=str(int(scaled(100))))
    proc = start(["bash", str(REPO / "scripts" / "finetune_fidelity.sh"), str(out)], env)
    text, timed_out = communicate(proc, scaled(240))
    assert not timed_out and proc.returncode == 0, f"rc={proc.returncode}\n{tail(text)}"
    assert "FAILED" not in text, tail(text)
    stock, acco = (json.loads((out / "records" / f"{v}-s0.json").read_text()) for v in ("stock", "acco"))
    assert (stock["engine"], acco["engine"]) == ("DeepSpeedEngine", "AccoEngine")
    # the block that ran: the driver measures the drift at every commit (its lag table is per step)
    assert acco["acco"] == {"enabled": True, "estimate": {"lr_scale": 2.0}, "metrics": {"estimate_drift_every": 1}}
    assert stock["acco"] is None
    assert stock["lag"] == [] and [p["step"] for p in acco["lag"]] == [1]  # step 2's commit measured step 1's
    assert acco["drift_median"] > 0 and -1 <= acco["cos_median"] <= 1
    for r in (stock, acco):
        assert (r["variant"], r["seed"], r["world_size"], r["gradient_accumulation_steps"]) == (r["variant"], 0, 2, 4)
        assert r["hf_global_step"] == r["engine_global_steps"] == 2  # ACCO committed every step the Trainer took
        assert math.isfinite(r["heldout_loss"]) and 0.0 <= r["heldout_accuracy"] <= 1.0
        assert [p["step"] for p in r["eval_curve"]][:2] == [1, 2]
        assert not r["partial_steps"]
    # paired: the same checkpoint, head, data and data order; the table reads them
    assert all(stock[k] == acco[k] for k in ft_summary.PAIRING_KEYS)
    table = json.loads((out / "table.json").read_text())["heldout_loss"]
    gap = table["variants"]["acco"]["per_seed"]["0"]
    assert gap == pytest.approx(ft_summary.gap_pct(acco["heldout_loss"], stock["heldout_loss"]))
    assert "median gap" in (out / "table.md").read_text()
