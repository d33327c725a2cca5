"""The functions a caller ships to the cluster for its remote models.

Dask pickles a function by reference (module and name), so whatever runs on a worker or
the scheduler is imported there by module.  These live here, in a package that imports
neither dasktensor nor PyTensor, so that building and finding a model costs a bare worker
(or scheduler) only this package's import.

* :func:`build_replica`: the body of a model's build task (``build-<name>`` on the
  dashboard); it adds the :class:`~dasktensor_worker.plugin.ModelHost` plugin to its
  worker if needed.  :func:`lease`: the body of the task that keeps its replicas.
  :func:`hold_resources`: the body of the task that keeps a replica's resources taken.
* :func:`endpoint`, :func:`holds`, :func:`build_count`, :func:`release`,
  :func:`add_lease`, :func:`unlease`, :func:`summary`: run on the workers with
  ``client.run`` (discovery and the call servers' addresses,
  ``RemoteModel.build_counts``, ``RemoteModel.close``, a shared model's holder letting
  go, ``dt.cluster_summary``).
* :func:`next_number`: run on the scheduler with ``client.run_on_scheduler``; the numbers
  that spread calls over replicas (see ``dasktensor.remote._policy``).

This module imports nothing beyond the standard library at import time; the plugin
(``distributed``) is imported by the functions that need it, on the worker.
"""

from __future__ import annotations

from collections.abc import Callable


def build_replica(
    key: str,
    name: str,
    factory: Callable | bytes,
    concurrency: int,
    lease: str | None = None,
    scalable: bool = True,
) -> tuple[str, bool]:
    """Task body: build model ``key`` on this worker (once); the worker's address, and
    whether this task built it (False: the worker held it already).

    ``lease``: the key of a task its creator keeps wanted; the replica is dropped once
    the scheduler has forgotten it (see ``ModelHost.check_leases``).  ``scalable``: the
    model has a replica on every worker that can hold one (no ``replicas=`` limit), so
    more workers serve more of its calls (what ``dt.Adaptive`` asks for)."""
    from distributed import get_worker

    from dasktensor_worker.plugin import ensure_host

    worker = get_worker()
    if isinstance(factory, bytes):  # cloudpickle's bytes (see remote._replicas.shipped_factory)
        import pickle

        factory = pickle.loads(factory)
    built = ensure_host(worker).build(key, name, factory, concurrency, lease, scalable)
    return worker.address, built


def missing_modules(modules: list[str]) -> list[str]:
    """``client.run``: those of ``modules`` this worker cannot import (checked before a
    model's factory is sent: a worker that cannot load a task's function drops its
    connection to the scheduler, and does not come back)."""
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def hold_resources(key: str) -> bool:
    """Task body of ``hold-<name>``: keep the resources this task was given (the model's
    ``resources``) for as long as this worker holds a replica of model ``key``; whether
    it held one.

    The task leaves the worker's thread pool (``secede``): it takes no thread slot, but
    Dask keeps its resources taken on the worker and on the scheduler until it ends, so
    no other task asking for them runs beside the replica."""
    from distributed import get_worker, secede

    from dasktensor_worker.plugin import host_of

    host = host_of(get_worker())
    replica = None if host is None else host.replicas.get(key)
    if replica is None:  # dropped before this task ran: nothing to hold
        return False
    secede()
    replica.released.wait()
    return True


def lease() -> None:
    """Task body of a model's lease (``dasktensor-lease-<key>-<n>``): it computes
    nothing; that its creator's client wants it keeps the model's replicas alive."""


def _host(dask_worker):
    from dasktensor_worker.plugin import host_of

    return host_of(dask_worker)


def holds(key: str, dask_worker=None) -> bool:
    """``client.run``: whether this worker holds model ``key``."""
    host = _host(dask_worker)
    return host is not None and key in host.replicas


def endpoint(key: str, dask_worker=None) -> tuple | None:
    """``client.run``: where this worker's call server listens, ``(host, port, tls)``, if
    it holds model ``key``; else None."""
    host = _host(dask_worker)
    return host.endpoint if host is not None and key in host.replicas else None


def build_count(key: str, dask_worker=None) -> int:
    """``client.run``: how many times model ``key`` was built on this worker."""
    host = _host(dask_worker)
    return 0 if host is None else host.builds.get(key, 0)


def release(key: str, dask_worker=None) -> bool:
    """``client.run``: drop model ``key`` from this worker; whether it was held."""
    host = _host(dask_worker)
    return host is not None and host.release(key)


def add_lease(key: str, lease: str, dask_worker=None) -> bool:
    """``client.run``: ``lease`` keeps model ``key`` too (another process sharing a model
    it found built); whether this worker holds the model."""
    host = _host(dask_worker)
    return host is not None and host.add_lease(key, lease)


def unlease(key: str, lease: str, dask_worker=None) -> bool:
    """``client.run``: give back ``lease`` on model ``key`` (a model shared by several
    processes); the replica is dropped when no lease is left.  Whether it was."""
    host = _host(dask_worker)
    return host is not None and host.unlease(key, lease)


def summary(dask_worker=None) -> dict:
    """``client.run``: the models this worker holds and the calls it answered so far.

    ``{"models": {key: name}, "builds": {key: count}, "calls": {name: [calls, errors,
    seconds, records]}}`` (records: calls alone and batches of a batched method); calls
    are counted by model name, as the calls page counts them.
    """
    host = _host(dask_worker)
    if host is None:
        return {"models": {}, "builds": {}, "calls": {}}
    models = {key: replica.name for key, replica in dict(host.replicas).items()}
    totals = host.calls.since(float("inf"))["totals"]  # no records: only the totals
    return {"models": models, "builds": dict(host.builds), "calls": totals}


def next_number(kind: str, key: str | None, dask_scheduler=None) -> int:
    """``client.run_on_scheduler``: a number distinct per process (``kind="process"``,
    counting up) or per model (``kind="model"``, the same for one ``key``) on the cluster.

    Examples
    --------
    >>> class Scheduler: ...
    >>> s = Scheduler()
    >>> [next_number("process", None, s) for _ in range(2)]
    [0, 1]
    >>> [next_number("model", k, s) for k in ("a", "b", "a")]
    [0, 1, 0]
    """
    numbers = getattr(dask_scheduler, "_dasktensor_numbers", None)
    if numbers is None:
        numbers = dask_scheduler._dasktensor_numbers = {"process": 0, "model": {}}
    if kind == "process":
        numbers["process"] += 1
        return numbers["process"] - 1
    return numbers["model"].setdefault(key, len(numbers["model"]))
