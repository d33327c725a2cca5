"""Clusters the tests share: local process clusters on loopback, a worker offering
{"GPU": 1} beside one offering nothing, a worker without a nanny to freeze, a free port
on loopback for a server a test starts."""

from __future__ import annotations

import contextlib

from dasktensor.cluster import scheduler_workers


def local_cluster(**kwargs):
    """A LocalCluster on 127.0.0.1: 2 worker processes (with nannies) of 1 thread each, and
    no dashboard (the scheduler's HTTP server on a free loopback port, not 8787) unless
    ``dashboard_address`` asks for one; ``kwargs`` override these and go to LocalCluster."""
    from distributed import LocalCluster

    kwargs.setdefault("n_workers", 2)
    kwargs.setdefault("threads_per_worker", 1)
    kwargs.setdefault("processes", True)
    if kwargs.setdefault("dashboard_address", None) is None:
        kwargs.setdefault(
            "scheduler_kwargs", {"dashboard": False, "dashboard_address": "127.0.0.1:0"}
        )
    return LocalCluster(host="127.0.0.1", **kwargs)


def mixed_spec_cluster():
    """Two worker processes, ``cpu`` (no resources) and ``gpu`` (``{"GPU": 1}``)."""
    from distributed import Nanny, Scheduler, SpecCluster

    worker = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}}
    gpu = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "resources": {"GPU": 1}}}
    return SpecCluster(
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}},
        workers={"cpu": worker, "gpu": gpu},
    )


def gpu_worker_address(client) -> str:
    """The address of the worker that offers resources."""
    (address,) = [a for a, w in scheduler_workers(client).items() if w["resources"]]
    return address


def _call_totals(dask_worker) -> dict[str, int]:
    host = dask_worker.plugins.get("dasktensor-models")
    return {name: t[0] for name, t in host.calls.totals.items()} if host is not None else {}


def channel_calls(client, by_worker: bool = False) -> dict:
    """Calls the workers answered through the remote-call channel so far, by the name of
    the model or resident stage (a DASK-mode task's name), summed over the workers, or
    ``{worker address: {name: calls}}`` with ``by_worker``."""
    per_worker = client.run(_call_totals)
    if by_worker:
        return per_worker
    out: dict[str, int] = {}
    for totals in per_worker.values():
        for name, n in totals.items():
            out[name] = out.get(name, 0) + n
    return out


def bare_worker(scheduler_address: str):
    """A ``dask worker`` process without a nanny (SIGSTOP freezes it, nobody restarts it)
    on loopback, importing what this process imports; the caller kills it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", scheduler_address,
         "--no-nanny", "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def freeze(pid: int, seconds: float = 30.0) -> None:
    """Stop process ``pid`` (SIGSTOP) and return once each of its threads is stopped.

    ``kill`` returns before the threads stop: each stops itself when next scheduled, and
    on a loaded machine the frozen worker of a test once answered a call sent 0.1 ms
    after ``kill`` returned."""
    import os
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + seconds

    def states() -> set[str]:
        found = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    found.add(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        return found

    while not states() <= {"T", "t"}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped after {seconds} s: {states()}")
        time.sleep(0.001)


def free_port() -> int:
    """A port of 127.0.0.1 that no process listens on now (the system's choice)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check, seconds: float = 15.0):
    """Poll ``check()`` until it is truthy; its last value."""
    import time

    deadline = time.monotonic() + seconds
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@contextlib.contextmanager
def cluster_with_a_bare_worker(settings: dict | None = None):
    """A Client (not the default) of a one-worker :func:`local_cluster` joined by a
    :func:`bare_worker` to freeze: yields ``(client, the bare worker's process)``.

    ``distributed.scheduler.worker-ttl`` is 300 s, so that the scheduler does not drop a
    frozen worker while a test runs; ``settings`` are set too while the cluster runs.
    The bare worker is woken (SIGCONT) and killed on exit."""
    import os
    import signal

    import dask
    from distributed import Client

    settings = {"distributed.scheduler.worker-ttl": "300s", **(settings or {})}
    with (
        dask.config.set(settings),
        local_cluster(n_workers=1) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        bare = bare_worker(cluster.scheduler_address)
        try:
            client.wait_for_workers(2, timeout=60)
            yield client, bare
        finally:
            os.kill(bare.pid, signal.SIGCONT)
            bare.kill()
            bare.wait()


@contextlib.contextmanager
def heavy_function_on_its_own_cluster(delay: float):
    """``(client, f)``: a Client (not the default) of a new :func:`local_cluster`, two
    worker processes with nannies (a test may kill one), and ``f(x) = sum(2 x) + sum(3 x)``
    compiled for it: two heavy calls (``_ops.Scale``) of ``delay`` seconds each."""
    import pytensor.tensor as pt
    from _ops import Scale
    from distributed import Client

    import dasktensor as dt

    x = pt.vector("x")
    out = Scale(2.0, delay=delay)(x).sum() + Scale(3.0, delay=delay)(x).sum()
    with local_cluster() as cluster, Client(cluster, set_as_default=False) as client:
        yield client, dt.function([x], out, scheduler=client)
