"""The fidelity sweep's one-round protocol (issue 42 item 2): every size x LR x β2 x seed is a group
whose label matches what the simulator runs."""
import pytest

from benchmarks import fidelity_sweep as fs
from benchmarks import multirun


def test_one_round_groups_run_what_they_are_labelled():
    todo = fs.one_round_groups((0.5, 2), steps=300, seeds=2, variants=("stock", "ef"), sizes=("small", "large"),
                               beta2s=(0.95, 0.99))
    assert len(todo) == 2 * 2 * 2 * 2
    seen = set()
    for kw, meta, runs in todo:
        s = multirun.Setting(**kw)  # every key is the simulator's
        assert (s.n_embd, s.n_layer) == ((128, 2) if meta["size"] == "small" else (272, 2))
        assert s.beta2 == meta["beta2"] and s.lr == pytest.approx(1e-3 * meta["lr_mult"]) and s.steps == 300
        seed = {sd for _, sd in runs}
        assert len(seed) == 1 and [v for v, _ in runs] == ["stock", "ef"]  # one seed per group, stock beside
        seen.add((meta["size"], meta["lr_mult"], meta["beta2"], seed.pop()))
    assert len(seen) == 16
    assert {runs[0][1] for _, _, runs in todo[:8]} == {0}  # seeds outermost: a stopped run has every setting


def test_optimizer_groups_run_the_size_they_are_labelled():
    todo = fs.optimizer_groups([("sgd", 0.1), ("adam", 3e-3)], steps=150, seeds=3, variants=("stock", "la1.5"),
                               sizes=("small", "large"))
    assert [(meta["size"], meta["optimizer"], meta["lr"]) for _, meta, _ in todo] == [
        ("small", "sgd", 0.1), ("small", "adam", 3e-3), ("large", "sgd", 0.1), ("large", "adam", 3e-3)]
    for kw, meta, runs in todo:
        s = multirun.Setting(**kw)
        assert (s.n_embd, s.n_layer) == ((128, 2) if meta["size"] == "small" else (272, 2))
        assert s.optimizer == meta["optimizer"] and s.lr == meta["lr"] and s.steps == 150
        assert runs == [(v, sd) for sd in range(3) for v in ("stock", "la1.5")]  # seeds stacked, stock beside
    assert {meta["size"] for _, meta, _ in fs.optimizer_groups([("sgd", 0.1)])} == {"small"}  # the default


def test_merge_seeds_pools_per_setting():
    groups = [{"size": z, "lr_mult": 1, "steps": 300, "beta2": b, "wall_s": 1.0, "runs": [{"seed": sd}]}
              for sd in (0, 1) for z in ("small", "large") for b in (0.95, 0.99)]
    merged = fs.merge_seeds({"groups": groups})["groups"]
    assert len(merged) == 4 and all(len(g["runs"]) == 2 for g in merged)
