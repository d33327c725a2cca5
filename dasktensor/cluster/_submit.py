"""Submitting work to the cluster: the one place a task goes there, placed.

:func:`submit` turns a task's :class:`~dasktensor._placement.Placement` into
``client.submit`` keywords; :func:`carrying` lets a task carry data on purpose without
Dask's large-graph warning; :func:`task_slot_released` lets a task wait for other Dask
work without holding its worker's thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import dask
from dask.utils import parse_bytes

from dasktensor._placement import Placement
from dasktensor._runtime import ProcessState, runtime


def submit(client, fn: Callable, *args, key: str, placement: Placement | None = None):
    """Submit ``fn(*args)`` as the task ``key``, placed as ``placement`` says; a Future.

    Tasks are never pure (each call has fresh keys, see ``dasktensor.engine._translate``).
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
    carried = runtime.state(_Carried)
    with carried.lock:
        if carried.count == 0:
            carried.saved = dask.config.get(key)
        carried.count += 1
        wanted = 2 * nbytes + 2**20
        if parse_bytes(dask.config.get(key)) < wanted:
            dask.config.set({key: wanted})
    try:
        yield
    finally:
        with carried.lock:
            carried.count -= 1
            if carried.count == 0:
                dask.config.set({key: carried.saved})


class _Carried(ProcessState):
    """How many submissions carry data now, and the threshold they raised."""

    def __init__(self):
        self.count = 0
        self.saved = None
        self.lock = runtime.lock()


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


@contextlib.contextmanager
def holding(lock):
    """``with lock``, except that a thread running a Dask task that has to wait for the
    lock leaves its worker's thread pool while it waits (:func:`task_slot_released`).

    The holder may be another task of the same worker process that left its slot to
    wait for builds and needs a slot back to go on (``rejoin`` waits for one): a task
    blocked on the lock in the only slot would wait for it for ever.  Uncontended, it
    costs what ``with lock`` does.

    Examples
    --------
    >>> import threading
    >>> lock = threading.Lock()
    >>> with holding(lock):  # outside a task: as ``with lock``
    ...     lock.locked()
    True
    >>> lock.locked()
    False
    """
    if not lock.acquire(blocking=False):
        with task_slot_released():
            lock.acquire()
    try:
        yield
    finally:
        lock.release()
