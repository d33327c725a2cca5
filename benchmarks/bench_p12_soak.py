"""P12 soak: 10^5 remote calls from 2 sampler processes x 4 threads to 4 models on 4 workers.

Four ``RemoteModel``s (``_ops.Normal`` without delay: a 10-dimensional standard normal's
logp and gradient), each replicated on the 4 worker processes of a ``LocalCluster``; two
*sampler* processes (spawned, as ``pm.sample(cores=2, mp_ctx="spawn")`` spawns its chains),
each with 4 threads, call them in turn (``model.call("logp_grad", x)``), checking every
answer: ``--warmup`` (10^5) calls, then ``--calls`` (10^5) measured ones.  After the
warm-up and at the end every process reports its resident memory (VmRSS) and its open
sockets: the samplers themselves and, through ``client.run``, the workers.  The warm-up
is long enough to fill each worker's call log for the dashboard (the last 20,000 calls,
~4 MiB; 25,000 calls reach each worker in the warm-up).

Each socket is named by its two ends (``/proc/self/net``; the listening ports of every
process, the call servers', and this process's Dask connections, whose they are): a
connection to a worker's call server, the scheduler's (Dask's own, pooled), and so on.
A process's connection pool opens a connection to a worker when calls to it collide, up
to one per calling thread; the warm-up need not reach that bound, so a sampler may open
one after it.  The scheduler's connection pool to the workers (its broadcasts of
``client.run``, dasktensor's dashboard monitor asking each worker for its call log) also
holds a varying few: both are printed, and only sockets of other kinds must not change.

Targets: no error; RSS growth after warm-up <= 5 % in every process; a sampler's
connections to one worker's call server at most one per thread; no other socket opened
or closed after warm-up (connections are pooled, not leaked).

Run: ``python benchmarks/bench_p12_soak.py [--calls N]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, print_table, quiet, versions_line

NAME = "p12-soak"
WORKERS = 4
MODELS = 4
PROCESSES = 2
THREADS = 4


def vitals(dask_worker=None) -> tuple[int, list[str]]:
    """This process's resident memory (bytes) and open sockets, each as
    ``"tcp 127.0.0.1:A>127.0.0.1:B"`` (local>remote), ``"tcp listen :A"``, ``"unix"`` (with
    its path if bound) or ``"socket"`` (another family), from ``/proc/self/net``."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    inodes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.append(link[8:-1])
    known: dict[str, str] = {}
    for family in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{family}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                if state == "0A":  # LISTEN
                    known[inode] = f"tcp listen :{int(local.rsplit(':', 1)[1], 16)}"
                else:
                    known[inode] = f"tcp {_address(local)}>{_address(remote)}"
    with open("/proc/self/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            known[fields[6]] = "unix" + (f" {fields[7]}" if len(fields) > 7 else "")
    return rss, sorted(known.get(inode, "socket") for inode in inodes)


def _address(hex_address: str) -> str:
    """``"0100007F:1F90"`` (/proc/net/tcp's little-endian IPv4) -> ``"127.0.0.1:8080"``."""
    host, port = hex_address.rsplit(":", 1)
    if len(host) == 8:
        host = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        host = "[ipv6]"
    return f"{host}:{int(port, 16)}"


def dask_roles(client) -> dict[str, str]:
    """This process's Dask connections, ``"tcp A>B"`` (as :func:`vitals` says them) ->
    whose: the client's or the (in-process) scheduler's connection pool or stream."""
    import asyncio

    from distributed.comm.core import Comm

    found: dict[str, str] = {}

    def note(comm, what: str) -> None:
        if isinstance(comm, Comm) and not comm.closed():
            local, peer = (a.split("://", 1)[1] for a in (comm.local_address, comm.peer_address))
            found[f"tcp {local}>{peer}"] = what

    scheduler = client.cluster.scheduler

    async def look() -> None:  # on the event loop that owns them
        for owner, pool in (("client", client.rpc), ("scheduler", scheduler.rpc)):
            for kind in ("available", "occupied"):
                for comms in getattr(pool, kind).values():
                    for comm in comms:
                        note(comm, f"the {owner}'s connection pool")
        for stream in scheduler.stream_comms.values():
            note(stream.comm, "the scheduler's stream")
        note(getattr(client.scheduler_comm, "comm", None), "the client's stream")

    asyncio.run_coroutine_threadsafe(look(), client.loop.asyncio_loop).result(30)
    return found


def kind_of(socket: str, ports: dict[int, str], roles: dict[str, str]) -> str:
    """What a socket of :func:`vitals` is, its ports named: ``ports`` maps a listening
    port to the process (or server) listening there, ``roles`` this process's Dask
    connections (:func:`dask_roles`) to whose they are."""
    if not socket.startswith("tcp ") or socket.startswith("tcp listen"):
        return socket
    local, remote = socket[4:].split(">")
    here, there = (int(a.rsplit(":", 1)[1]) for a in (local, remote))
    if there in ports:  # this process connected
        return f"connection to {ports[there]}"
    if here in ports:  # accepted by a server of this process
        peer = roles.get(f"tcp {remote}>{local}", "a process not measured")
        return f"connection to {ports[here]} from {peer}"
    return f"tcp to an unknown port {there}"


def changed(before: list[str], after: list[str]) -> list[str]:
    """Sockets of each kind opened (+) and closed (-) between two lists of kinds."""
    was, now = Counter(before), Counter(after)
    return [f"+{n} {k}" for k, n in (now - was).items()] + [
        f"-{n} {k}" for k, n in (was - now).items()
    ]


def sampler(models, warmup: int, calls: int, report, go, leave) -> None:
    """A sampler process: ``THREADS`` threads, ``calls`` calls in all; reports its
    vitals after warm-up (then waits for ``go``) and at the end (then waits for
    ``leave``: its connections stay open while the workers are measured), and its
    errors."""
    import numpy as np

    x = np.linspace(-1.0, 1.0, 10)
    want = -0.5 * float(x @ x)
    errors: list[str] = []
    each, first = calls // THREADS, warmup // THREADS
    warm = threading.Barrier(THREADS + 1)
    done_warming = threading.Event()

    def work(t: int) -> None:
        for i in range(first + each):
            if i == first:
                warm.wait()
                done_warming.wait()
            try:
                logp, grad = models[(t + i) % len(models)].call("logp_grad", x)
                if logp != want or not np.array_equal(grad, -x):
                    errors.append(f"wrong answer {logp}")
            except Exception as e:  # counted, reported
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    warm.wait()  # every thread has made its warm-up calls
    report.put(("warm", os.getpid(), vitals()))
    go.wait()  # every process is warm, and the workers were measured
    done_warming.set()
    for t in threads:
        t.join()
    report.put(("end", os.getpid(), vitals()))
    report.put(("errors", os.getpid(), errors[:5] + [f"... {len(errors)} in all"] * bool(errors)))
    leave.wait()


def main(calls: int = 100_000, warmup: int = 100_000) -> list[Row]:
    quiet()
    import functools

    from _ops import Normal

    import dasktensor as dt
    from dasktensor_worker import tasks

    print(f"[{NAME}] {versions_line()}")
    context = multiprocessing.get_context("spawn")
    with local_cluster(n_workers=WORKERS) as client:
        models = [
            dt.RemoteModel(
                functools.partial(Normal, 0.0), name=f"normal-{chr(97 + k)}", scheduler=client
            )
            for k in range(MODELS)
        ]
        for m in models:
            m.start()
        report, go, leave = context.Queue(), context.Event(), context.Event()
        procs = [
            context.Process(
                target=sampler,
                args=(models, warmup // PROCESSES, calls // PROCESSES, report, go, leave),
            )
            for _ in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        seen: dict = {}

        def collect(kind: str) -> None:
            while sum(k == kind for k, _ in seen) < PROCESSES:
                got, pid, value = report.get(timeout=1800)
                seen[(got, pid)] = value

        collect("warm")
        warm_workers = client.run(vitals)
        warm_here = vitals()[1], dask_roles(client)
        t0 = time.perf_counter()
        go.set()
        collect("end")
        took = time.perf_counter() - t0
        collect("errors")
        end_workers = client.run(vitals)
        end_here = vitals()[1], dask_roles(client)
        scheduler_port = int(client.scheduler.address.rsplit(":", 1)[1])
        # where each worker's call server listens (one per worker, for all its models)
        call_ports = {e[1]: a for a, e in client.run(tasks.endpoint, models[0].key).items()}
        leave.set()
        for p in procs:
            p.join()
        for m in models:
            m.close()

    errors = [e for (kind, _), v in seen.items() if kind == "errors" for e in v]
    processes = {f"sampler {pid}": (v, seen[("end", pid)]) for (k, pid), v in seen.items()
                 if k == "warm"}  # fmt: skip
    processes.update(
        (f"worker {a.rsplit(':', 1)[1]}", (v, end_workers[a])) for a, v in warm_workers.items()
    )
    ports = {scheduler_port: "the scheduler"}  # listening port -> who listens
    for who, (_, (_, end_socks)) in processes.items():
        for socket in end_socks:
            if socket.startswith("tcp listen :"):
                ports[int(socket.rsplit(":", 1)[1])] = who
    ports.update((port, f"the call server of worker {a.rsplit(':', 1)[1]}") for port, a in
                 call_ports.items())  # fmt: skip
    for socket in end_here[0]:  # this process's own servers (the scheduler's, HTTP)
        if socket.startswith("tcp listen :"):
            ports.setdefault(int(socket.rsplit(":", 1)[1]), "this process")
    pooled = "connection to worker {} from the scheduler's connection pool"
    # whose each connection is, at warm-up's end and at the end: the measured processes'
    # (samplers, workers) and this process's Dask connections
    roles = []
    for moment, (here_socks, here_roles) in enumerate((warm_here, end_here)):
        known = {s: who for who, vs in processes.items() for s in vs[moment][1]}
        known.update({s: "this process" for s in here_socks})
        roles.append({**known, **here_roles})
    lines, growth, moved, others_moved, most, dask_pooled = [], [], {}, 0, 0, [0, 0]
    for who, ((rss, socks), (end_rss, end_socks)) in sorted(processes.items()):
        growth.append(end_rss / rss - 1)
        kinds = [[kind_of(s, ports, r) for s in ss] for ss, r in zip((socks, end_socks), roles)]
        if kinds[0] != kinds[1]:
            moved[who] = changed(*kinds)
        if who.startswith("sampler"):  # its connections to each worker's call server
            to = Counter(k for k in kinds[1] if k.startswith("connection to the call server"))
            most = max([most, *to.values()])
        else:
            mine = pooled.format(who.split()[1])
            dask_pooled[0] += kinds[0].count(mine)
            dask_pooled[1] += kinds[1].count(mine)
        others = [[k for k in ks if "call server" not in k and "scheduler's connection pool"
                   not in k] for ks in kinds]  # fmt: skip
        others_moved += sorted(others[0]) != sorted(others[1])
        lines.append((who, f"{rss / 2**20:.1f}", f"{end_rss / 2**20:.1f}",
                      f"{100 * growth[-1]:+.2f} %", len(socks), len(end_socks)))  # fmt: skip
    print_table(
        ["process", "RSS warm MiB", "RSS end MiB", "growth", "sockets warm", "sockets end"],
        lines,
        title=f"[{NAME}] {warmup:,} calls to warm up, then {calls:,} in {took:.1f} s "
        f"({calls / took:,.0f} calls/s)",
    )
    for who, sockets in moved.items():
        print(f"[{NAME}] {who}: sockets opened (+) or closed (-) after warm-up: "
              f"{'; '.join(sockets)}")  # fmt: skip
    if errors:
        print(f"[{NAME}] errors: {errors}")
    rows = [
        Row(NAME, "errors", len(errors), 0),
        Row(NAME, "largest RSS growth after warm-up (%)", 100 * max(growth), 5),
        # a pool opens a connection when calls to a worker collide, up to one per thread
        Row(NAME, "processes whose open sockets changed, call connections included", len(moved)),
        Row(NAME, "a sampler's connections to one call server at the end, most", most, THREADS),
        Row(
            NAME,
            "the scheduler's pooled connections to the workers, after warm-up",
            dask_pooled[0],
        ),
        Row(NAME, "the scheduler's pooled connections to the workers, at the end", dask_pooled[1]),
        Row(NAME, "processes whose other sockets changed", others_moved, 0),
        Row(NAME, "calls per second after warm-up", calls / took),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls measured")
    parser.add_argument("--warmup", type=int, default=100_000, help="calls before")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(args.calls, args.warmup)
    if not args.no_save:
        save_results(NAME, rows)
