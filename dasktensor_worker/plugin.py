"""``ModelHost``: the worker plugin that holds a worker's model replicas and answers calls.

A remote call skips the scheduler: the caller sends one request (``dasktensor_call``) to
the worker and waits for one reply, about 1 ms on a local network against ~13 ms for
``client.submit(...).result()``.  The worker answers through a handler in
``worker.handlers``, which this plugin installs when it is set up and removes when it is
torn down:

* **Installed by the first build.**  The build task of a model
  (:func:`dasktensor_worker.tasks.build_replica`) adds a ``ModelHost`` to its worker with
  the worker's own API (``worker.plugin_add``, run on the worker's event loop) unless the
  worker has one already; so a bare ``dask worker`` needs no preload nor registration.
  ``client.register_plugin(ModelHost())`` installs it on every worker, present and future,
  ahead of any build (it is idempotent by name for the scheduler).  A worker has one
  ``ModelHost``, under ``worker.plugins["dasktensor-models"]``.
* **Torn down** by ``client.unregister_worker_plugin("dasktensor-models")`` (if it was
  registered that way), ``worker.plugin_remove("dasktensor-models")``, or the worker's
  closing: the handler goes, the replicas are dropped and their threads told to stop.
  Callers find out on their next call (the reply is not a result) and build the model
  again.  So does ``client.register_plugin(ModelHost())`` on a worker whose host a
  build task added (the scheduler did not know it): ``worker.plugin_add`` replaces a
  plugin of the same name, dropping its replicas.
* **One build per model and worker.**  Build tasks of one model may run at once in
  several threads of a worker; a lock makes ``factory()`` run once.
* **The model's own errors** are caught and sent back as ``error_message`` (the pickled
  exception and traceback), which the caller raises again with the remote traceback; any
  other failure of a request is therefore a channel failure.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from distributed.core import error_message
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import sync

from dasktensor_worker.calllog import LOG_HANDLER, CallLog
from dasktensor_worker.codec import CALL_HANDLER
from dasktensor_worker.replica import Replica

#: the name under which ``ModelHost`` sits in ``worker.plugins``
PLUGIN_NAME = "dasktensor-models"


class ModelHost(WorkerPlugin):
    """The replicas one worker holds, by model key, and the call handler serving them.

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
        self.lock = threading.Lock()
        self.closed = False
        #: the calls this worker answered, for the dashboard (``dasktensor_worker.calllog``)
        self.calls = CallLog()

    def __reduce__(self):  # travels (to register_plugin's workers) as a new, empty host
        return (type(self), ())

    # -- the plugin's life ------------------------------------------------------------

    def setup(self, worker) -> None:
        worker.handlers[CALL_HANDLER] = self.handle_call
        worker.handlers[LOG_HANDLER] = self.calls.handle

    def teardown(self, worker) -> None:
        for name, handler in ((CALL_HANDLER, self.handle_call), (LOG_HANDLER, self.calls.handle)):
            if worker.handlers.get(name) == handler:
                del worker.handlers[name]
        self.closed = True
        # swapped, not locked: a build holding the lock may run a slow factory, and this
        # runs on the worker's event loop
        replicas, self.replicas = self.replicas, {}
        for replica in replicas.values():
            replica.close()

    # -- replicas ---------------------------------------------------------------------

    def build(
        self, key: str, name: str, factory: Callable, concurrency: int, inline_below: float
    ) -> None:
        """Build model ``key`` with ``factory()`` unless this worker holds it already."""
        with self.lock:  # one build per key, however many tasks ask at once
            if key in self.replicas:
                return
            model = factory()
            if self.closed:
                raise RuntimeError(
                    f"the {PLUGIN_NAME!r} plugin was removed from this worker while "
                    f"{name!r} was being built; expected it to stay installed, call again "
                    "to build the model on a worker that has it"
                )
            self.replicas[key] = Replica(model, concurrency, name, inline_below)
            self.builds[key] = self.builds.get(key, 0) + 1

    def release(self, key: str) -> bool:
        """Drop model ``key`` from this worker; whether it was held."""
        replica = self.replicas.pop(key, None)
        if replica is not None:
            replica.close()
        return replica is not None

    async def handle_call(self, key: str, method: str | None, args: Sequence) -> dict:
        """The ``dasktensor_call`` handler: ``{"status": "OK", "result": ...}``,
        ``{"status": "missing"}`` (no such replica here) or an error message."""
        replica = self.replicas.get(key)
        if replica is None:
            return {"status": "missing"}
        start, status = self.calls.started(replica.name), "error"
        try:
            result = await replica.run(method, args)
            status = "OK"
        except Exception as e:  # the model's own error: sent to the caller, not raised here
            return error_message(e)
        finally:
            self.calls.finished(replica.name, method, start, status)
        return {"status": "OK", "result": result}


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
            sync(
                worker.loop, worker.plugin_add, plugin=host, name=PLUGIN_NAME, catch_errors=False
            )
        return host


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _install_lock
    _install_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
