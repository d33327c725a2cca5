"""Which Client a call uses: :class:`SchedulerRef`, and one Client per process and address.

A compiled function keeps its choice of scheduler (a Client, an address, a local
scheduler, or Dask's own resolution at call time) in a form that pickles: a Client
pickles as its address and each process reconnects lazily (:func:`client_for_address`).
A forked child (``pm.sample(cores=2)`` on Linux) forgets the Clients of its parent
(:mod:`dasktensor._runtime`) and reconnects to the same schedulers on first use.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import dask
import dask.threaded
from dask.base import get_scheduler, named_schedulers

from dasktensor import _config
from dasktensor._runtime import ProcessState, runtime


class _Clients(ProcessState):
    """The Clients this process connected, by scheduler address."""

    def __init__(self):
        self.clients: dict[str, Any] = {}
        self.lock = runtime.lock()


def client_for_address(address: str, timeout: float | None = None):
    """This process's own Client to ``address`` (one per process, created on first use)."""
    from distributed import Client

    state = runtime.state(_Clients)
    with state.lock:
        client = state.clients.get(address)
        if client is None or client.status not in ("running", "connecting", "newly-created"):
            if timeout is None:
                timeout = _config.seconds("connect-timeout")
            client = Client(address, set_as_default=False, timeout=timeout)
            state.clients[address] = client
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
            state = runtime.state(_Clients)
            with state.lock:
                client = state.clients.get(self.address)
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
        if get is None and runtime.inherited_schedulers:
            # a forked child: its parent's default client, connected again here
            return "client", client_for_address(runtime.inherited_schedulers[-1])
        return "get", get or dask.threaded.get

    def closed_client(self) -> str | None:
        """The scheduler address of the client this reference last resolved to, if that
        client is closed now (by the program, or after losing its scheduler)."""
        ref, address = getattr(self, "last", (lambda: None, None))
        client = ref()
        if client is None or client.status == "running":
            return None
        return address
