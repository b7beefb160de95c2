"""Mode 'auto''s decision rule (ds_acco/core/schedule/auto.py::decide), table-driven against cases computed
by hand with the step-time rules (stock C + R, fixed 2·max(C/2, R), one-round max(C, R)), and its config."""
import math

import pytest

from ds_acco.config import AccoConfig
from ds_acco.core.checks.refusals import AccoRefusal
from ds_acco.core.schedule.auto import decide, step_times

SA, ALL, SO = ("stock", "acco"), ("stock", "acco", "one_round"), ("stock", "one_round")
TABLE = [
    # C, R, candidates, choice   (stock, fixed, one-round predicted; the 5% margin)
    (1.0, 0.2, SA, "acco"),       # 1.2, 1.0: fixed 20% faster
    (1.0, 0.5, SA, "acco"),       # 1.5, 1.0: r = 1, fixed hides its rounds exactly
    (1.0, 0.8, SA, "acco"),       # 1.8, 1.6: 1.05 x 1.6 = 1.68 < 1.8
    (1.0, 0.96, SA, "stock"),     # 1.96, 1.92: fixed 2% faster, within the margin
    (1.0, 1.2, SA, "stock"),      # 2.2, 2.4: fixed slower
    (1.0, 0.8, ALL, "one_round"),  # 1.8, 1.6, 1.0
    (1.0, 0.5, ALL, "acco"),      # 1.5, 1.0, 1.0: one-round not faster than fixed: fixed (trains better)
    (1.0, 0.52, ALL, "acco"),     # 1.52, 1.04, 1.0: one-round 4% faster than fixed, within the margin
    (1.0, 3.0, ALL, "one_round"),  # 4.0, 6.0, 3.0
    (1.0, 0.96, SO, "one_round"),  # 1.96, -, 1.0
    (1.0, 0.03, SO, "stock"),     # 1.03, -, 1.0: 3% faster, within the margin
    (1.0, 0.0, ALL, "stock"),     # no communication: nothing to hide
    (math.nan, 0.5, ALL, "stock"),  # nothing measured
]


@pytest.mark.parametrize("c,r,candidates,want", TABLE)
def test_decide_table(c, r, candidates, want):
    """Catches: the margin dropped (1.0/0.96 and 1.0/0.52 flip), fixed's rule as one-round's max(C, R)
    (1.0/1.2 and 1.0/0.8/ALL flip) or as C alone, one-round compared with stock only (1.0/0.5/ALL)."""
    choice, reason = decide(c, r, candidates)
    assert choice == want, reason
    assert ("no candidate" in reason) == (want == "stock" and math.isfinite(c))


def test_step_times_are_the_rules():
    assert step_times(1.0, 0.8) == {"stock": 1.8, "acco": 1.6, "one_round": 1.0}
    assert step_times(1.0, 0.3) == {"stock": 1.3, "acco": 1.0, "one_round": 1.0}


def test_decide_needs_stock():
    with pytest.raises(ValueError):
        decide(1.0, 0.2, ("acco",))


def test_config_defaults_and_refusals():
    """One-round joins only when listed; what auto cannot run is refused through the table's rows."""
    cfg = AccoConfig.from_block({"enabled": True, "mode": "auto"})
    assert cfg.auto_modes == ("stock", "acco") and cfg.auto_probe_steps == 3 and cfg.schedule_modes() == ("acco",)
    assert AccoConfig.from_block({"enabled": True, "mode": "auto", "auto_modes": ["stock", "acco", "one_round"],
                                  "predictor": "nag"}).schedule_modes() == ("acco", "one_round")
    assert AccoConfig.from_block({"enabled": True, "mode": "one_round", "sync_warmup_steps": 2}).sync_warmup_steps == 2
    for block, row in [({"mode": "auto", "accumulation": "dynamic"}, "auto_accumulation"),
                       ({"mode": "auto", "auto_modes": ["acco"]}, "acco_invalid_value"),
                       ({"mode": "auto", "auto_modes": ["stock"]}, "acco_invalid_value"),
                       ({"mode": "auto", "auto_probe_steps": 1}, "acco_invalid_value"),
                       ({"mode": "auto", "predictor": "ef"}, "acco_no_effect"),
                       ({"mode": "auto", "sync_warmup_steps": 2}, "acco_no_effect"),
                       ({"mode": "acco", "auto_modes": ["stock", "acco"]}, "acco_no_effect"),
                       ({"mode": "auto", "auto_modes": ["stock", "one_round"], "estimate": "paper"}, "acco_no_effect")]:
        with pytest.raises(AccoRefusal) as exc:
            AccoConfig.from_block({"enabled": True, **block})
        assert exc.value.refusal == row, (block, str(exc.value))
