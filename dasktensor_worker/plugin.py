"""``ModelHost``: the worker plugin that holds a worker's model replicas and answers calls.

A remote call skips the scheduler and Dask's comms: the caller writes one request to the
worker's call server (:mod:`dasktensor_worker.wire`, a socket this plugin listens on) and
reads one reply, tens of microseconds on loopback against ~13 ms for
``client.submit(...).result()``.  Dask stays the control plane: build tasks place the
replicas, ``client.run`` finds them and the server's address (:func:`endpoint`), the
scheduler reports lost workers.

* **Installed by the first build.**  The build task of a model
  (:func:`dasktensor_worker.tasks.build_replica`) adds a ``ModelHost`` to its worker with
  the worker's own API (``worker.plugin_add``, run on the worker's event loop) unless the
  worker has one already; so a bare ``dask worker`` needs no preload nor registration.
  ``client.register_plugin(ModelHost())`` installs it on every worker, present and future,
  ahead of any build (it is idempotent by name for the scheduler).  A worker has one
  ``ModelHost``, under ``worker.plugins["dasktensor-models"]``.
* **Set up**, it starts the call server on the worker's host (TLS on a ``tls://`` worker,
  with the worker's own credentials) and installs the call log's handler
  (``dasktensor_call_log``, for the dashboard's calls page).
* **Torn down** by ``client.unregister_worker_plugin("dasktensor-models")`` (if it was
  registered that way), ``worker.plugin_remove("dasktensor-models")``, or the worker's
  closing: the server stops, its connections close and the replicas are dropped.
  Callers find out on their next call (the connection fails, or the reply says the
  replica is missing) and build the model again.  So does
  ``client.register_plugin(ModelHost())`` on a worker whose host a build task added (the
  scheduler did not know it): ``worker.plugin_add`` replaces a plugin of the same name.
* **Leases.**  A replica built with a ``lease`` (the key of a task its creator's client
  keeps wanted) is dropped once the scheduler has forgotten that task: every
  ``dasktensor.remote.lease-check`` (1 s; the worker's Dask config) the host asks the
  scheduler for its leases' states (``get_task_status``), only while it holds replicas
  with leases.  A lease the scheduler cannot be asked about keeps its replicas.  A model
  shared by several processes (one key, each with its lease) has a lease per process,
  and lives until the last is gone (forgotten, or given back with :meth:`unlease`).
* **One build per model and worker.**  Build tasks of one model may run at once in
  several threads of a worker; a lock makes ``factory()`` run once.
* **The model's own errors** are caught and sent back (the pickled exception and
  traceback), which the caller raises again with the remote traceback; any other
  failure of a request is therefore a channel failure.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence

import dask.config
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import sync
from tornado.ioloop import PeriodicCallback

from dasktensor_worker.calllog import LOG_HANDLER, CallLog
from dasktensor_worker.devices import this_device
from dasktensor_worker.replica import Replica
from dasktensor_worker.wire import WireServer, error_reply

#: the name under which ``ModelHost`` sits in ``worker.plugins``
PLUGIN_NAME = "dasktensor-models"


class ModelHost(WorkerPlugin):
    """The replicas one worker holds, by model key, and the call server serving them.

    Examples
    --------
    Registered from a client, on every worker (the build task would add it anyway):

    >>> import distributed
    >>> from dasktensor_worker import ModelHost
    >>> def has_host(dask_worker):
    ...     return "dasktensor-models" in dask_worker.plugins
    >>> local = dict(processes=False, n_workers=1, dashboard_address="127.0.0.1:0")
    >>> with distributed.Client(**local) as c:
    ...     _ = c.register_plugin(ModelHost())
    ...     c.run(has_host)  # doctest: +ELLIPSIS
    {'inproc://...': True}
    """

    name = PLUGIN_NAME
    idempotent = True  # client.register_plugin: a scheduler that has one keeps it

    def __init__(self):
        self.replicas: dict[str, Replica] = {}
        self.builds: dict[str, int] = {}  # how many times each model was built here
        self.leases: dict[str, set[str]] = {}  # model key -> the leases keeping it
        self._lease_check: PeriodicCallback | None = None
        self.lock = threading.Lock()
        self.closed = False
        self.server: WireServer | None = None
        #: the calls this worker answered, for the dashboard (``dasktensor_worker.calllog``)
        self.calls = CallLog()
        #: what this worker runs on, ``"GPU 0 (NAME)"`` or ``"cpu"``
        #: (``dasktensor_worker.devices``): found by the first build, off the event loop
        #: (nvidia-smi takes tens of milliseconds), and sent with the call log
        self.device: str | None = None

    def __reduce__(self):  # travels (to register_plugin's workers) as a new, empty host
        return (type(self), ())

    # -- the plugin's life ------------------------------------------------------------

    def setup(self, worker) -> None:
        worker.handlers[LOG_HANDLER] = self.call_log
        address = getattr(worker, "address", None) or "inproc://"
        context = None
        if address.startswith("tls://"):
            context = worker.security.get_listen_args("worker")["ssl_context"]
        busy_poll = parse_timedelta(dask.config.get("dasktensor.remote.busy-poll", "200us"))
        self.server = WireServer(
            _listen_host(address),
            self.answer,
            context,
            busy_poll=busy_poll,
            answer_many=self.answer_many,
        )
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called outside a worker's event loop: no lease checks
            return
        every = dask.config.get("dasktensor.remote.lease-check", "1s")
        self._lease_check = PeriodicCallback(
            lambda: self.check_leases(worker), parse_timedelta(every) * 1000
        )
        self._lease_check.start()  # on the worker's event loop (setup runs there)

    def teardown(self, worker) -> None:
        if self._lease_check is not None:
            self._lease_check.stop()
        if worker.handlers.get(LOG_HANDLER) == self.call_log:
            del worker.handlers[LOG_HANDLER]
        self.closed = True
        if self.server is not None:
            self.server.close()
        # swapped, not locked: a build holding the lock may run a slow factory, and this
        # runs on the worker's event loop
        dropped, self.replicas = self.replicas, {}
        for replica in dropped.values():
            replica.released.set()

    @property
    def endpoint(self) -> tuple[str, int, bool] | None:
        """Where the call server listens: ``(host, port, tls)`` (None before setup)."""
        if self.server is None or self.closed:
            return None
        return (*self.server.address, self.server.tls)

    # -- replicas ---------------------------------------------------------------------

    def build(
        self,
        key: str,
        name: str,
        factory: Callable,
        concurrency: int,
        lease: str | None = None,
        scalable: bool = True,
    ) -> bool:
        """Build model ``key`` with ``factory()`` unless this worker holds it already;
        keep it while task ``lease`` exists (None: until released).  ``scalable``: the
        model has a replica on every worker that can hold one.  Whether this call built
        it."""
        if self.device is None:  # (once a worker: the build task's thread, not a call's)
            self.device = this_device()
        with self.lock:  # one build per key, however many tasks ask at once
            if key in self.replicas:
                if lease is not None:  # a creator's build, after another process's
                    self.leases.setdefault(key, set()).add(lease)
                return False
            model = factory()
            if self.closed:
                raise RuntimeError(
                    f"the {PLUGIN_NAME!r} plugin was removed from this worker while "
                    f"{name!r} was being built; expected it to stay installed, call again "
                    "to build the model on a worker that has it"
                )
            replica = Replica(model, concurrency, name, self._batch_recorder(name))
            replica.scalable = scalable
            self.replicas[key] = replica
            self.builds[key] = self.builds.get(key, 0) + 1
            if lease is not None:
                self.leases.setdefault(key, set()).add(lease)
            return True

    def release(self, key: str) -> bool:
        """Drop model ``key`` from this worker; whether it was held (a call running goes
        on to its end)."""
        self.leases.pop(key, None)
        replica = self.replicas.pop(key, None)
        if replica is None:
            return False
        replica.released.set()
        return True

    def add_lease(self, key: str, lease: str) -> bool:
        """``lease`` keeps model ``key`` too (another process sharing it); whether this
        worker holds the model."""
        with self.lock:
            if key not in self.replicas:
                return False
            self.leases.setdefault(key, set()).add(lease)
            return True

    def unlease(self, key: str, lease: str) -> bool:
        """A holder of model ``key`` gives its ``lease`` back: the replica is dropped if
        no lease is left; whether it was."""
        leases = self.leases.get(key)
        if not leases or lease not in leases:
            return False
        leases.discard(lease)
        return not leases and self.release(key)

    async def check_leases(self, worker) -> None:
        """Drop the replicas whose leases the scheduler has all forgotten (their creators
        let go of the model, or went away)."""
        held = {k: set(ls) for k, ls in list(self.leases.items()) if k in self.replicas and ls}
        if not held:
            return
        every = sorted(set().union(*held.values()))
        try:
            states = await worker.scheduler.get_task_status(keys=every)
        except Exception:  # the scheduler cannot say now: keep everything, ask again
            return
        for key, leases in held.items():
            for lease in leases:
                if lease in states and states[lease] is None:
                    self.unlease(key, lease)

    def answer(self, key: str, method: str | None, args: Sequence) -> tuple:
        """Run one call (on the server's thread): ``("OK", result)``, ``("missing", None)``
        (no such replica here) or ``("error", message)``.  The reply to a call of a
        batched method says so, ``("OK", result, "batched")``: its callers may then send
        their concurrent calls of it in one message (:meth:`answer_many`)."""
        replica = self.replicas.get(key)
        if replica is None:
            return ("missing", None)
        start, status = self.calls.started(replica.name), "error"
        try:
            result = replica.invoke(method, args)
            status = "OK"
        except Exception as e:  # the model's own error: sent to the caller, not raised here
            return error_reply(e)
        finally:  # a batched call is recorded with its batch
            alone = replica.batchers.get(method) is None
            self.calls.finished(replica.name, method, start, status, record=alone)
        return ("OK", result) if alone else ("OK", result, "batched")

    def answer_many(self, key: str, method: str | None, calls: Sequence[Sequence]) -> tuple:
        """Run the calls of one message, ``model.<method>(*args)`` for each ``args`` of
        ``calls`` (a caller process's threads' concurrent calls of a batched method):
        ``("many", [reply, ...])``, one reply per call as :meth:`answer` gives them, or
        ``("missing", None)``.  A batched method's calls join its batches at once, with
        the calls of other connections; others run one after another."""
        replica = self.replicas.get(key)
        if replica is None:
            return ("missing", None)
        try:
            batcher = replica.batcher(method)
        except Exception as e:  # no such method: every call's error
            return ("many", [error_reply(e)] * len(calls))
        if batcher is None:
            return ("many", [self.answer(key, method, args) for args in calls])
        self.calls.started(replica.name, len(calls))
        try:
            done = batcher.call_many(calls)
        finally:  # (the batches are recorded by the batcher)
            self.calls.finished(replica.name, method, 0.0, "OK", record=False, n=len(calls))
        return ("many", [_outcome(c) for c in done])

    async def call_log(self, since: float = 0.0) -> dict:
        """The ``dasktensor_call_log`` handler: the call log since ``since`` (see
        :meth:`CallLog.since`), the models held here: ``{name: {"replicas": n,
        "concurrency": c, "scalable": bool}}`` (what the dashboard, the metrics and
        ``dt.Adaptive`` read), and the ``device`` the replicas run on (``"GPU 0
        (NAME)"``, ``"cpu"``; None before the first build)."""
        found = self.calls.since(float(since))
        models: dict = {}
        for replica in list(self.replicas.values()):
            info = models.setdefault(
                replica.name, {"replicas": 0, "concurrency": 0, "scalable": False}
            )
            info["replicas"] += 1
            info["concurrency"] += replica.concurrency
            info["scalable"] = info["scalable"] or getattr(replica, "scalable", True)
        found["models"] = models
        found["device"] = self.device
        return found

    def _batch_recorder(self, name: str):
        def record(method, start, stop, size, status):
            self.calls.batch(name, method, start, stop, size, status)

        return record


class CallLogHandler(WorkerPlugin):
    """Answer the ``dasktensor_call_log`` handler on every worker, with an empty log
    where no model was ever built (the worker's :class:`ModelHost` answers it once it
    has one): the scheduler's channel monitor asks every worker once a second, and a
    worker without the handler would log a warning each time.  The monitor registers
    it for all workers, present and future."""

    name = "dasktensor-call-log"
    idempotent = True

    def setup(self, worker) -> None:
        worker.handlers.setdefault(LOG_HANDLER, _empty_call_log)


async def _empty_call_log(since: float = 0.0) -> dict:
    return {**CallLog().since(float(since)), "models": {}}


def _outcome(call) -> tuple:
    """The reply to one call of a batch (``batching._Call``); its error raised here, so
    that the reply carries its traceback (``error_reply`` reads the one being handled)."""
    try:
        return ("OK", call.outcome())
    except Exception as e:
        return error_reply(e)


def _listen_host(address: str) -> str:
    """The host a worker at ``address`` listens on (loopback for in-process workers)."""
    if address.startswith("inproc://"):
        return "127.0.0.1"
    from distributed.comm import get_address_host

    return get_address_host(address)


def host_of(worker) -> ModelHost | None:
    """The worker's :class:`ModelHost`, or None if it has none (yet)."""
    plugin = getattr(worker, "plugins", {}).get(PLUGIN_NAME)
    return plugin if isinstance(plugin, ModelHost) else None


_install_lock = threading.Lock()


def ensure_host(worker) -> ModelHost:
    """The worker's :class:`ModelHost`, added first if it has none.

    Run from a task's thread: the plugin is added by ``worker.plugin_add`` on the
    worker's event loop, which this thread waits for.
    """
    with _install_lock:  # build tasks may run in several threads of one worker
        host = host_of(worker)
        if host is None:
            host = ModelHost()
            sync(worker.loop, worker.plugin_add, plugin=host, name=PLUGIN_NAME, catch_errors=False)
        return host


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _install_lock
    _install_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
