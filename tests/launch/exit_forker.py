"""One rank of tests/integration/test_exit.py: for each case, a fresh process that trains a few
micro-batches and ends the way a user's script ends -- it returns, raises, is interrupted (SIGINT,
SIGTERM) or never steps -- *without* ``destroy()``, as most DeepSpeed scripts do.

    python tests/launch/exit_forker.py RANK WORLD CASES_JSON OUT_DIR

Each case runs in a child forked from this process after torch, DeepSpeed and ds_acco are
imported (imports cost seconds; the exit path under test is the child's own interpreter
finalisation, the same as a script's). The child's stdout/stderr go to ``OUT_DIR/<k>-<rank>.log``;
this process prints one JSON line: every child's exit code (negative: killed by that signal).
A case: {"adapter": "deepspeed"|"fsdp", "acco": null|{...}, "ending": ..., "port": P} (ending: return,
raise, sigint, sigterm, never, or collected -- returns, then a garbage collection finalises the
engine while a round is still in flight; port:
a rendezvous store the test process has bound).
"""
from __future__ import annotations

import atexit
import gc
import glob
import json
import os
import signal
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, os.path.join(TESTS, "fsdp"))  # fsdp_workers, beside the FSDP tests

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rank_preload  # noqa: E402,F401  (what run_ranks' fork server imports: DeepSpeed's Muon check, ~2 s)
import ds_acco  # noqa: E402
import ds_acco.deepspeed.engine  # noqa: E402,F401
import ds_acco.fsdp  # noqa: E402,F401
from dist import settled_thread_count  # noqa: E402
from fixtures import TinyNet, batch, ds_config, make_optimizer  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

# Loaded once here (~1 s a start otherwise): DeepSpeed keeps loaded ops per process (OpBuilder._loaded_ops).
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)

MICRO_BATCHES = 10  # gas 4: a round is in flight at the end (fixed: launched at micro-batch 9)
INTERRUPT_AT = 5  # mid-phase, a round in flight
# "collected": the script's function returns and the garbage collector finalises the engine before
# the interpreter exits (an allocation-triggered collection does this now and then in a real script;
# here it is forced), while rank 0's last round still waits in its collective for this slow peer.
COLLECTED_PEER_DELAY_S = 1.5


def _report_threads_at_exit() -> None:
    """The OS threads alive as the interpreter finalises (after the engine's own at-exit hook, and
    after the wait for abandoned lanes, run here instead of right after): the test compares them with
    stock's. A thread ACCO started that outlives its exit hook -- the lane, or its group's gloo workers
    -- may still take the GIL while the interpreter finalises, and that aborts the process now and then
    (``at_exit.end_groups``)."""
    from ds_acco.core.lifecycle.at_exit import join_abandoned_lanes
    join_abandoned_lanes()
    print(f"threads at exit {settled_thread_count()}", flush=True)


def run_case(case: dict, rank: int) -> None:
    torch.set_num_threads(1)
    atexit.register(_report_threads_at_exit)  # before the engine's hook: it runs after it
    ending = case["ending"]
    if case["adapter"] == "deepspeed":
        model = TinyNet(seed=0)
        engine, *_ = ds_acco.initialize(model=model, optimizer=make_optimizer("adamw")(model),
                                        config=ds_config(4, case["acco"]))
        forward = lambda i: engine(*batch(rank, i))  # noqa: E731
        backward, step = engine.backward, engine.step
    else:
        from ds_acco.fsdp import AccoFSDP
        from fsdp_workers import sharded_tiny
        dist.init_process_group("gloo")
        model = sharded_tiny()
        opt = make_optimizer("adamw")(model)
        forward = lambda i: model(*batch(rank, i))  # noqa: E731
        if case["acco"] is None:  # plain FSDP2: what the FSDP2 variant must exit like
            backward = lambda loss: loss.backward()  # noqa: E731

            def step():
                opt.step()
                opt.zero_grad()
        else:
            acco = AccoFSDP(model, opt, ds_config(4, case["acco"]))
            backward, step = acco.backward, acco.step
    print("built", flush=True)
    if ending == "never":
        return
    for i in range(MICRO_BATCHES):
        if i == INTERRUPT_AT and ending in ("sigint", "sigterm"):
            os.kill(os.getpid(), signal.SIGINT if ending == "sigint" else signal.SIGTERM)
        backward(forward(i))
        if ending == "collected" and rank == 1 and i == MICRO_BATCHES - 1:
            time.sleep(COLLECTED_PEER_DELAY_S)  # rank 0's last round waits for this rank's in its collective
        step()
    print("trained", flush=True)
    if ending == "raise":
        raise ValueError("user error after training")


def _wait(pid: int, deadline_s: float):
    """The child's exit code, or "hung" (killed) when it outlived ``deadline_s``: a hang is a
    failure the test reports with the child's log, not a wait for some collective's timeout."""
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.02)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    # A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and
    # then the "sigint" cases would never be interrupted: give the children Python's own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(sys.argv[3]) as f:
        cases = json.load(f)
    out_dir = sys.argv[4]
    # What this process imported is frozen out of the garbage collector: a forked child's final
    # collection at interpreter exit would otherwise walk (and copy-on-write) all of torch's and
    # DeepSpeed's objects, ~1.4 s a case. The child's own objects (the engine, its lane) are still
    # collected, and its exit path (atexit hooks, finalisation) is unchanged.
    gc.freeze()
    codes = []
    for k, case in enumerate(cases):
        pid = os.fork()
        if pid == 0:
            log = os.open(os.path.join(out_dir, f"{k}-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            # No LOCAL_SIZE: DeepSpeed's CPU shm op (which spins until every rank's /dev/shm file
            # exists, and leaves them behind) is not what these cases test; gloo carries everything.
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case["port"]),
                              TORCHELASTIC_USE_AGENT_STORE="True", DS_ACCELERATOR="cpu")
            return case, rank  # the child ends as a script does, at the top level
        codes.append(_wait(pid, float(case.get("deadline_s", 120))))
        # DeepSpeed's CPU shm op leaves one buffer per rank and port in /dev/shm (RAM): drop this case's.
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{case['port']}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass
    print(json.dumps(codes), flush=True)
    return None


if __name__ == "__main__":
    child = main()
    if child is not None:  # in a forked child: the user's "script", then the interpreter's own exit
        run_case(*child)
        if child[0]["ending"] == "collected":
            gc.collect()  # the engine, unreachable since run_case returned, is finalised now
