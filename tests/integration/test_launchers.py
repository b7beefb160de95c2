"""Smoke runs of ds_acco (ACCO on) under the three launchers users start it with.

Each test runs ``tests/launch/smoke.py`` on 2 CPU ranks under ``deepspeed``, ``torchrun`` or
``mpirun`` and compares what rank 0 reports (world size, every loss, a checksum of the committed
weights) with a reference run of the same script started without any launcher (two processes with
RANK, WORLD_SIZE, ... set by hand). The run is deterministic, so all numbers must match exactly:
a launcher that wires ranks differently (wrong rank, world size 1, different data) fails.

Launchers and the interpreter come from ``sys.executable``'s directory (the venv's bin) so that
the tests work in a fresh venv that is not activated. All traffic stays on 127.0.0.1. No port is
picked for a launcher to bind later (another process could take it first, see tests/dist.py): the
reference run's store is bound by this process, torchrun binds its own on port 0, under mpirun rank
0 binds one on port 0 (tests/launch/smoke.py), and a ``deepspeed`` launch that lost its port is retried.

The mpirun test needs the PyPI packages ``mpich`` and ``mpi4py`` (``pip install mpich mpi4py``):
without them it skips, or fails when the environment variable CI is set.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dist import (LAUNCH_ATTEMPTS, TORCHRUN_RENDEZVOUS, address_in_use, clear_stale_build_locks, communicate, launch,
                  rendezvous_store, run_ranks)
from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "tests" / "launch" / "smoke.py"
BIN = Path(sys.executable).parent
WORLD = 2
MODE = "acco"
TIMEOUT_S = scaled(80)  # per launcher run; see tests/timeouts.py
RESULT_TAG = "SMOKE_RESULT"
# What must be identical across launchers (everything in the result but bookkeeping).
COMPARED = ("world_size", "mode", "optimizer", "global_steps", "losses", "losses_by_rank", "checksum")
MPI_INSTALL_HINT = "pip install mpich mpi4py"

# Inherited variables that would tell a launcher or the script it already is inside a job.
_JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")
_JOB_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "MPI_LOCAL", "TORCHELASTIC_")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def base_env(**extra: str) -> dict:
    """The environment every run gets: CPU accelerator, shared extension cache, loopback only."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_ENV and not k.startswith(_JOB_ENV_PREFIXES)}
    env["DS_ACCELERATOR"] = "cpu"
    env["TORCH_EXTENSIONS_DIR"] = (os.environ.get("TORCH_EXTENSIONS_DIR")
                                   or os.path.join(tempfile.gettempdir(), "ds_acco_torch_extensions"))
    # The venv's bin first: ninja (JIT build of DeepSpeed's CPU comm op), hydra_pmi_proxy, ...
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def launcher(name: str, module: str | None = None) -> list[str]:
    """``name`` from the venv's bin, else ``python -m module``, else from PATH."""
    exe = BIN / name
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    if module is not None:
        return [sys.executable, "-m", module]
    found = shutil.which(name)
    return [found] if found else []


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    """``cmd`` in the repository as a session leader (so a timeout kills every rank), output merged."""
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run_job(label: str, cmd: list[str], env: dict) -> dict:
    """Run one launcher command that binds no port we chose; return rank 0's SMOKE_RESULT or fail."""
    proc = start(cmd, env)
    out, timed_out = communicate(proc, TIMEOUT_S)
    return parse_result(label, cmd, out, proc.returncode, timed_out)


def deepspeed_cmd(port: int, *args: str) -> list[str]:
    """``deepspeed --num_gpus WORLD`` on 127.0.0.1:``port`` with ``args``, or fail if there is no launcher."""
    cmd = launcher("deepspeed")
    if not cmd:
        pytest.fail(f"no 'deepspeed' launcher next to {sys.executable} or on PATH (is deepspeed installed?)")
    return cmd + ["--num_gpus", str(WORLD), "--master_addr", "127.0.0.1", "--master_port", str(port), *args]


def run_deepspeed(args: list[str], env: dict, timeout: float = TIMEOUT_S) -> tuple[list[str], str, int, bool]:
    """Launch ``deepspeed_cmd(port, *args)``, retried on another port if the first was taken by then
    (tests/dist.py); returns the command, its output, exit status and whether it timed out."""
    proc, out, timed_out = launch(lambda port: start(deepspeed_cmd(port, *args), env), timeout)
    return proc.args, out, proc.returncode, timed_out


def torchrun_cmd(*args: str) -> list[str]:
    """``torchrun`` with WORLD ranks on one node, its rendezvous store bound by itself on port 0."""
    return launcher("torchrun", module="torch.distributed.run") + [
        "--nnodes", "1", "--nproc_per_node", str(WORLD), *TORCHRUN_RENDEZVOUS, *args]


def parse_result(label: str, cmd: list[str], out: str, rc: int | None, timed_out: bool) -> dict:
    def fail(why: str):
        pytest.fail(f"{label}: {why}\ncommand: {' '.join(cmd)}\n--- last lines of output ---\n{tail(out)}",
                    pytrace=False)

    if timed_out:
        fail(f"timed out after {TIMEOUT_S:.0f} s (process group killed; scale with ACCO_TEST_TIMEOUT_SCALE)")
    if rc != 0:
        fail(f"exited with status {rc}")
    results = []
    for line in out.splitlines():
        at = line.find(RESULT_TAG + " ")
        if at < 0:
            continue
        try:
            results.append(json.JSONDecoder().raw_decode(line[at + len(RESULT_TAG) + 1:].lstrip())[0])
        except ValueError as exc:
            fail(f"unparsable {RESULT_TAG} line ({exc}): {line!r}")
    if len(results) != 1:
        fail(f"expected exactly one {RESULT_TAG} line (rank 0), found {len(results)}")
    return results[0]


def check_against_reference(label: str, result: dict, reference: dict) -> None:
    assert result["world_size"] == WORLD, f"{label}: world size {result['world_size']}, expected {WORLD}"
    assert result["optimizer"] == "AccoZeroOptimizer", f"{label}: optimizer {result['optimizer']}"
    diffs = [k for k in COMPARED if result.get(k) != reference.get(k)]
    assert not diffs, (f"{label} differs from the launcher-free reference run in {diffs}:\n"
                       + "\n".join(f"  {k}: {label}={result.get(k)!r}\n  {k}: reference={reference.get(k)!r}"
                                   for k in diffs))


def smoke_args() -> list[str]:
    return [str(SMOKE), "--mode", MODE]


@pytest.fixture(scope="module")
def reference() -> dict:
    """The smoke run with no launcher: WORLD processes with the torch.distributed variables set by hand
    (the rendezvous store they use is bound by this process beforehand, see tests/dist.py)."""
    cmd = [sys.executable, *smoke_args()]
    with tempfile.TemporaryDirectory() as tmp, rendezvous_store(WORLD) as store_env:
        logs = [open(os.path.join(tmp, f"rank{rank}.log"), "w+") for rank in range(WORLD)]
        procs = []
        for rank in range(WORLD):
            env = base_env(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(WORLD), **store_env)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[rank], stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        # Wait for all ranks; once one fails, give the others a short grace period (they would
        # otherwise block in a collective until the deadline).
        deadline, timed_out = time.monotonic() + TIMEOUT_S, False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 15)
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        if timed_out:
            clear_stale_build_locks()  # a rank may have been killed while compiling a DeepSpeed op
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    rcs = [p.returncode for p in procs]
    rc = next((r for r in rcs if r != 0), 0)
    combined = "\n".join(f"[rank {r}] {line}" if RESULT_TAG not in line else line
                         for r, out in enumerate(outs) for line in out.splitlines())
    return parse_result("reference run (no launcher)", cmd, combined, rc, timed_out)


@pytest.mark.slow
def test_deepspeed_launcher(reference, tmp_path):
    # never /job/hostfile (DeepSpeed's default, which would mean a multi-node ssh launch)
    cmd, out, rc, timed_out = run_deepspeed(["--hostfile", str(tmp_path / "no-hostfile"), *smoke_args()], base_env())
    check_against_reference("deepspeed", parse_result("deepspeed", cmd, out, rc, timed_out), reference)


@pytest.mark.slow
def test_torchrun(reference):
    cmd = torchrun_cmd(*smoke_args())
    check_against_reference("torchrun", run_job("torchrun", cmd, base_env()), reference)


def _mpi_problem() -> str | None:
    """Why an mpirun run cannot work here, or None."""
    if not launcher("mpirun"):
        return f"no 'mpirun' next to {sys.executable} or on PATH"
    try:
        probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                               env=base_env(), capture_output=True, text=True, timeout=scaled(20))
    except subprocess.TimeoutExpired:
        return f"'from mpi4py import MPI' hung for {scaled(20):.0f} s"
    if probe.returncode != 0:
        return f"'from mpi4py import MPI' failed with {sys.executable}:\n{tail(probe.stdout + probe.stderr, 15)}"
    return None


@pytest.mark.slow
def test_mpirun(request):
    problem = _mpi_problem()
    if problem is not None:
        msg = f"mpirun smoke test cannot run: {problem}\nfix: {sys.executable} -m {MPI_INSTALL_HINT}"
        if in_ci():
            pytest.fail(msg + "\n(CI is set, so this is a failure, not a skip)", pytrace=False)
        pytest.skip(msg.replace("\n", "; "))
    cmd = launcher("mpirun") + ["-np", str(WORLD), sys.executable, *smoke_args()]
    env = base_env(
        # smoke.py maps MPI ranks onto RANK/WORLD_SIZE/LOCAL_RANK itself and, with no MASTER_PORT
        # given, has rank 0 bind the rendezvous store on port 0 and broadcast it, so DeepSpeed's own
        # mpi4py discovery (MASTER_ADDR from `hostname -I`, port 29500) never runs.
        MASTER_ADDR="127.0.0.1",
        HYDRA_LAUNCHER="fork",  # MPICH: fork local ranks, never ssh
        HYDRA_IFACE="lo",  # MPICH: hydra's control connection on 127.0.0.1, not the hostname's address
        UCX_NET_DEVICES="lo",  # MPICH's default UCX netmod otherwise listens on every interface
        FI_TCP_IFACE="lo", FI_SOCKETS_IFACE="lo",  # same for the OFI netmod, if selected
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",  # Open MPI's mpirun refuses root otherwise
    )
    result = run_job("mpirun", cmd, env)
    # The reference is requested only here, so a skip above costs no reference run.
    check_against_reference("mpirun", result, request.getfixturevalue("reference"))


# -- no port is picked for someone else to bind (tests/dist.py) --------------------------------------
def _binds(port: int) -> subprocess.Popen:
    """A stand-in launcher that binds ``port`` on 127.0.0.1 the way rank 0 binds --master_port."""
    code = f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print('bound')"
    return start([sys.executable, "-c", code], base_env())


def _take(port, held):
    """Another process takes ``port`` (bound and listening until the test closes ``held``)."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held.append(s)


def test_launch_retries_when_its_port_was_taken_before_it_was_bound():
    held, ports = [], []

    def start_taken_once(port):
        ports.append(port)
        if len(ports) == 1:  # another process takes the port between the choice and the bind
            _take(port, held)
        return _binds(port)

    try:
        proc, out, timed_out = launch(start_taken_once, scaled(30))
    finally:
        for s in held:
            s.close()
    assert (proc.returncode, timed_out, out.strip()) == (0, False, "bound"), out
    assert len(ports) == 2, ports  # taken once, relaunched once


def test_launch_retries_a_bounded_number_of_times_and_not_other_failures():
    calls, held = [], []

    def always_taken(port):
        calls.append(port)
        _take(port, held)
        return _binds(port)

    try:
        proc, out, _ = launch(always_taken, scaled(30))
    finally:
        for s in held:
            s.close()
    assert proc.returncode != 0 and address_in_use(out) and len(calls) == LAUNCH_ATTEMPTS, (calls, out)

    calls.clear()
    proc, out, _ = launch(lambda port: calls.append(port) or start([sys.executable, "-c", "raise SystemExit(3)"],
                                                                    base_env()), scaled(30))
    assert proc.returncode == 3 and len(calls) == 1  # any other failure is the test's to report, at once


def test_rendezvous_store_holds_its_port_before_any_rank_starts():
    with rendezvous_store(WORLD) as env:
        port = int(env["MASTER_PORT"])
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["MASTER_ADDR"] == "127.0.0.1"
        with socket.socket() as s, pytest.raises(OSError) as taken:
            s.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        # a rank's env:// initialisation joins it as a client (world 1 here: no peer to wait for)
        code = ("import torch.distributed as d; d.init_process_group('gloo'); "
                "print(d.get_world_size(), d.get_rank()); d.destroy_process_group()")
        one = start([sys.executable, "-c", code], base_env(**env, RANK="0", WORLD_SIZE="1"))
        out, timed_out = communicate(one, scaled(60))
        assert (one.returncode, timed_out, out.strip().splitlines()[-1:]) == (0, False, ["1 0"]), out


# -- run_ranks: ranks forked from a preloaded server, with the caller's environment -----------------
def _rank_facts():
    return {"probe": os.environ.get("ACCO_TEST_PROBE"), "ppid": os.getppid(),
            "preloaded": "deepspeed.runtime.engine" in sys.modules and "ds_acco.deepspeed" in sys.modules}


def test_ranks_start_preloaded_with_the_callers_environment(monkeypatch):
    run_ranks(_rank_facts)  # the fork server is running from here on
    monkeypatch.setenv("ACCO_TEST_PROBE", "set after the fork server started")
    facts = run_ranks(_rank_facts)
    assert [f["probe"] for f in facts] == ["set after the fork server started"] * WORLD
    # forked from the server that imported DeepSpeed and ds_acco once (tests/rank_preload.py)
    assert all(f["preloaded"] and f["ppid"] != os.getpid() for f in facts), facts


def test_a_variable_read_at_interpreter_start_gets_fresh_ranks(monkeypatch):
    run_ranks(_rank_facts, world=1)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # glibc reads it once, at process start
    facts = run_ranks(_rank_facts, world=1)  # one fresh interpreter is enough to tell
    assert all(f["ppid"] == os.getpid() and not f["preloaded"] for f in facts), facts  # spawned by us
