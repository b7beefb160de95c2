"""Check point 2 (docs/design.md, "One path for the config"): what a real DeepSpeed engine built is
refused before its driver exists, on 2 gloo ranks: no communication lane is built and no lane
thread ('acco-comm') runs after the refusal."""
from dist import run_ranks
from timeouts import scaled
import check_point_workers


def test_a_config_refused_at_check_point_2_starts_no_lane():
    # SGD has no second moment: refused from the shard optimizer the engine built (estimate_variant_optimizer)
    acco = {"enabled": True, "mode": "acco", "estimate": {"second_moment": "committed"}}
    for out in run_ranks(check_point_workers.refused_after_build, acco=acco, timeout=scaled(60)):
        assert out["refusal"] == "estimate_variant_optimizer", out
        assert out["lanes"] == 0 and out["lane_threads"] == [], out
