"""AccoFSDP.close() gives the model back to plain FSDP as the user configured it: the take-over
keeps unsharded parameters resident (no reshard after forward or backward) and turns FSDP's
gradient sync off; afterwards, and after a take-over that refused the model half-way, FSDP
reshards and reduces exactly as it does for the same model never given to ACCO."""
import pytest

from dist import run_ranks
from timeouts import scaled
import fsdp_workers


@pytest.fixture(scope="module")
def behaviour():
    return run_ranks(fsdp_workers.close_gives_fsdp_back, timeout=scaled(90))


def test_the_reference_tells_the_settings_apart(behaviour):
    plain = behaviour[0]["plain"]
    assert plain["after_forward"]["fc1"] == [True, True] and plain["after_forward"]["fc2"] == [False, False]
    assert plain["after_backward"]["fc1"] == [True, True] and plain["after_backward"]["fc2"] == [False, False]
    assert all(all(v) for v in plain["reduced_grads"].values())


@pytest.mark.parametrize("after", ["resident", "sharded", "refused"])
def test_fsdp_behaves_as_the_user_configured_it(behaviour, after):
    for rank in behaviour:
        assert rank[after] == rank["plain"], after


def test_the_refusal_is_the_optimizers(behaviour):
    assert "optimizer must own" in behaviour[0]["refusal"]
