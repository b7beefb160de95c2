"""Start distributed jobs in tests without racing for a port.

A port found free and bound later can be taken in between by any process on the machine
(EADDRINUSE under load, see shared/PLATFORM_NOTES.md). So nothing here picks a port for someone
else to bind:

- :func:`run_ranks` starts N local ranks (gloo on 127.0.0.1) that run one function each. This
  process binds the rendezvous store itself, on port 0, before any rank starts
  (:func:`rendezvous_store`); the ranks find it through MASTER_PORT and torch's
  ``TORCHELASTIC_USE_AGENT_STORE``, the way torchrun's workers find their agent's store, so
  env:// initialisation (DeepSpeed's, FSDP's, a worker's own) works unchanged.
- torchrun binds its own store on port 0 with :data:`TORCHRUN_RENDEZVOUS`.
- The ``deepspeed`` launcher has no such mode (rank 0 binds ``--master_port``): :func:`launch`
  retries the whole launch on a fresh port when the ranks' output says the address was in use.

Ranks are forked from a multiprocessing fork server that imported torch, DeepSpeed and ds_acco
once (tests/rank_preload.py), not spawned as fresh interpreters that import them again (~8 s of
CPU per rank, most of the suite's time on 2 cores). Each rank gets the caller's environment as it
is at :func:`run_ranks`; only variables read once at interpreter start (glibc's MALLOC_*, LD_*,
PYTHON*, DS_ACCO_INSTALL) cannot be set that way, so a caller that changed one gets spawned ranks.
"""
from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable, Iterator

import torch
from torch.distributed import TCPStore

from timeouts import scaled

HOST = "127.0.0.1"
# torchrun's c10d rendezvous on port 0: its agent binds the store and hands the real port to its workers.
TORCHRUN_RENDEZVOUS = ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:0")
LAUNCH_ATTEMPTS = 3  # a launch that lost its port to another process is retried this often in all
_ADDRESS_IN_USE = ("address already in use", "eaddrinuse")
# Environment read once at interpreter start (glibc's malloc, the loader, Python itself, our .pth
# hook), which a forked rank cannot change: a caller that changed any of it gets spawned ranks.
_READ_AT_START = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHON", "DS_ACCO_INSTALL")
_fork_server_env: dict | None = None  # the environment the fork server was started with


@contextlib.contextmanager
def rendezvous_store(world: int) -> Iterator[dict]:
    """A TCPStore bound on port 0 by this process, alive for the ``with`` block; yields the
    environment that makes every rank's env:// initialisation a client of it."""
    store = TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=scaled(300)))
    try:
        yield {"MASTER_ADDR": HOST, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


@contextlib.contextmanager
def solo_world() -> Iterator[None]:
    """A one-rank job's environment for code under test that initialises torch.distributed in this
    process (``deepspeed.init_distributed``, as ``ds_acco.initialize`` does before its ranks'
    agreement): the store is :func:`rendezvous_store`'s, bound on port 0 here. Without it DeepSpeed
    discovers a one-rank MPI world and binds port 29500, which a test in another pytest-xdist worker
    may hold at that moment (EADDRINUSE). The environment is restored and a group started inside is
    destroyed; a group already there on entry (another test's) is used as is and left alone."""
    import torch.distributed as dist
    started_here = not dist.is_initialized()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                            "TORCHELASTIC_USE_AGENT_STORE")}
    try:
        with rendezvous_store(1) as env:
            os.environ.update({**env, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
            try:
                yield
            finally:
                if started_here and dist.is_initialized():
                    dist.destroy_process_group()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def port_busy(port: int) -> Iterator[None]:
    """``port`` in use for the ``with`` block, on every address: listened on here, or already held
    by another process (then it is busy anyway). A test that must not bind a fixed port runs inside."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As torch's store does: a port only lingering in TIME_WAIT is bound, so "held by someone else"
    # below means a listener (Linux refuses the bind then, SO_REUSEADDR or not).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind(("0.0.0.0", port))
            sock.listen(1)
        except OSError:
            pass  # held by someone else: busy all the same
        yield
    finally:
        sock.close()


def settled_thread_count() -> int:
    """This process's OS threads (Python's and those C++ libraries start, e.g. a gloo group's
    workers), counted once the count has not changed for 100 ms (at most ~3 s): a joined Python
    thread leaves Python before its OS thread has finished exiting, under load tens of ms later. A
    leaked thread never exits, so it is always counted."""
    count, since, deadline = len(os.listdir("/proc/self/task")), time.monotonic(), time.monotonic() + 3.0
    while time.monotonic() - since < 0.1 and time.monotonic() < deadline:
        time.sleep(0.01)
        now = len(os.listdir("/proc/self/task"))
        if now != count:
            count, since = now, time.monotonic()
    return count


def address_in_use(output: str) -> bool:
    """Whether a launch's output says a rank could not bind its address."""
    low = output.lower()
    return any(tag in low for tag in _ADDRESS_IN_USE)


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, bool]:
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


def _unbound_port() -> int:
    """A port free at this instant, for launchers that insist on binding it themselves; only
    :func:`launch` uses it, since only it retries when the port is gone by then."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def launch(start: Callable[[int], subprocess.Popen], timeout: float,
           attempts: int = LAUNCH_ATTEMPTS) -> tuple[subprocess.Popen, str, bool]:
    """Run a job whose launcher binds a port we must name in advance (``deepspeed --master_port``).

    ``start(port)`` starts it as a session leader with stdout piped (stderr merged). If it fails
    and its output says the address was in use, it is started again on another port, at most
    ``attempts`` times in all. Returns the last process, its output and whether it timed out.
    """
    for attempt in range(1, attempts + 1):
        proc = start(_unbound_port())
        out, timed_out = communicate(proc, timeout)
        if timed_out or proc.returncode == 0 or not address_in_use(out) or attempt == attempts:
            return proc, out, timed_out
        print(f"dist.launch: attempt {attempt} lost its port to another process; relaunching", flush=True)
    raise AssertionError("unreachable")


def clear_stale_build_locks() -> None:
    """Remove torch JIT build locks that no live process holds (see prebuild.py): a process killed
    mid-compile would otherwise make every later DeepSpeed start wait on its lock forever."""
    import prebuild
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        prebuild.clear_stale_locks(root, log=lambda line: print(line, flush=True))


def _read_at_start(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START)}


def _stacks_of(out: str) -> str:
    """The Python stacks a hung rank dumped on SIGUSR1 (its last 6000 characters), or why there are none."""
    try:
        with open(out + ".stacks") as f:
            text = f.read()
    except OSError:
        return "  (no stack dump: the rank had not started)"
    return "  its threads when it was stopped:\n" + (text[-6000:] if text.strip() else "  (empty: blocked outside Python's reach)")


def _context():
    """The fork server (preloaded, started on first use), or spawn when the caller's environment
    differs from the server's in a variable only a fresh interpreter reads."""
    global _fork_server_env
    if _fork_server_env is None:
        mp.get_context("forkserver").set_forkserver_preload(["rank_preload"])
        # Python 3.11's fork server is handed our sys.path but does not apply it before the preload
        # (tests/ is on it only through pytest.ini): give it the path through PYTHONPATH instead.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _fork_server_env = dict(os.environ)
    if _read_at_start(dict(os.environ)) != _read_at_start(_fork_server_env):
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


_STACKS = None  # this rank's file for the Python stacks of every thread, dumped on SIGUSR1 (a hung rank)


def _entry(rank, world, env, store_env, fn, kwargs, out):
    global _STACKS
    import faulthandler
    _STACKS = open(out + ".stacks", "w")
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    os.environ.clear()  # the caller's environment, not the one the fork server started with
    os.environ.update(env)
    os.environ.update(store_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    try:
        result = fn(**kwargs)
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int = 2, timeout: float = None, allow_missing: bool = False, **kwargs):
    """Run ``fn(**kwargs)`` on ``world`` ranks; return the list of their return values.

    ``timeout``: seconds, already scaled (pass ``scaled(idle_budget)``); default ``scaled(100)``.

    With ``allow_missing`` a rank that died without a result gives None instead of an error.
    """
    if timeout is None:
        timeout = scaled(100)
    ctx = _context()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp, rendezvous_store(world) as store_env:
        port = store_env["MASTER_PORT"]
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(r, world, env, store_env, fn, kwargs, outs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        # One deadline for all ranks. Once a rank has failed, the others get a grace period only:
        # they would otherwise wait in a collective until the deadline (unless dead ranks are
        # expected: allow_missing).
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if not allow_missing and any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + scaled(20))
            time.sleep(0.05)
        hung = [p for p in procs if p.is_alive()]
        if hung:  # where each hung rank is: every thread's Python stack, into its .stacks file
            for p in hung:
                os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
        for p in hung:
            p.kill()
            p.join()
        if hung:  # a rank killed while compiling a DeepSpeed op leaves torch's build lock behind
            clear_stale_build_locks()
        # DeepSpeed's CPU shm op leaves one buffer per rank and port in /dev/shm: drop ours.
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        results, errors = [], []
        for r, out in enumerate(outs):
            if not os.path.exists(out):
                if allow_missing:
                    results.append(None)
                    continue
                why = f", killed at the time limit ({timeout:.0f} s; ACCO_TEST_TIMEOUT_SCALE scales it) or after a peer failed" \
                    if procs[r] in hung else ""
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{why})")
                if procs[r] in hung:
                    errors.append(_stacks_of(out))
                continue
            data = torch.load(out, weights_only=False)
            if "error" in data:
                errors.append(f"rank {r}:\n{data['error']}")
            else:
                results.append(data["ok"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
