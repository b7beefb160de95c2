"""benchmarks.long_runs: the settings issue 43 asks for, and a report that pairs each run with its own
seed's stock (no training here: the report reads records)."""
import pytest

from benchmarks import long_runs


def test_the_settings_are_the_issues():
    size = long_runs.setting("size", 2.0)
    assert (size.n_embd, size.n_layer, size.n_head, size.steps, size.corpus) == (256, 6, 8, 300, "stdlib-source")
    assert size.lr == pytest.approx(2e-3)
    big = long_runs.setting("size", 1.0, model="14m")  # the issue's ~15M point, the same text and steps
    assert (big.n_embd, big.n_layer, big.n_head, big.steps, big.corpus) == (384, 8, 6, 300, "stdlib-source")
    from benchmarks.gpt import CausalLM
    assert 13e6 < sum(p.numel() for p in CausalLM(big.seq_len, big.n_embd, big.n_layer, big.n_head).parameters()) < 16e6
    horizon = long_runs.setting("horizon")
    assert (horizon.steps, horizon.warmup, horizon.n_embd, horizon.corpus) == (5000, 250, 128, "embedded")


def _res(seed, stock, paper, la2):
    curve = lambda last: [(100, 3.0), (500, 2.5), (1000, last)]
    runs = [{"variant": v, "seed": seed, "heldout": curve(x), "tail_mean": x, "lag_median": 1.0}
            for v, x in (("stock", stock), ("paper", paper), ("la2", la2))]
    return {"kind": "horizon", "params": 430000, "setting": {"lr": 1e-3, "steps": 1000}, "runs": runs}


def test_the_report_pairs_each_run_with_its_own_seeds_stock():
    # seed 0: la2 1% above its stock; seed 1: 1% below; across seeds stock differs by far more than 1%
    rows = long_runs.report([_res(0, 2.0, 2.02, 2.02), _res(1, 3.0, 2.97, 2.97)]).splitlines()
    la2 = next(r for r in rows if "| la2 |" in r)
    assert "+0.00% [-1.00, +1.00]" in la2, la2
    assert "| 2 |" in la2


def test_the_gap_along_the_run_is_per_evaluation():
    along = long_runs.gaps_along(_res(0, 2.0, 2.2, 1.8))
    assert along["paper"][-1] == (1000, pytest.approx(10.0)) and along["la2"][0] == (100, 0.0)


def test_the_report_has_a_row_for_each_alternative_over_the_seeds_that_ran_it():
    # docs/bench/long-runs-cpu/lr2-alternatives: stock (carried) and la1.5 on some seeds, beside the full records
    alt = _res(1, 3.0, 2.97, 2.97)
    alt["runs"] = [alt["runs"][0], dict(alt["runs"][0], variant="la1.5", tail_mean=3.03)]
    rows = long_runs.report([_res(0, 2.0, 2.02, 2.02), _res(1, 3.0, 2.97, 2.97), alt]).splitlines()
    la15 = next(r for r in rows if "| la1.5 |" in r)
    assert "| 1 | la1.5 | +1.00% [+1.00, +1.00]" in la15, la15  # against seed 1's stock, one seed
    la2 = next(r for r in rows if "| la2 |" in r)
    assert "| 2 | la2 |" in la2, la2  # the alternative's record holds no la2: not counted as a seed of it
