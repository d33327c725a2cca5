"""One model object on one worker, and the thread(s) its calls run on.

A call normally runs on the replica's own thread(s) (``concurrency`` of them, 1 by default
so that the model needs not be thread-safe), so that the worker's event loop keeps
answering the scheduler, heartbeats and other calls while the model works.

Handing a call to a thread and back costs about 0.2 ms, which is most of a round trip for
a fast model.  So while the replica's calls take less than ``inline_below`` seconds (the
caller's ``dasktensor.remote.inline-below``, 1 ms by default) and none is running, a call
runs on the event loop directly; one call that takes longer sends the next ones back to
the thread.  With ``concurrency > 1`` calls always go to the threads (running them inline
would serialise them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence

from dasktensor_worker.codec import pack, unpack


class Replica:
    """A model built by ``factory()`` on this worker, with its own thread pool.

    Parameters
    ----------
    model : object
        What the factory returned.
    concurrency : int
        Calls run at once (threads of the replica's pool).
    name : str
        The model's name, for the threads' names.
    inline_below : float
        Calls faster than this many seconds run on the event loop (see the module
        docstring); 0 never does.

    Examples
    --------
    >>> import asyncio, numpy as np
    >>> from dasktensor_worker.codec import pack, unpack
    >>> replica = Replica({"scale": 2.0}, concurrency=1, name="demo", inline_below=0.0)
    >>> unpack(asyncio.run(replica.run("get", pack(["scale"]))))
    2.0
    >>> replica.close()
    """

    def __init__(self, model, concurrency: int, name: str, inline_below: float):
        self.model = model
        self.name = name
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix=f"dasktensor-{name}"
        )
        self.inline_below = float(inline_below) if concurrency == 1 else 0.0
        self.recent = float("inf")  # duration of the last call, in seconds
        self.running = 0  # calls being run (changed on the event loop only)

    def invoke(self, method: str | None, args: Sequence):
        """Run ``model.<method>(*args)`` (``method=None``: the model itself) on packed data."""
        target = self.model if method is None else getattr(self.model, method)
        t0 = time.perf_counter()
        try:
            return pack(target(*unpack(args)))
        finally:
            self.recent = time.perf_counter() - t0

    async def run(self, method: str | None, args: Sequence):
        """:meth:`invoke` on the event loop if calls are fast and none runs, else on a thread."""
        if self.running == 0 and self.recent < self.inline_below:
            return self.invoke(method, args)
        self.running += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, self.invoke, method, args)
        finally:
            self.running -= 1

    def close(self) -> None:
        """Stop taking calls; a call running goes on to its end on its thread."""
        self.executor.shutdown(wait=False)
