"""After a CommTimeoutError the lane is known broken: the exit path (the driver's at-exit hook,
close(), abandon()) must not wait on it again. Before, the hook's drain waited for the stalled round
another comm_timeout_s and the lane's close() joined its stuck worker for a third. The waits run on a
fake clock (a wait for the stalled round runs out at once), so the test asserts which waits were
asked for, not how long anything took."""
import pytest

from dist import run_ranks
from timeouts import scaled
import fsdp_workers

TIMEOUT_S = 600.0  # acco.comm_timeout_s: never spent, the fake clock runs it out


@pytest.fixture(scope="module")
def run():
    return run_ranks(fsdp_workers.exit_after_a_timeout, world=1, timeout=scaled(60), comm_timeout_s=TIMEOUT_S)[0]


def test_the_wait_for_the_stalled_round_runs_out_once(run):
    events = run["events"]
    kinds = [kind for kind, _ in events]
    timeout = kinds.index("CommTimeoutError")
    assert events[timeout - 1] == ("wait for a round", TIMEOUT_S)  # the wait in step() that ran out
    assert "commit 0" in events[timeout][1] and "acco.comm_timeout_s" in events[timeout][1]


def test_the_exit_hook_does_not_wait_on_the_broken_lane_again(run):
    kinds = [kind for kind, _ in run["events"]]
    after = kinds[kinds.index("CommTimeoutError") + 1:]
    assert after == ["exit hook", "exit hook returned"], after  # no wait for a round, no join of the worker


def test_the_exit_hook_drops_the_round_with_one_line(run):
    assert "could not be finished" in run["stderr"] and "CommTimeoutError" in run["stderr"], run["stderr"]
    assert "already ran out" in run["stderr"]  # the lane says why it does not wait
    assert run["abandoned"] and run["worker_ended"]
