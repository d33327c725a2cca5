"""One model object on one worker, and how many calls it runs at once.

Calls arrive on the threads of the worker's call server (one per caller connection,
:mod:`dasktensor_worker.wire`) and run the model right there: handing a call to another
thread and back cost about 0.2 ms, most of a fast model's round trip.  A semaphore lets
``concurrency`` calls run at once (1 by default, so that the model needs not be
thread-safe: its calls run one after the other, though not always on the same thread).
The worker's event loop never runs a model, so it keeps answering the scheduler,
heartbeats and the dashboard while models work.

A method marked ``@batched`` (:mod:`dasktensor_worker.batching`) is called through a
:class:`~dasktensor_worker.batching.Batcher` of its own: the calls that wait for it run
together, stacked, as one call of the method.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from dasktensor_worker.batching import Batcher, options_of


class Replica:
    """A model built by ``factory()`` on this worker.

    Parameters
    ----------
    model : object
        What the factory returned.
    concurrency : int
        Calls run at once.
    name : str
        The model's name (the call log's and the dashboard's).
    record : callable, optional
        ``record(method, start, stop, size, status)`` after each batch of a batched
        method (the call log).

    Examples
    --------
    >>> replica = Replica({"scale": 2.0}, concurrency=1, name="demo")
    >>> replica.invoke("get", ("scale",))
    2.0
    """

    def __init__(self, model, concurrency: int, name: str, record: Callable | None = None):
        self.model = model
        self.record = record
        #: method name -> its Batcher, or None for a method that is not batched
        self.batchers: dict[str | None, Batcher | None] = {}
        self.batchers_lock = threading.Lock()
        self.name = name
        self.concurrency = concurrency
        # (a plain lock for one slot: a semaphore is Python code, a lock a C call)
        self.slots = (
            threading.Lock() if concurrency == 1 else threading.BoundedSemaphore(concurrency)
        )
        #: set once the worker drops the replica (released, lease gone, plugin removed):
        #: ends the task that holds the model's resources (``tasks.hold_resources``)
        self.released = threading.Event()

    def invoke(self, method: str | None, args: Sequence):
        """``model.<method>(*args)`` (``method=None``: the model itself), in this thread,
        once one of the ``concurrency`` slots is free; a batched method's call as part of
        the next batch."""
        batcher = self.batcher(method)
        if batcher is not None:
            return batcher.call(args)
        target = self.model if method is None else getattr(self.model, method)
        with self.slots:
            return target(*args)

    def batcher(self, method: str | None) -> Batcher | None:
        """The :class:`Batcher` of a batched method (made on its first call), else None."""
        try:
            return self.batchers[method]
        except KeyError:
            pass
        with self.batchers_lock:
            if method not in self.batchers:
                target = self.model if method is None else getattr(self.model, method)
                options = options_of(target)
                record = None
                if options is not None and self.record is not None:
                    label, log = method or "__call__", self.record

                    def record(start, stop, size, status):
                        log(label, start, stop, size, status)

                self.batchers[method] = (
                    None
                    if options is None
                    else Batcher(target, options, self.slots, self.concurrency, record)
                )
            return self.batchers[method]
