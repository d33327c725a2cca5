"""Clusters the tests share: a worker offering {"GPU": 1} beside one offering nothing."""

from __future__ import annotations


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
    (address,) = [
        a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["resources"]
    ]
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


def eventually(check, seconds: float = 15.0):
    """Poll ``check()`` until it is truthy; its last value."""
    import time

    deadline = time.monotonic() + seconds
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value
