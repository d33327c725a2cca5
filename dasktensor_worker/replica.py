"""One model object on one worker, and how many calls it runs at once.

Calls arrive on the threads of the worker's call server (one per caller connection,
:mod:`dasktensor_worker.wire`) and run the model right there: handing a call to another
thread and back cost about 0.2 ms, most of a fast model's round trip.  A semaphore lets
``concurrency`` calls run at once (1 by default, so that the model needs not be
thread-safe: its calls run one after the other, though not always on the same thread).
The worker's event loop never runs a model, so it keeps answering the scheduler,
heartbeats and the dashboard while models work.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


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

    Examples
    --------
    >>> replica = Replica({"scale": 2.0}, concurrency=1, name="demo")
    >>> replica.invoke("get", ("scale",))
    2.0
    """

    def __init__(self, model, concurrency: int, name: str):
        self.model = model
        self.name = name
        self.concurrency = concurrency
        self.slots = threading.BoundedSemaphore(concurrency)
        #: set once the worker drops the replica (released, lease gone, plugin removed):
        #: ends the task that holds the model's resources (``tasks.hold_resources``)
        self.released = threading.Event()

    def invoke(self, method: str | None, args: Sequence):
        """``model.<method>(*args)`` (``method=None``: the model itself), in this thread,
        once one of the ``concurrency`` slots is free."""
        target = self.model if method is None else getattr(self.model, method)
        with self.slots:
            return target(*args)
