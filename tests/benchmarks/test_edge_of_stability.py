"""The edge-of-stability table's two verdicts (benchmarks/edge_of_stability.py): spikes and divergence."""
import math
import sys

import pytest

from benchmarks.edge_of_stability import diverged, main, spikes, table


def curve(*losses):
    return [(25 * (i + 1), x) for i, x in enumerate(losses)]


def test_a_spike_is_an_evaluation_above_1_1x_the_lowest_before_it():
    assert spikes(curve(5.0, 4.0, 4.39, 3.0)) == 0  # 4.39 < 1.1 x 4.0
    assert spikes(curve(5.0, 4.0, 4.41, 3.0, 3.31, 3.2)) == 2  # 4.41 > 4.4 and 3.31 > 3.3
    assert spikes(curve(5.0, 6.0)) == 1  # above its first evaluation


def test_a_run_diverged_when_it_ends_no_lower_than_its_first_evaluation_or_not_finite():
    assert not diverged(curve(5.0, 9.0, 4.9))
    assert diverged(curve(5.0, 3.0, 5.0))
    assert diverged(curve(5.0, math.nan, 3.0))
    assert diverged(curve(5.0, 3.0, math.inf))


def test_the_table_pairs_each_run_with_stocks_on_its_seed():
    runs = [{"variant": "stock", "seed": 0, "tail_mean": 4.0, "heldout": curve(5.0, 4.0)},
            {"variant": "stock", "seed": 1, "tail_mean": 2.0, "heldout": curve(5.0, 2.0)},
            {"variant": "la2", "seed": 0, "tail_mean": 3.0, "heldout": curve(5.0, 3.0)},
            {"variant": "la2", "seed": 1, "tail_mean": 3.0, "heldout": curve(5.0, 6.0)}]
    out = table([{"size": "small", "lr_mult": 8, "steps": 300, "runs": runs}])
    # seed 0: -25%, seed 1: +50% (not pooled: each against its own seed's stock); seed 1 diverged and spiked
    assert "| small LR x8, 300 steps | 2 | la2 | +12.50% [-25.00, +50.00] | 1 of 2 | 0, 1 |" in out


def test_the_table_has_a_row_for_each_variant_the_file_holds_in_run_order():
    runs = [{"variant": "stock", "seed": 0, "tail_mean": 4.0, "heldout": curve(5.0, 4.0)},
            {"variant": "la2+warm", "seed": 0, "tail_mean": 3.0, "heldout": curve(5.0, 3.0)},
            {"variant": "la1.5", "seed": 0, "tail_mean": 5.0, "heldout": curve(5.0, 5.0)}]
    rows = table([{"size": "large", "lr_mult": 8, "steps": 300, "runs": runs}]).splitlines()[2:]
    assert [r.split(" | ")[2] for r in rows] == ["stock", "la2+warm", "la1.5"]
    assert "| large LR x8, 300 steps | 1 | la1.5 | +25.00% [+25.00, +25.00] | 1 of 1 | 0 |" in rows


def test_unknown_or_misordered_variants_are_refused_naming_the_flag(monkeypatch, capsys):
    for bad in ("stock,la9", "la2,stock"):
        monkeypatch.setattr(sys, "argv", ["edge_of_stability", "x.json", "--variants", bad])
        with pytest.raises(SystemExit):
            main()
        assert "--variants" in capsys.readouterr().err
