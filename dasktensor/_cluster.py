"""Cluster plumbing: which Client a call uses, what the workers offer, one submit path.

Everything in dasktensor that talks to a distributed cluster goes through here: the engine
(cluster tasks), remote models (replica builds) and ``pmap`` (finding the client).

* **Which scheduler.**  :class:`SchedulerRef` keeps a function's choice (a Client, an
  address, a local scheduler, or Dask's own resolution at call time) in a form that
  pickles: a Client pickles as its address and each process reconnects lazily
  (:func:`client_for_address`, one Client per process and address).
* **Fork.**  ``pm.sample(cores=2)`` forks on Linux.  A forked child resets Dask's threaded
  scheduler pools (their threads do not exist there: the child would hang on its first
  graph) and forgets the Clients inherited from its parent, reconnecting to the same
  scheduler on first use.
* **Resources.**  A task asking for resources that no worker offers would wait forever;
  :func:`check_resources` waits up to ``dasktensor.placement.resource-timeout`` for such a
  worker and raises :class:`NoWorkerWithResourcesError` naming what the workers offer.
* **Submitting.**  :func:`submit` is the one place a task goes to the cluster, with its
  :class:`~dasktensor._placement.Placement` turned into ``client.submit`` keywords.
* **The calls page.**  :func:`show_calls_page` adds ``/dasktensor/calls`` to the
  scheduler's dashboard (``dt.connect`` and remote models do it), where the remote-call
  channel's calls show, which Dask's task stream cannot.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import dask
import dask.threaded
from dask.base import get_scheduler, named_schedulers
from dask.utils import parse_bytes

from dasktensor import _config
from dasktensor._placement import Placement

# ----------------------------------------------------------------------------- clients

_inherited_addresses: list[str] = []
_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def _after_fork_in_child() -> None:  # pragma: no cover - runs in forked children
    """Make Dask usable in a forked child (see the module docstring)."""
    global _clients_lock, _carried_lock
    _carried_lock = threading.Lock()
    dask.threaded.default_pool = None
    dask.threaded.pools.clear()
    dask.threaded.pools_lock = threading.Lock()
    _clients_lock = threading.Lock()
    _clients.clear()
    try:
        from distributed import client as dclient
    except ImportError:
        return
    inherited = [*dclient._global_clients.values(), dclient._current_client.get()]
    for c in inherited:
        address = getattr(getattr(c, "scheduler", None), "address", None)
        if address and address not in _inherited_addresses:
            _inherited_addresses.append(address)
    dclient._global_clients.clear()
    dclient._current_client.set(None)
    if dask.config.get("scheduler", None) in ("dask.distributed", "distributed"):
        # set by the parent's default client; it would make Dask look for that client
        dask.config.config.pop("scheduler", None)


os.register_at_fork(after_in_child=_after_fork_in_child)


def client_for_address(address: str, timeout: float | None = None):
    """This process's own Client to ``address`` (one per process, created on first use)."""
    from distributed import Client

    key = (os.getpid(), address)
    with _clients_lock:
        client = _clients.get(key)
        if client is None or client.status not in ("running", "connecting", "newly-created"):
            if timeout is None:
                timeout = _config.seconds("connect-timeout")
            client = Client(address, set_as_default=False, timeout=timeout)
            _clients[key] = client
        return client


def is_client(obj) -> bool:
    """Whether ``obj`` is a ``distributed.Client`` (without importing distributed)."""
    return type(obj).__name__ == "Client" and hasattr(obj, "submit") and hasattr(obj, "gather")


def default_client():
    """The distributed Client Dask would use now (its default), or None."""
    get = get_scheduler()
    client = getattr(get, "__self__", None)
    return client if is_client(client) else None


def _scheduler_names() -> list[str]:
    """The names ``dask.base.get_scheduler`` accepts."""
    return sorted([*named_schedulers, "distributed", "dask.distributed"])


class SchedulerRef:
    """Which scheduler a compiled function uses, kept in a form that pickles.

    ``None`` follows Dask's resolution at call time.  A ``Client`` is kept, and pickles as
    its address; a string is a named local scheduler (``"threads"``, ``"sync"``) or a
    scheduler address; a callable is a scheduler ``get`` function.
    """

    def __init__(self, scheduler=None):
        self.pid = os.getpid()  # a Client is of no use in a forked child
        self.client = None
        self.address: str | None = None
        self.get: Callable | str | None = None
        if scheduler is None:
            pass
        elif is_client(scheduler):
            self.client = scheduler
            self.address = scheduler.scheduler.address
        elif isinstance(scheduler, str) and "://" in scheduler:
            self.address = scheduler
        elif isinstance(scheduler, str) and scheduler.lower() not in _scheduler_names():
            # Dask would say so at the first call that needs it, without naming this one
            raise ValueError(
                "scheduler expected a scheduler address ('tcp://host:port') or one of "
                f"Dask's scheduler names {_scheduler_names()}, got {scheduler!r}"
            )
        elif isinstance(scheduler, str) or callable(scheduler):
            self.get = scheduler
        else:
            raise TypeError(
                "scheduler expected None, a distributed Client, a scheduler address "
                "('tcp://host:port'), a scheduler name ('threads', 'sync') or a Dask "
                f"scheduler get function, got {scheduler!r}"
            )

    def __getstate__(self):
        address = self.address
        if address is None and self.get is None:
            # no explicit choice: remember the default client the caller uses now, so the
            # function keeps using that cluster in another process
            try:
                from distributed import default_client as distributed_default

                address = distributed_default().scheduler.address
            except (ImportError, ValueError):
                pass
        return {"address": address, "get": self.get}

    def __setstate__(self, state):
        self.pid = os.getpid()
        self.client = None
        self.address = state["address"]
        self.get = state["get"]

    def running_client(self):
        """The running Client this reference resolves to, without connecting one; None
        if it would need a new one (for finalizers: connecting there can deadlock)."""
        if self.client is not None and self.pid == os.getpid() and self.client.status == "running":
            return self.client
        if self.address is not None:
            with _clients_lock:
                client = _clients.get((os.getpid(), self.address))
            return client if client is not None and client.status == "running" else None
        found = default_client() if self.get is None else None
        return found if found is not None and found.status == "running" else None

    def resolve(self):
        """Return ``("client", Client)`` or ``("get", scheduler_get_callable)``."""
        kind, found = self._resolve()
        if kind == "client":  # kept to name it if it closes (see closed_client)
            self.last = (weakref.ref(found), found.scheduler.address)
        return kind, found

    def _resolve(self):
        if self.client is not None and self.pid == os.getpid():
            # reconnecting: this one, whose state tells the caller the scheduler is lost
            # (a new client to its address would wait for the connect timeout)
            if self.client.status in ("running", "connecting"):
                return "client", self.client
        if self.address is not None:
            return "client", client_for_address(self.address)
        get = get_scheduler(scheduler=self.get)
        if get is not None and is_client(getattr(get, "__self__", None)):
            return "client", get.__self__
        if get is None and _inherited_addresses:
            return "client", client_for_address(_inherited_addresses[-1])
        return "get", get or dask.threaded.get

    def closed_client(self) -> str | None:
        """The scheduler address of the client this reference last resolved to, if that
        client is closed now (by the program, or after losing its scheduler)."""
        ref, address = getattr(self, "last", (lambda: None, None))
        client = ref()
        if client is None or client.status == "running":
            return None
        return address


# ----------------------------------------------------------------------------- workers


def scheduler_workers(client) -> dict[str, dict]:
    """The scheduler's view of its workers: ``{address: info}`` (resources, threads...)."""
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # distributed before n_workers=
        info = client.scheduler_info()
    return dict(info.get("workers", {}))


def offers(worker_resources: dict, wanted: dict | None) -> bool:
    """Whether a worker offering ``worker_resources`` can run a task wanting ``wanted``."""
    return all((worker_resources or {}).get(k, 0) >= v for k, v in (wanted or {}).items())


class NoWorkerWithResourcesError(RuntimeError):
    """No worker of the cluster offers the resources that a task asks for."""


class SchedulerLostError(ConnectionError):
    """The client lost its scheduler (killed, restarted, out of reach) mid-run.

    Dask's workers close when they lose their scheduler, and a client gives up
    reconnecting after its ``timeout`` (``distributed.comm.timeouts.connect``): the
    cluster must be started again (``dt.sample(..., resume=True)`` then continues a run
    that had a ``store=``).
    """


def lost_scheduler(client, error: BaseException | None = None) -> bool:
    """Whether ``error`` (raised by Dask while running work on ``client``) comes from
    losing the scheduler: the client is reconnecting or closed, or Dask says so.

    >>> class Client:
    ...     status = "running"
    >>> lost_scheduler(Client(), RuntimeError("x cancelled for reason: scheduler-connection-lost."))
    True
    >>> lost_scheduler(Client(), ValueError("the model's own error"))
    False
    """
    if getattr(client, "status", "running") in ("connecting", "closing", "closed", "failed"):
        return True
    return "scheduler-connection-lost" in str(error or "")


_resources_seen: dict[tuple[int, str], tuple[float, list[dict]]] = {}
_RESOURCE_CACHE_SECONDS = 2.0


def _worker_resources(client, refresh: bool = False) -> list[dict]:
    key = (id(client), client.scheduler.address)
    now = time.monotonic()
    cached = _resources_seen.get(key)
    if cached is not None and not refresh and now - cached[0] < _RESOURCE_CACHE_SECONDS:
        return cached[1]
    found = [dict(w.get("resources") or {}) for w in scheduler_workers(client).values()]
    _resources_seen[key] = (now, found)
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


# ----------------------------------------------------------------------------- submitting


def submit(client, fn: Callable, *args, key: str, placement: Placement | None = None):
    """Submit ``fn(*args)`` as the task ``key``, placed as ``placement`` says; a Future.

    Tasks are never pure (each call has fresh keys, see ``dasktensor._translate``).
    """
    kwargs = (placement or Placement()).submit_kwargs()
    return client.submit(fn, *args, key=key, pure=False, **kwargs)


@contextlib.contextmanager
def carrying(nbytes: int):
    """While submitting a task that carries ``nbytes`` of data on purpose (a data shard's
    rows with its build, a compiled step method with a chain's first segment).

    Dask warns of task graphs over ``distributed.admin.large-graph-warning-threshold``;
    such data is sent with its task once, by design.  The threshold is raised while any
    such task is being submitted (counted: submissions run in several threads).
    """
    if not isinstance(nbytes, int) or nbytes <= 0:
        yield
        return
    key = "distributed.admin.large-graph-warning-threshold"
    with _carried_lock:
        if _carried["count"] == 0:
            _carried["saved"] = dask.config.get(key)
        _carried["count"] += 1
        wanted = 2 * nbytes + 2**20
        if parse_bytes(dask.config.get(key)) < wanted:
            dask.config.set({key: wanted})
    try:
        yield
    finally:
        with _carried_lock:
            _carried["count"] -= 1
            if _carried["count"] == 0:
                dask.config.set({key: _carried["saved"]})


_carried_lock = threading.Lock()
_carried: dict = {"count": 0, "saved": None}


@contextlib.contextmanager
def task_slot_released():
    """While the calling thread waits for other Dask work (the builds of replicas it is
    about to call), if it runs a Dask task: the thread leaves its worker's thread pool
    and rejoins it afterwards (``distributed.secede``/``rejoin``).

    A chain's segment, a task, may build the data shards or remote models its
    log-density calls; with every worker thread running a segment, those builds would
    wait for a free thread for ever.  Elsewhere this does nothing.
    """
    try:
        from distributed.utils import thread_state
    except ImportError:  # pragma: no cover - distributed is a dependency
        yield
        return
    if getattr(thread_state, "key", None) is None or getattr(_seceded, "now", False):
        yield
        return
    from distributed import rejoin, secede

    secede()
    _seceded.now = True
    try:
        yield
    finally:
        _seceded.now = False
        rejoin()


_seceded = threading.local()


# ----------------------------------------------------------------------------- dashboard

_pages_shown: set[tuple[int, str]] = set()


def show_calls_page(client) -> None:
    """Add the calls page to the cluster's dashboard, once per client and process.

    ``/dasktensor/calls`` (``dasktensor_worker.dashboard``) shows the channel's calls,
    which Dask's task stream cannot.  A scheduler that cannot load the page (no
    ``dasktensor_worker`` installed there) leaves the cluster working without it.
    """
    key = (id(client), client.scheduler.address)
    if key in _pages_shown:
        return
    _pages_shown.add(key)
    from dasktensor_worker.dashboard import CallsPage

    try:
        client.register_plugin(CallsPage())
    except Exception as e:  # the calls still work: say once what is missing
        warnings.warn(
            f"the dashboard's calls page could not be added to the scheduler at "
            f"{client.scheduler.address} ({type(e).__name__}: {e}); install dasktensor "
            "in the scheduler's environment to see remote calls on its dashboard",
            RuntimeWarning,
            stacklevel=3,
        )


def calls_link(client) -> str | None:
    """The address of the dashboard's calls page of ``client``'s cluster, or None.

    Remote-model calls and resident stages skip the scheduler, so Dask's task stream does
    not show them; this page does: a bar per call on each worker, and per model the
    calls, errors, calls in flight and mean time.  ``dt.connect()`` adds it to the
    dashboard (so does the first use of a remote model).

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1, dashboard_address="127.0.0.1:0")  # doctest: +SKIP
    >>> dt.calls_link(client)  # doctest: +SKIP
    'http://127.0.0.1:38121/dasktensor/calls'
    """
    link = getattr(client, "dashboard_link", None)
    if not link or "dashboard" not in client.scheduler_info().get("services", {}):
        return None
    show_calls_page(client)
    return link.rsplit("/", 1)[0] + "/dasktensor/calls"
