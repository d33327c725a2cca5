"""What the workers offer: the scheduler's view of them, and a wait for resources.

A task asking for resources that no worker offers would wait forever; :func:`check_resources`
waits up to ``dasktensor.placement.resource-timeout`` for such a worker and raises
:class:`~dasktensor.cluster.NoWorkerWithResourcesError` naming what the workers offer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from dasktensor import _config
from dasktensor._placement import Placement
from dasktensor._runtime import ProcessState, runtime
from dasktensor.cluster._errors import NoWorkerWithResourcesError


def scheduler_workers(client) -> dict[str, dict]:
    """The scheduler's view of its workers: ``{address: info}`` (resources, threads...),
    asked afresh.

    Not ``client.scheduler_info()``: that returns the client's cached identity, which the
    client's own periodic refresh (every 2 s, asking for no workers) may replace between
    the fresh answer and its return, and which it keeps when the scheduler does not answer
    (an ``OSError``, logged at debug level).  Either way a cluster with workers looked
    like one without (seen on a loaded 2-core machine: "the cluster has none").
    """
    try:
        info = client.sync(client.scheduler.identity, n_workers=-1)
    except TypeError:  # a scheduler before identity(n_workers=) lists every worker
        info = client.sync(client.scheduler.identity)
    return dict(info.get("workers", {}))


def run_on_workers(client, function, *args, workers: Iterable[str], on_error: str = "return"):
    """``client.run(function, *args)`` on those of ``workers`` that the scheduler lists
    now: ``{address: result}``.

    ``workers`` is usually a list made a moment before (the replicas' workers, those
    heard from); one of them may have died since.  The scheduler drops a dead worker as
    its connection closes, but asked to run something there anyway, Dask's broadcast
    retries the refused connection until its connect timeout
    (``distributed.comm.timeouts.connect``, 30 s), holding up the caller: a sharded
    likelihood waited twice that long to rebuild a killed worker's shard.

    Examples
    --------
    >>> from distributed import Client, LocalCluster
    >>> with LocalCluster(n_workers=1, processes=False) as cluster, Client(cluster) as c:
    ...     (address,) = scheduler_workers(c)
    ...     ran = run_on_workers(c, lambda: 1, workers=[address, "tcp://127.0.0.1:9"])
    ...     gone = run_on_workers(c, lambda: 1, workers=["tcp://127.0.0.1:9"])
    >>> ran == {address: 1}, gone
    (True, {})
    """
    listed = scheduler_workers(client)
    alive = [a for a in workers if a in listed]
    if not alive:
        return {}
    return client.run(function, *args, workers=alive, on_error=on_error)


def offers(worker_resources: dict, wanted: dict | None) -> bool:
    """Whether a worker offering ``worker_resources`` can run a task wanting ``wanted``."""
    return all((worker_resources or {}).get(k, 0) >= v for k, v in (wanted or {}).items())


class _ResourcesSeen(ProcessState):
    """What the workers offered, by client, when last asked (a look is cached briefly)."""

    def __init__(self):
        self.seen: dict[tuple[int, str], tuple[float, list[dict]]] = {}


_RESOURCE_CACHE_SECONDS = 2.0


def _worker_resources(client, refresh: bool = False) -> list[dict]:
    key = (id(client), client.scheduler.address)
    now = time.monotonic()
    seen = runtime.state(_ResourcesSeen).seen
    cached = seen.get(key)
    if cached is not None and not refresh and now - cached[0] < _RESOURCE_CACHE_SECONDS:
        return cached[1]
    found = [dict(w.get("resources") or {}) for w in scheduler_workers(client).values()]
    seen[key] = (now, found)
    return found


def check_resources(client, placements: Iterable[Placement]) -> None:
    """Fail with a clear error when no worker offers a task's resources (after a timeout).

    A task whose resources no worker offers would otherwise wait forever.
    """
    wanted = [p.resources for p in placements if p.resources]
    if not wanted:
        return

    def missing(workers):
        return [r for r in wanted if not any(offers(w, r) for w in workers)]

    if not missing(_worker_resources(client)):
        return
    timeout = _config.seconds("placement.resource-timeout")
    deadline = time.monotonic() + timeout
    while True:
        workers = _worker_resources(client, refresh=True)
        lacking = missing(workers)
        if not lacking:
            return
        if time.monotonic() >= deadline:
            offered = [w for w in workers if w] or "no resources at all"
            raise NoWorkerWithResourcesError(
                f"No worker of the cluster at {client.scheduler.address} offers the "
                f"resources {lacking[0]} that a task asks for (waited {timeout:g} s; "
                f"{len(workers)} worker(s), offering {offered}). Start a worker with "
                'them, e.g. `dask worker ADDRESS --resources "GPU=1"`, or '
                "LocalCluster(resources={...}); the wait is set by "
                "dask.config 'dasktensor.placement.resource-timeout'."
            )
        time.sleep(0.1)
