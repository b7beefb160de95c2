"""Smoke runs of ds_acco (ACCO on) under the three launchers users start it with.

Each test runs ``tests/launch/smoke.py`` on 2 CPU ranks under ``deepspeed``, ``torchrun`` or
``mpirun`` and compares what rank 0 reports (world size, every loss, a checksum of the committed
weights) with a reference run of the same script started without any launcher (two processes with
RANK, WORLD_SIZE, ... set by hand). The run is deterministic, so all numbers must match exactly:
a launcher that wires ranks differently (wrong rank, world size 1, different data) fails.

Launchers and the interpreter come from ``sys.executable``'s directory (the venv's bin) so that
the tests work in a fresh venv that is not activated. All traffic stays on 127.0.0.1.

The mpirun test needs the PyPI packages ``mpich`` and ``mpi4py`` (``pip install mpich mpi4py``):
without them it skips, or fails when the environment variable CI is set.
"""
from __future__ import annotations

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

from dist import clear_stale_build_locks
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, bool]:
    """Output of ``proc`` (a session leader); on timeout kill its whole process group."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        clear_stale_build_locks()  # it may have been killed while compiling a DeepSpeed op
        return out, True


def run_job(label: str, cmd: list[str], env: dict) -> dict:
    """Run one launcher command; return rank 0's SMOKE_RESULT or fail with the output's tail."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, timed_out = _communicate(proc, TIMEOUT_S)
    return parse_result(label, cmd, out, proc.returncode, timed_out)


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
    """The smoke run with no launcher: WORLD processes with the torch.distributed variables set by hand."""
    port = free_port()
    cmd = [sys.executable, *smoke_args()]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"rank{rank}.log"), "w+") for rank in range(WORLD)]
        procs = []
        for rank in range(WORLD):
            env = base_env(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def test_deepspeed_launcher(reference, tmp_path):
    cmd = launcher("deepspeed")
    if not cmd:
        pytest.fail(f"no 'deepspeed' launcher next to {sys.executable} or on PATH (is deepspeed installed?)")
    cmd += ["--num_gpus", str(WORLD), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            # never /job/hostfile (DeepSpeed's default, which would mean a multi-node ssh launch)
            "--hostfile", str(tmp_path / "no-hostfile"), *smoke_args()]
    check_against_reference("deepspeed", run_job("deepspeed", cmd, base_env()), reference)


def test_torchrun(reference):
    cmd = launcher("torchrun", module="torch.distributed.run")
    cmd += ["--nnodes", "1", "--nproc_per_node", str(WORLD), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *smoke_args()]
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


def test_mpirun(request):
    problem = _mpi_problem()
    if problem is not None:
        msg = f"mpirun smoke test cannot run: {problem}\nfix: {sys.executable} -m {MPI_INSTALL_HINT}"
        if in_ci():
            pytest.fail(msg + "\n(CI is set, so this is a failure, not a skip)", pytrace=False)
        pytest.skip(msg.replace("\n", "; "))
    port = free_port()
    cmd = launcher("mpirun") + ["-np", str(WORLD), sys.executable, *smoke_args()]
    env = base_env(
        # smoke.py maps MPI ranks onto RANK/WORLD_SIZE/LOCAL_RANK itself and keeps these two, so
        # DeepSpeed's own mpi4py discovery (MASTER_ADDR from `hostname -I`, port 29500) never runs.
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        HYDRA_LAUNCHER="fork",  # MPICH: fork local ranks, never ssh
        HYDRA_IFACE="lo",  # MPICH: hydra's control connection on 127.0.0.1, not the hostname's address
        UCX_NET_DEVICES="lo",  # MPICH's default UCX netmod otherwise listens on every interface
        FI_TCP_IFACE="lo", FI_SOCKETS_IFACE="lo",  # same for the OFI netmod, if selected
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",  # Open MPI's mpirun refuses root otherwise
    )
    result = run_job("mpirun", cmd, env)
    # The reference is requested only here, so a skip above costs no reference run.
    check_against_reference("mpirun", result, request.getfixturevalue("reference"))
