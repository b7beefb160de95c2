"""engine.destroy() always completes DeepSpeed's own destroy(), even when ACCO's drain raises (the
round in flight failed); the drain's error still reaches the caller. The same spawn checks that the
driver acts on its CUDA_DEVICE_MAX_CONNECTIONS check -- synchronous rounds on every rank, the warning
on rank 0 only (tests/core/test_driver_checks.py tests the check itself)."""
from dist import run_ranks
import lifecycle_workers

CASE = {"optimizer": "sgd", "gas": 4, "acco": {"enabled": True, "mode": "acco", "nonfinite": "raise"}}


def test_destroy_runs_deepspeeds_destroy_when_the_drain_raises():
    r0, r1 = run_ranks(lifecycle_workers.destroy_after_failed_round, case=CASE)
    for r in (r0, r1):
        assert r["raised"] is not None, "destroy() swallowed the failed round"
        assert "NonFiniteGradientError" in r["raised"] and "estimate 0" in r["raised"], r["raised"]
        assert r["deepspeed_destroy_ran"] == ["AccoEngine"]
        assert r["sigterm_restored"]
        assert r["warning_checked"] == [("cpu", False)]  # the driver's device and acco.synchronous
        assert r["lane_synchronous"] is True  # serialised: the check said the rounds must not overlap
    assert r0["warnings_logged"] == ["CONNECTIONS WARNING"] and r1["warnings_logged"] == []


def test_destroy_ends_every_thread_acco_started():
    """After destroy(), the process has as many OS threads as after stock's: the lane and the
    rounds' group's gloo workers are gone. Left alive, such a worker may take the GIL while the
    interpreter finalises and abort a script that ended well (issue 33 item 8). Mutation: keep the
    rounds' context's reference to the group (at_exit.end_groups then only unregisters it): 3 more
    threads after destroy()."""
    case = {"optimizer": "adamw", "gas": 4}
    stock = run_ranks(lifecycle_workers.threads_after_destroy, case={**case, "acco": None}, use_ds_acco=False)
    acco = run_ranks(lifecycle_workers.threads_after_destroy, case={**case, "acco": {"enabled": True}})
    for s, a in zip(stock, acco):
        assert a["trained"] > s["trained"], (s, a)  # the lane and its group were running
        assert a["destroyed"] - a["before"] == s["destroyed"] - s["before"], (s, a)
