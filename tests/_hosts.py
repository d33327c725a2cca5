"""Separate hosts on one machine: Linux network namespaces on a bridge, for the multi-host tests.

Each *host* is a network namespace with its own address on a private subnet, joined by a
veth pair to a bridge in the root namespace, which has the subnet's first address: the
test process (the client) stays in the root namespace and reaches every host, as a
laptop reaches a cluster.  Programs are started in a host with ``ip netns exec``: the
scheduler and the workers as users start them, with the ``dask`` command line.

A host's link can be cut (``ip link set eth0 down`` inside it): its processes live on,
but nothing they send arrives and nothing reaches them, and nobody gets a reset: the
silent network of a pulled cable or a dead switch port.  Packets can be dropped at random
(:meth:`Hosts.lose`, with nftables: this kernel has no ``netem`` qdisc, so added delay is
not tried).

Everything is stopped by PID and removed when the :class:`Hosts` closes.  It needs
CAP_NET_ADMIN (root): :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import filelock

DASK = str(Path(sys.executable).with_name("dask"))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def no_packet_loss() -> str | None:
    """Why :meth:`Hosts.lose` cannot work here, or None if it can."""
    if shutil.which("nft") is None:
        return "no `nft` command (nftables); .ci/run installs it"
    return unavailable()


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None if they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2); .ci/run installs it"
    if os.geteuid() != 0:
        return "network namespaces need CAP_NET_ADMIN (root)"
    name = f"dtprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """A bridge and ``n`` hosts (network namespaces) with addresses ``10.R.S.11...``;
    ``Hosts(3)`` then ``scheduler(0)``, ``worker(1, address)``, ``worker(2, address)``
    is a cluster of three hosts (see ``tests/test_multihost.py``)."""

    made = 0  # Hosts made by this process: each gets names and a subnet of its own

    def __init__(self, n: int):
        Hosts.made += 1
        tag, self.claim = _claim_tag((os.getpid() * 7 + Hosts.made) % TAGS)
        self.tag = f"dt{tag}"
        self.subnet = f"10.{200 + tag // 250}.{tag % 250}"  # a subnet per tag, not per tag % 250
        self.bridge = f"{self.tag}br"
        self.names = [f"{self.tag}h{i}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{11 + i}" for i in range(n)]
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._remove_leftovers()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses)):
            outside = f"{self.tag}v{i}"
            _ip("netns", "add", name)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            self.run(i, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            self.run(i, "ip", "link", "set", "eth0", "up")
            self.run(i, "ip", "link", "set", "lo", "up")
            self.run(i, "ip", "route", "add", "default", "via", f"{self.subnet}.1")

    def _remove_leftovers(self) -> None:
        """A run killed before its cleanup leaves namespaces and veth peers behind (the
        tag is this process's now, see :func:`_claim_tag`: no live run's)."""
        for name in self.names:
            _ip("netns", "del", name, check=False)
        for i in range(len(self.names)):
            _ip("link", "del", f"{self.tag}v{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def run(self, i: int, *command: str) -> str:
        """Run ``command`` in host ``i``; its output (an error names the command)."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.names[i], *command], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} in {self.names[i]}: {done.stderr.strip()}")
        return done.stdout

    def start(self, i: int, *command: str, env: dict | None = None) -> subprocess.Popen:
        """Start ``command`` in host ``i`` (its output in a log file); stopped on close."""
        log = Path(f"/tmp/{self.names[i]}-{len(self.logs)}.log")
        self.logs.append(log)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[i], *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: stopped with its children
            )
        self.processes.append(proc)
        return proc

    def scheduler(self, i: int, *options: str, port: int = 8786, env=None) -> str:
        """Start ``dask scheduler`` in host ``i``; its address, once it accepts clients."""
        address = f"tcp://{self.addresses[i]}:{port}"
        self.start(i, DASK, "scheduler", "--host", self.addresses[i], "--port", str(port),
                   "--no-dashboard", *options, env=env)  # fmt: skip
        _wait_for_port(self.addresses[i], port, self)
        return address

    def worker(self, i: int, scheduler: str, *options: str, env=None) -> subprocess.Popen:
        """Start ``dask worker`` (with its nanny) in host ``i``."""
        return self.start(i, DASK, "worker", scheduler, "--host", self.addresses[i],
                          "--nthreads", "1", "--no-dashboard", *options, env=env)  # fmt: skip

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill ``proc`` (one started here) and its children at once, as a crash does."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        self.processes.remove(proc)

    def lose(self, i: int, percent: int) -> None:
        """Drop ``percent`` % of the packets host ``i`` sends and receives, at random
        (nftables in its namespace; ``percent=0`` stops it).  TCP resends them: what
        users see is late replies, not lost ones."""
        if "table inet loss" in self.run(i, "nft", "list", "tables"):
            self.run(i, "nft", "delete", "table", "inet", "loss")
        if percent == 0:
            return
        self.run(i, "nft", "add", "table", "inet", "loss")
        for chain, hook, side in (("in", "input", "iifname"), ("out", "output", "oifname")):
            self.run(i, "nft", "add", "chain", "inet", "loss", chain,
                     f"{{ type filter hook {hook} priority 0; }}")  # fmt: skip
            self.run(i, "nft", "add", "rule", "inet", "loss", chain, side, "eth0",
                     "numgen", "random", "mod", "100", "<", str(percent),
                     "counter", "drop")  # fmt: skip

    def dropped(self, i: int) -> int:
        """Packets :meth:`lose` has dropped on host ``i`` so far (0 without loss)."""
        if "table inet loss" not in self.run(i, "nft", "list", "tables"):
            return 0
        listed = self.run(i, "nft", "list", "table", "inet", "loss")
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", listed))

    def cut(self, i: int) -> None:
        """Silence host ``i``'s link: its processes live on, nothing crosses."""
        self.run(i, "ip", "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        self.run(i, "ip", "link", "set", "eth0", "up")
        self.run(i, "ip", "route", "replace", "default", "via", f"{self.subnet}.1")

    def log(self) -> str:
        """The last lines of every process's output (for an assertion's message)."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.logs if p.exists())

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self._remove_leftovers()
        for log in self.logs:
            log.unlink(missing_ok=True)
        self.claim.release()  # the tag is free again

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: tags, hence subnets 10.200.0-10.239.249 and names dt0-dt9999
TAGS = 10000


def _claim_tag(first: int) -> tuple[int, filelock.FileLock]:
    """A tag no live process uses, from ``first`` on, and the file lock that holds it for
    this process until released (a lock the kernel lets go when the process dies).

    Two test runs at once (``.ci/run`` runs the two lines' suites together) once drew
    the same tag from their PIDs: the second removed the first's namespaces as
    leftovers, and a client of the first reconnected to the second's scheduler at the
    same address.  A tag whose lock this process takes is free: any namespaces of its
    name are a killed run's."""
    directory = Path(tempfile.gettempdir()) / "dasktensor-hosts"
    directory.mkdir(exist_ok=True)
    for step in range(TAGS):
        tag = (first + step) % TAGS
        claim = filelock.FileLock(directory / f"{tag}.lock")  # held until the Hosts closes
        try:
            claim.acquire(timeout=0)
        except filelock.Timeout:  # a live run holds it
            continue
        return tag, claim
    raise RuntimeError(f"all {TAGS} host tags are held by live test runs")


def _wait_for_port(host: str, port: int, hosts: Hosts, seconds: float = 60) -> None:
    import socket

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {seconds} s:\n{hosts.log()}")
