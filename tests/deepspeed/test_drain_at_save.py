"""ACCO.md, "[ours] Drains agree" at a save: in dynamic mode ranks end their phases on their own timing, so
when the caller stops them at the same micro-batch count (a checkpoint, an evaluation, the end of
training) they may stand at different phase positions; the drain must complete the same rounds on
every rank.

Rank 1 sleeps after each backward (a slow worker), so it ends phases as soon as their round is done
while rank 0 waits for rank 1 in every round: after the same number of micro-batches rank 1 has
launched one round more than rank 0. Both then save a checkpoint (a drain). Short comm_timeout_s:
a drain that does not agree fails in seconds.

Written while the library had no drain agreement (rank 1 then waited for a round rank 0 never
launched, and this test failed); it passes since drains agree (see ds_acco/core/schedule/drains.py).
"""

from dist import run_ranks
from timeouts import scaled
import lifecycle_workers

DYN = {"min_micro_batches": 1, "max_micro_batches": 6, "check_every": 1}
CASE = {"optimizer": "sgd", "gas": 4, "sleep": {"1": 0.05},
        "acco": {"enabled": True, "mode": "acco", "accumulation": "dynamic", "dynamic": DYN,
                 "comm_timeout_s": scaled(3)}}


def test_stop_at_the_same_micro_batch_count_drains_the_same_rounds(tmp_path):
    r0, r1 = run_ranks(lifecycle_workers.stop_at_same_count, case=CASE, total=9, save_dir=str(tmp_path))
    where = f"rounds launched / phase after each micro-batch: rank 0 {r0['positions']}, rank 1 {r1['positions']}"
    print(where)
    assert r0["error"] is None and r1["error"] is None, f"rank 0: {r0['error']}\nrank 1: {r1['error']}\n{where}"
    assert r0["global_steps"] == r1["global_steps"]
