"""Per-process state: everything dasktensor keeps per process, and its one fork hook.

dasktensor keeps state in each process: the Clients it connected, the remote-call
channel's pooled connections, each model's replicas and the calls in flight at them, the
leases and resource holders of the models this process owns, the runners compiled for
resident stages, the step methods of ``dt.sample`` runs on a worker, the thread pool of
concurrent local calls, and the locks guarding them.  It all lives in :data:`runtime`.

``pm.sample(cores=N)`` forks on Linux.  A forked child inherits a copy of the parent's
memory but none of its threads, so in the child

* a lock that another thread held at fork time stays locked for ever;
* a pooled socket, a lease or a resource holder is still the parent's: using one there
  mixes two processes' messages on one connection, and dropping one (a finalizer
  closing a socket, a future released through the event loop's pipe the two processes
  share) acts on the parent's behalf;
* a thread pool has no threads, and Dask's threaded scheduler hangs on its first graph.

Hence one rule, applied by one hook (:func:`_after_fork_in_child`): **a forked child starts
from nothing.**

* Each component keeps its state in a class of its own (a :class:`ProcessState`), and
  gets this process's instance with ``runtime.state(TheClass)``, made on first use.  The
  hook forgets every instance; the child makes new ones when it needs them.  The
  parent's instances are kept alive, untouched, for the child's lifetime, so that no
  finalizer of theirs runs there.
* Locks come from :meth:`Runtime.lock` (or :meth:`Runtime.rlock`): a lock that is new in
  every process, wherever it is kept (a compiled function's runner keeps one, and the
  function outlives the fork).
* Dask's own per-process state that a fork breaks is reset by the same hook: the
  threaded scheduler's pools, and distributed's default clients (whose schedulers the
  child reconnects to on first use, :attr:`Runtime.inherited_schedulers`).

A new component that keeps its state this way cannot forget the fork; ``tests/
test_structure.py`` refuses module-level locks and fork hooks anywhere else.  (The worker
side, ``dasktensor_worker``, imports nothing of dasktensor and keeps its one lock the same
way with a hook of its own.)

Examples
--------
>>> class Counter(ProcessState):
...     def __init__(self):
...         self.calls = 0
...         self.lock = runtime.lock()
>>> counter = runtime.state(Counter)
>>> with counter.lock:
...     counter.calls += 1
>>> runtime.state(Counter).calls
1
"""

from __future__ import annotations

import os
import threading
from typing import TypeVar

__all__ = ["ProcessLock", "ProcessState", "Runtime", "runtime"]

S = TypeVar("S", bound="ProcessState")


class ProcessState:
    """Base of a component's per-process state.

    A subclass sets its fields (dicts, locks from :meth:`Runtime.lock`, ...) in an
    ``__init__`` taking no argument; ``runtime.state(Subclass)`` gives this process's
    instance.  A forked child gets a new one.
    """


class ProcessLock:
    """A lock, or a reentrant lock, that is new in every forked child.

    Use it where a ``threading.Lock`` would be kept in an object that outlives a fork (a
    compiled function's parts).  It checks the runtime's fork count when taken: a child
    replaces the lock it inherited (possibly held, by a thread that does not exist there)
    by a new one on first use.

    >>> lock = ProcessLock()
    >>> with lock:
    ...     lock.locked()
    True
    """

    __slots__ = ("_factory", "_generation", "_lock")

    def __init__(self, reentrant: bool = False):
        self._factory = threading.RLock if reentrant else threading.Lock
        self._lock = self._factory()
        self._generation = runtime.generation

    def _current(self):
        if self._generation != runtime.generation:
            with runtime._lock:  # two of the child's threads may be first at once
                if self._generation != runtime.generation:
                    self._lock = self._factory()
                    self._generation = runtime.generation
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._current().acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        lock = self._current()
        if hasattr(lock, "locked"):
            return lock.locked()
        # an RLock before Python 3.14 cannot say: it is locked if another thread cannot take it
        if lock.acquire(blocking=False):
            lock.release()
            return False
        return True

    def __enter__(self):
        return self._current().__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


class Runtime:
    """This process's dasktensor state (see the module docstring); one instance,
    :data:`runtime`."""

    def __init__(self):
        #: how many forks this process descends from (0 in a process that was not forked)
        self.generation = 0
        #: scheduler addresses of the Clients a forked child inherited, oldest first: the
        #: child reconnects to them on first use
        self.inherited_schedulers: list[str] = []
        self._states: dict[type, ProcessState] = {}
        self._parents: list[dict[type, ProcessState]] = []  # kept alive, never touched
        self._lock = threading.Lock()

    def state(self, cls: type[S]) -> S:
        """This process's instance of the component state ``cls``, made on first use."""
        try:
            return self._states[cls]  # type: ignore[return-value]
        except KeyError:
            with self._lock:
                if cls not in self._states:
                    self._states[cls] = cls()
                return self._states[cls]  # type: ignore[return-value]

    def lock(self) -> ProcessLock:
        """A lock that a forked child gets new (see :class:`ProcessLock`)."""
        return ProcessLock()

    def rlock(self) -> ProcessLock:
        """A reentrant lock that a forked child gets new."""
        return ProcessLock(reentrant=True)

    def __repr__(self) -> str:
        names = sorted(cls.__qualname__ for cls in self._states)
        return (
            f"<dasktensor runtime of process {os.getpid()}: fork generation "
            f"{self.generation}, state of {', '.join(names) or 'nothing yet'}>"
        )


runtime = Runtime()


def _reset_dask_after_fork() -> None:
    """Dask's per-process state a fork breaks: the threaded scheduler's pools (their
    threads are not in the child: its first graph would hang), and distributed's default
    clients (the parent's connections), whose schedulers the child reconnects to."""
    import dask
    import dask.threaded

    dask.threaded.default_pool = None
    dask.threaded.pools.clear()
    dask.threaded.pools_lock = threading.Lock()
    try:
        from distributed import client as dclient
    except ImportError:  # pragma: no cover - distributed is a dependency
        return
    inherited = [*dclient._global_clients.values(), dclient._current_client.get()]
    for client in inherited:
        address = getattr(getattr(client, "scheduler", None), "address", None)
        if address and address not in runtime.inherited_schedulers:
            runtime.inherited_schedulers.append(address)
    dclient._global_clients.clear()
    dclient._current_client.set(None)
    if dask.config.get("scheduler", None) in ("dask.distributed", "distributed"):
        # set by the parent's default client; it would make Dask look for that client
        dask.config.config.pop("scheduler", None)


def _after_fork_in_child() -> None:  # pragma: no cover - runs in forked children
    """The one fork hook: the child starts from nothing (see the module docstring)."""
    runtime._lock = threading.Lock()
    runtime._parents.append(runtime._states)
    runtime._states = {}
    runtime.generation += 1
    _reset_dask_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
