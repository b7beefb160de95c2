"""A rank that dies mid-training makes the others stop with a clear error, within the timeout."""
import pytest

from dist import run_ranks
from timeouts import scaled
import lifecycle_workers


@pytest.mark.parametrize("mode", ["acco"])  # dpu uses the same lane and error path
def test_peer_death_is_reported_within_the_timeout(mode):
    case = {"optimizer": "sgd", "gas": 4, "acco": {"enabled": True, "mode": mode, "comm_timeout_s": 20}}
    results = run_ranks(lifecycle_workers.rank_dies, case=case, die_rank=1, die_at=9, allow_missing=True,
                        timeout=scaled(60))
    assert results[1] is None  # the dead rank
    survivor = results[0]
    assert survivor is not None, "the surviving rank did not end by itself (killed at the test's limit)"
    assert survivor["error"] is not None, "the surviving rank trained on as if nothing happened"
    assert "communication round" in survivor["error"] and "peer rank may have died" in survivor["error"]
    # bounded by acco.comm_timeout_s (the behaviour under test, not scaled) plus a scaled slack
    assert survivor["seconds_after_death"] < 20 + scaled(5)
