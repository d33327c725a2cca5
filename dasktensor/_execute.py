"""Execution: run a plan's task graph on a Dask scheduler, or on the caller and a cluster.

Two paths, chosen per call from the function's ``scheduler`` or Dask's own resolution
(``scheduler=`` argument, then ``dask.config`` ``scheduler``, then the default
distributed ``Client``):

* **A local scheduler** (the threaded one by default, or any ``dask.typing``
  scheduler-get callable such as ``dask.get``): the whole task graph goes to it.
* **A distributed Client**: cheap stages whose inputs are on the caller run on the caller;
  heavy tasks (and cheap stages between two of them) are submitted to the cluster with
  their annotations (resources, retries, priority); their results are gathered once, and
  the cheap stages after them run on the caller.  One evaluation costs one round of
  concurrent remote work, not one scheduler round trip per stage.

Every call uses fresh task keys (``<name>-<task>-<call token>``): keys reused across calls
can return the previous call's results.

Nothing here holds a live ``Client`` across pickling or ``fork``: a function keeps the
scheduler's address and reconnects lazily in each process.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import dask
import dask.threaded
from dask.base import get_scheduler
from dask.task_spec import Task as DaskTask
from pytensor.compile.sharedvalue import SharedVariable

from dasktensor import _config
from dasktensor._plan import Plan
from dasktensor._translate import TaskGraph, _run

# ----------------------------------------------------------------------------- fork safety

_inherited_addresses: list[str] = []
_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def _after_fork_in_child() -> None:  # pragma: no cover - runs in forked children
    """Make Dask usable in a forked child (``pm.sample(cores=2)`` forks on Linux).

    Dask's threaded scheduler keeps module-level thread pools whose threads do not exist in
    the child: without a reset the child hangs on its first graph.  Distributed clients
    inherited from the parent have lost their event-loop thread: the child forgets them
    and reconnects to the same scheduler on first use.
    """
    global _clients_lock
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


def _is_client(obj) -> bool:
    return type(obj).__name__ == "Client" and hasattr(obj, "submit") and hasattr(obj, "gather")


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
        elif _is_client(scheduler):
            self.client = scheduler
            self.address = scheduler.scheduler.address
        elif isinstance(scheduler, str) and "://" in scheduler:
            self.address = scheduler
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
            client = self._default_client()
            if client is not None:
                address = client.scheduler.address
        return {"address": address, "get": self.get}

    def __setstate__(self, state):
        self.pid = os.getpid()
        self.client = None
        self.address = state["address"]
        self.get = state["get"]

    @staticmethod
    def _default_client():
        try:
            from distributed import default_client

            return default_client()
        except (ImportError, ValueError):
            return None

    def resolve(self):
        """Return ``("client", Client)`` or ``("get", scheduler_get_callable)``."""
        if self.client is not None and self.pid == os.getpid() and self.client.status == "running":
            return "client", self.client
        if self.address is not None:
            return "client", client_for_address(self.address)
        get = get_scheduler(scheduler=self.get)
        if get is not None and _is_client(getattr(get, "__self__", None)):
            return "client", get.__self__
        if get is None and _inherited_addresses:
            return "client", client_for_address(_inherited_addresses[-1])
        return "get", get or dask.threaded.get


# ----------------------------------------------------------------------------- execution


class PlanExecutor(TaskGraph):
    """Runs a :class:`Plan` on the scheduler its function was given (see module docstring)."""

    def __init__(self, plan: Plan, scheduler: SchedulerRef):
        super().__init__(plan)
        self.scheduler = scheduler
        self.shared_inputs = [
            i for i, v in enumerate(plan.fgraph.inputs) if isinstance(v, SharedVariable)
        ]
        # (client id, input position) -> (value, future of it on the cluster)
        self._resident: dict[tuple[int, int | None], tuple[Any, Any]] = {}

    # -- calls ----------------------------------------------------------------------------

    def __call__(self, *values):
        kind, scheduler = self.scheduler.resolve()
        if kind == "client":
            if any(t.role == "remote" for t in self.plan.tasks):
                return self._call_with_remote(scheduler, values)
            return self._call_distributed(scheduler, values)
        return self._call_local(scheduler, self.graph(values), values)

    def _call_local(self, get, graph: tuple[dict, list[str]], values):
        dsk, keys = graph
        needed = sorted({src[1] for src in self.output_sources if src[0] == "task"})
        kwargs = {}
        n_remote = sum(t.role == "remote" for t in self.plan.tasks)
        if n_remote and get is dask.threaded.get:
            # remote calls wait on the network, not on a core: one thread for each
            kwargs["num_workers"] = max(os.cpu_count() or 1, n_remote)
        got = get(dsk, [keys[i] for i in needed], **kwargs)
        results: list = [None] * len(keys)
        for i, r in zip(needed, got):
            results[i] = r
        return self._outputs(values, results)

    def _call_with_remote(self, client, values):
        """A plan with remote-model calls, on a distributed client.

        The calls are made from the caller, straight to the workers holding their models,
        so the plan runs on the caller's threaded scheduler; tasks that belong on the
        cluster (other heavy and costly work) are submitted from there, each one as its
        inputs are ready.
        """
        dsk, keys = self.graph(values)
        for t in self.plan.tasks:
            if t.role == "cluster":
                key = keys[t.index]
                body = dsk[key]
                dsk[key] = DaskTask(key, _on_cluster, client, key, dict(t.annotations), *body.args)
        return self._call_local(dask.threaded.get, (dsk, keys), values)

    def _call_distributed(self, client, values):
        tasks = self.plan.tasks
        token = uuid.uuid4().hex
        keys = self.keys(token)
        computed: list = [None] * len(tasks)  # outputs of tasks run on the caller
        futures: list = [None] * len(tasks)
        cluster = [t for t in tasks if t.role == "cluster"]
        _check_resources(client, [t.annotations for t in cluster])

        def run_here(role):
            for t in tasks:
                if t.role == role:
                    picks, deps = self._args(t.index, values, futures, computed)
                    computed[t.index] = _run(self.runners[t.index], picks, *deps)

        # 1. cheap stages feeding the cluster, on the caller
        run_here("before")
        # 2. cluster tasks, submitted at once (one batch of messages); large arrays go to
        #    the workers once, not once per task that reads them
        # the arguments of every cluster task, once; _Pending stands for a cluster task's
        # future, known only once that task is submitted
        pending = [_Pending(i) for i in range(len(tasks))]
        args = {t.index: self._args(t.index, values, pending, computed) for t in cluster}
        readers: dict[int, int] = {}  # id(literal) -> number of cluster tasks reading it
        literals = []
        for _, deps in args.values():
            for d in {id(d): d for d in deps if not isinstance(d, _Pending)}.values():
                readers[id(d)] = readers.get(id(d), 0) + 1
                literals.append(d)
        scattered = self._scatter_large(client, literals, values, readers)
        for t in cluster:
            picks, deps = args[t.index]
            deps = [
                futures[d.index] if isinstance(d, _Pending) else scattered.get(id(d), d)
                for d in deps
            ]
            ann = t.annotations
            futures[t.index] = client.submit(
                _run,
                self.runners[t.index],
                picks,
                *deps,
                key=keys[t.index],
                pure=False,
                resources=ann.get("resources"),
                retries=ann.get("retries"),
                priority=ann.get("priority", 0),
                workers=ann.get("workers"),
                allow_other_workers=ann.get("allow_other_workers", False),
            )
        # 3. caller stages independent of the cluster, while it works
        run_here("beside")
        # 4. gather what the caller needs, once
        wanted = {d for t in tasks if t.role == "after" for d in t.deps if futures[d] is not None}
        wanted.update(
            s[1] for s in self.output_sources if s[0] == "task" and futures[s[1]] is not None
        )
        wanted = sorted(wanted)
        if wanted:
            for i, value in zip(wanted, client.gather([futures[i] for i in wanted])):
                computed[i] = value
        # 5. cheap stages after the cluster work, on the caller
        run_here("after")
        return self._outputs(values, computed)

    def _scatter_large(self, client, deps: list, values: Sequence, readers: dict) -> dict:
        """Send arrays of 256 KiB or more to the workers once; returns ``{id: future}``.

        Embedded in the tasks, an array would travel through the scheduler once per task
        that reads it, on every call.  An array read by several tasks goes to every worker
        (otherwise the tasks would crowd on the worker that holds it); one read by a single
        task goes to one worker, spread round-robin, and its task follows it.

        Values of shared variables (weights, data) stay on the workers between calls for as
        long as the variable holds the same object: ``set_value`` and updates put a new
        object there, which is sent again.  (Arrays changed in place through
        ``get_value(borrow=True)`` are not seen, as PyTensor's borrow semantics allow.)
        """
        large = {}
        for d in deps:
            if getattr(d, "nbytes", 0) >= _SCATTER_BYTES and id(d) not in large:
                large[id(d)] = d
        if not large:
            return {}
        shared_pos = {id(values[i]): i for i in self.shared_inputs}
        out: dict = {}
        fresh: dict[bool, list[int]] = {True: [], False: []}  # broadcast? -> ids
        for key, value in large.items():
            cached = self._resident.get((id(client), shared_pos.get(key)))
            if cached is not None and cached[0] is value and cached[1].status == "finished":
                out[key] = cached[1]
            else:
                fresh[readers.get(key, 1) > 1].append(key)
        for broadcast, keys in fresh.items():
            if not keys:
                continue
            futures = client.scatter([large[k] for k in keys], hash=False, broadcast=broadcast)
            for key, future in zip(keys, futures):
                out[key] = future
                if key in shared_pos:
                    self._resident[(id(client), shared_pos[key])] = (large[key], future)
        return out


_SCATTER_BYTES = 1 << 18


def _on_cluster(client, key: str, annotations: dict, runner, picks, *deps):
    """Task body on the caller: run a task on the cluster and wait for its result."""
    return client.submit(
        _run,
        runner,
        picks,
        *deps,
        key=key,
        pure=False,
        resources=annotations.get("resources"),
        retries=annotations.get("retries"),
        priority=annotations.get("priority", 0),
        workers=annotations.get("workers"),
        allow_other_workers=annotations.get("allow_other_workers", False),
    ).result()


class _Pending:
    """Placeholder for the future of cluster task ``index`` while arguments are built."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


# ----------------------------------------------------------------------------- resources


class NoWorkerWithResourcesError(RuntimeError):
    """No worker of the cluster offers the resources that a task asks for."""


_resources_seen: dict[tuple[int, str], tuple[float, list[dict]]] = {}
_RESOURCE_CACHE_SECONDS = 2.0


def _worker_resources(client, refresh: bool = False) -> list[dict]:
    key = (id(client), client.scheduler.address)
    now = time.monotonic()
    cached = _resources_seen.get(key)
    if cached is not None and not refresh and now - cached[0] < _RESOURCE_CACHE_SECONDS:
        return cached[1]
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # distributed before n_workers=
        info = client.scheduler_info()
    found = [dict(w.get("resources") or {}) for w in info.get("workers", {}).values()]
    _resources_seen[key] = (now, found)
    return found


def _check_resources(client, annotations: Sequence[dict]) -> None:
    """Fail with a clear error when no worker offers a task's resources (after a timeout).

    A task whose resources no worker offers would otherwise wait forever.
    """
    wanted = [a["resources"] for a in annotations if a.get("resources")]
    if not wanted:
        return

    def missing(workers):
        return [
            r
            for r in wanted
            if not any(all(w.get(k, 0) >= v for k, v in r.items()) for w in workers)
        ]

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
