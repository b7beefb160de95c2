"""Functions that run inside spawned ranks for tests/deepspeed/test_check_point_2.py."""
from __future__ import annotations

import threading

import ds_acco
from fixtures import TinyNet, ds_config, make_optimizer


def refused_after_build(acco: dict) -> dict:
    """``ds_acco.initialize`` with an ``"acco"`` block check point 2 refuses (what the engine built):
    the refusal's key, how many communication lanes were built meanwhile and which lane threads
    ('acco-comm') are alive after it that were not before."""
    from ds_acco.core import driver as core_driver
    lanes = []
    built = core_driver.CommLane

    def counted(*args, **kwargs):
        lane = built(*args, **kwargs)
        lanes.append(lane)
        return lane

    core_driver.CommLane = counted
    before = {t.ident for t in threading.enumerate() if t.name == "acco-comm"}
    model = TinyNet(seed=0)
    try:
        ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model), config=ds_config(4, acco))
    except ds_acco.AccoRefusal as exc:
        refusal = exc.refusal
    else:
        refusal = None
    finally:
        core_driver.CommLane = built
    started = [t.name for t in threading.enumerate() if t.name == "acco-comm" and t.ident not in before]
    return {"refusal": refusal, "lanes": len(lanes), "lane_threads": started}
