"""An emulated cluster on one Linux box: one network namespace per node, shaped links.

Topology (nothing is created in, or routed to, the host's own namespace)::

    <prefix>-sw   "switch" namespace: a bridge ``br0`` and one port ``p<i>`` per node
    <prefix>-n<i> node i: ``lo`` up, ``eth0`` = 10.250.<subnet>.<i+1>/24, no default route

Each node is joined to the switch by a veth pair created directly inside the two namespaces
(``ip -n <switch> link add p<i> ... peer ... netns <node>``), so no interface ever appears in
the host's root namespace. Both directions of a node's link are shaped with ``tc tbf``:
``eth0`` egress (node → switch) and ``p<i>`` egress (switch → node). Per-node rates allow
heterogeneous links.

Latency: this kernel has no ``sch_netem``, so no delay is added; the links only have the
kernel's own sub-millisecond veth/bridge latency. :class:`Cluster` refuses a ``latency_ms``
rather than pretend (the advisor measures latency instead of assuming it).

Every command needs root; :func:`require_root` says so plainly. Setup first removes leftovers
of the same prefix (idempotent); :meth:`Cluster.teardown` always runs (context manager), and
:func:`launch` ends every rank it started on failure, timeout or interrupt.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, TextIO, Union

SUBNET_BASE = "10.250"  # private; only ever configured inside our own namespaces
NODE_IFACE = "eth0"


class NeedsRoot(RuntimeError):
    """The emulated cluster needs root (network namespaces, veth pairs, tc)."""


def is_root() -> bool:
    """True when this process may create namespaces."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def require_root() -> None:
    """Raise :class:`NeedsRoot` with a plain explanation unless running as root."""
    if not is_root():
        raise NeedsRoot("the emulated cluster needs root: it creates network namespaces, veth pairs and tc "
                        "qdiscs (run as root, e.g. with sudo, or use --network loopback)")


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*(/s)?\s*$", re.IGNORECASE)


def parse_rate(rate: Union[str, float, int, None]) -> Optional[float]:
    """Bits per second of a rate like ``"1gbit"``, ``"100mbit"``, ``"500kbit"`` or a number of
    bit/s; ``None``, ``"none"``, ``"unshaped"`` or 0 mean unshaped (returns None)."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return float(rate) if rate > 0 else None
    text = rate.strip().lower()
    if text in ("", "none", "unshaped", "0", "inf"):
        return None
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"bad rate {rate!r}: write e.g. '1gbit', '100mbit', '500kbit' or 'unshaped'")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if (m.group(3) or "").lower() == "bps":  # bytes per second, tc's convention
        value *= 8
    return value if value > 0 else None


def format_rate(bits_per_s: Optional[float]) -> str:
    """``1e9`` → ``'1gbit'``; None → ``'unshaped'``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            v = bits_per_s / scale
            return f"{v:g}{unit}"
    return f"{bits_per_s:g}bit"


def tbf_args(bits_per_s: float) -> List[str]:
    """``tc qdisc ... tbf`` arguments for a rate: a burst of >= 2 ms at that rate (and >= 64 KiB,
    so one GSO segment fits), and a queue of at most 50 ms."""
    burst = max(64 * 1024, int(bits_per_s / 8 * 0.002))
    return ["tbf", "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "50ms"]


@dataclasses.dataclass
class Node:
    """One emulated node: its namespace, address and link rate (bit/s, None = unshaped)."""
    index: int
    netns: str
    address: str
    rate: Optional[float]


class Cluster:
    """N nodes in their own network namespaces behind a switch namespace.

    ``rates``: one rate for every node, or one per node (heterogeneous links).
    ``prefix``: names of the namespaces; distinct prefixes let clusters coexist.
    Use as a context manager: setup on enter, teardown on exit, whatever happens.
    """

    def __init__(self, nodes: int, rates: Union[str, float, None, Sequence] = None, *, prefix: str = "accob",
                 subnet: int = 0, latency_ms: float = 0.0, dry_run: bool = False):
        if nodes < 1:
            raise ValueError(f"nodes = {nodes}: need at least one node")
        if nodes > 250:
            raise ValueError(f"nodes = {nodes}: at most 250 nodes fit the /24 subnet")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
            raise ValueError(f"prefix {prefix!r}: use 1-12 lowercase letters/digits, starting with a letter")
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet = {subnet}: must be 0..255 (10.250.<subnet>.0/24)")
        if latency_ms:
            raise ValueError(f"latency_ms = {latency_ms}: this kernel has no sch_netem, so the emulated cluster "
                             "cannot add latency; leave it at 0 (the advisor measures the real latency)")
        if isinstance(rates, (list, tuple)):
            if len(rates) != nodes:
                raise ValueError(f"{len(rates)} rates for {nodes} nodes: give one rate, or one per node")
            parsed = [parse_rate(r) for r in rates]
        else:
            parsed = [parse_rate(rates)] * nodes
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.nodes = [Node(i, f"{prefix}-n{i}", f"{SUBNET_BASE}.{subnet}.{i + 1}", parsed[i]) for i in range(nodes)]
        self.dry_run = dry_run
        self.commands: List[List[str]] = []  # every command run (or planned, in dry_run)
        self._up = False

    # -- commands --------------------------------------------------------------------------------
    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = list(argv)
        self.commands.append(cmd)
        if self.dry_run:
            return subprocess.CompletedProcess(cmd, 0, "", "")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"cluster setup: `{shlex.join(cmd)}` failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()}")
        return out

    def namespaces(self) -> List[str]:
        """Our namespaces (switch first)."""
        return [self.switch] + [n.netns for n in self.nodes]

    def existing(self) -> List[str]:
        """Namespaces of this prefix that exist now (leftovers included)."""
        if self.dry_run:
            return []
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if n == self.switch or re.fullmatch(rf"{re.escape(self.prefix)}-n\d+", n)]

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self) -> "Cluster":
        """Create (or re-create) the namespaces, links and shaping. Idempotent."""
        require_root() if not self.dry_run else None
        self.teardown()  # leftovers of an earlier run with the same prefix
        self._up = True
        sw = self.switch
        self._run("ip", "netns", "add", sw)
        self._run("ip", "-n", sw, "link", "set", "lo", "up")
        self._run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        self._run("ip", "-n", sw, "link", "set", "br0", "up")
        for node in self.nodes:
            ns, port = node.netns, f"p{node.index}"
            self._run("ip", "netns", "add", ns)
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            # Both ends are born inside our namespaces: nothing touches the host's.
            self._run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
            self._run("ip", "-n", sw, "link", "set", port, "master", "br0")
            self._run("ip", "-n", sw, "link", "set", port, "up")
            # IPv4 only, so gloo binds the address we chose.
            self._run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                      check=False)
            self._run("ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", NODE_IFACE)
            self._run("ip", "-n", ns, "link", "set", NODE_IFACE, "up")
            if node.rate is not None:
                self._run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", NODE_IFACE, "root",
                          *tbf_args(node.rate))
                self._run("ip", "netns", "exec", sw, "tc", "qdisc", "replace", "dev", port, "root",
                          *tbf_args(node.rate))
        return self

    def teardown(self) -> None:
        """Delete every namespace of this prefix (their veths and qdiscs go with them). Safe to
        call any number of times."""
        for ns in (self.existing() if not self.dry_run else (self.namespaces() if self._up else [])):
            self._kill_inside(ns)
            self._run("ip", "netns", "del", ns, check=False)
        self._up = False

    def _kill_inside(self, ns: str) -> None:
        """End processes still running inside one of our namespaces (a namespace is only freed
        when its last process exits)."""
        if self.dry_run:
            return
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def __enter__(self) -> "Cluster":
        try:
            return self.setup()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc) -> None:
        self.teardown()

    # -- launching -------------------------------------------------------------------------------
    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    def rank_env(self, rank: int, port: int) -> Dict[str, str]:
        """The torch.distributed environment of the rank on node ``rank`` (one rank per node)."""
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port), "RANK": str(rank),
                "WORLD_SIZE": str(len(self.nodes)), "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
                "GLOO_SOCKET_IFNAME": NODE_IFACE}

    def wrap(self, rank: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside node ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[rank].netns, *argv]

    def describe(self) -> str:
        rates = [format_rate(n.rate) for n in self.nodes]
        same = len(set(rates)) == 1
        shaping = "unshaped" if all(n.rate is None for n in self.nodes) else (
            f"{'all ' + rates[0] if same else ', '.join(rates)} (tc tbf, both directions)")
        return (f"{len(self.nodes)} namespaces ({self.prefix}-n0..n{len(self.nodes) - 1}) behind a bridge in "
                f"{self.switch}, links {shaping}, no added latency")


@contextlib.contextmanager
def loopback_store(world: int) -> Iterator[int]:
    """The ranks' rendezvous store, bound on port 0 by the launching process before any rank starts
    and held while they run (they join it as clients: :func:`loopback_env`); yields its port. A
    port found free and bound later by rank 0 could be taken by another process in between."""
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def loopback_env(rank: int, world: int, port: int) -> Dict[str, str]:
    """The environment of one rank on 127.0.0.1 (no namespaces), a client of the store on ``port``
    (:func:`loopback_store`; torch's env:// init joins it as torchrun's workers join their agent's)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def sweep_deepspeed_shm(port: int) -> None:
    """DeepSpeed's CPU shm comm op leaves a ~66 MB buffer per rank in /dev/shm for every
    (address, port) it initialised with; remove those of a finished launch on ``port``."""
    import glob
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; the message names which and why."""


def launch(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *, timeout_s: float,
           stream: Optional[TextIO] = None, tail_lines: int = 40) -> List[str]:
    """Start one process per rank, prefix and forward their output, wait for all of them.

    Returns each rank's output lines. On a non-zero exit, a timeout or KeyboardInterrupt every
    rank still running is killed (its whole process group) and :class:`LaunchError` (or the
    interrupt) is raised with the last lines of the failing ranks.
    """
    stream = stream if stream is not None else sys.stdout
    procs: List[subprocess.Popen] = []
    lines: List[List[str]] = [[] for _ in commands]
    partial = [""] * len(commands)
    sel = selectors.DefaultSelector()
    deadline = time.monotonic() + timeout_s
    try:
        for rank, (cmd, env) in enumerate(zip(commands, envs)):
            full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
            p = subprocess.Popen(list(cmd), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            os.set_blocking(p.stdout.fileno(), False)
            sel.register(p.stdout, selectors.EVENT_READ, rank)
        open_streams = len(procs)
        failed: Optional[str] = None
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                failed = f"timed out after {timeout_s:.0f}s"
                break
            for key, _ in sel.select(timeout=min(left, 1.0)):
                rank = key.data
                chunk = key.fileobj.read()
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                text = partial[rank] + chunk.decode("utf-8", errors="replace")
                *complete, partial[rank] = text.split("\n")
                for line in complete:
                    lines[rank].append(line)
                    stream.write(f"[rank{rank}] {line}\n")
                stream.flush()
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = "rank " + ", ".join(f"{r} exited with {procs[r].returncode}" for r in bad)
                break
        if failed is None:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = "rank " + ", ".join(f"{r} exited with {procs[r].returncode}" for r in bad)
        if failed is not None:
            _kill_all(procs)
            tails = "\n".join(f"--- rank {r} (last lines) ---\n" + "\n".join(lines[r][-tail_lines:])
                              for r in range(len(procs)))
            raise LaunchError(f"{failed}\n{tails}")
        return ["\n".join(ls) for ls in lines]
    except BaseException:
        _kill_all(procs)
        raise
    finally:
        sel.close()
        for p in procs:
            if p.stdout:
                p.stdout.close()


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """Kill the process group of every rank still running (only the ones we started)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
