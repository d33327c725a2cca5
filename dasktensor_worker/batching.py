"""Many callers, one evaluation: concurrent calls of a batched method coalesced at the replica.

A sampler's chain calls a model with one parameter vector at a time.  An expensive
shared model (a neural surrogate on a GPU, a simulator vectorised in NumPy) costs about
the same for one row as for a hundred, so while it works on one chain's call, the calls
of the other chains that arrive can wait and then run together, as one evaluation.  That
is what serving systems call dynamic batching (Ray Serve's ``@serve.batch``, Triton's
dynamic batcher); here it happens at the model's replica, whoever the callers are:
threads of one process, sampler processes, ``dt.sample``'s segments on other workers.

* **The method says so.**  ``@batched`` (``dt.batched``) marks a method of the model's
  class; the decorator only sets an attribute on the function, so the class needs
  nothing of dasktensor on the workers (this module imports the standard library and
  NumPy).  Callers do not change: each still passes one row.
* **Stacked** (the default): the method receives each argument stacked along a new
  leading axis, one row per waiting call, and returns its outputs stacked the same way
  (one array, or a tuple of arrays); row ``i`` of each output goes back to call ``i``.
  With ``stack=False`` it receives one list per argument and returns a list of results,
  one per call (for arguments that do not stack).
* **No added latency for a lone caller.**  The first call to find no batch running
  runs at once; the calls that arrive meanwhile queue and make the next batch, up to
  ``max_size``.  Callers that call back to back (samplers' chains) come back from a
  batch one after another, and the first one back would run alone while the others
  queue: batches of 1 and N-1 would alternate (measured in P14: 3.4x instead of 4.7x).
  So by default (``wait="auto"``) a batch smaller than the previous one waits until as
  many calls are queued, at most a quarter of the previous batch's time; a lone caller
  (batches of one) never waits.  ``wait=0`` never waits; ``wait > 0`` waits that long
  after a batch's first call (Triton's ``max_queue_delay``).
* **No thread of its own.**  Each call arrives on its connection's thread (see
  :mod:`dasktensor_worker.wire`).  The thread whose call finds no batch running *leads*:
  it takes the queue (calls of the same argument shapes and dtypes, in arrival order,
  up to ``max_size``), runs the batch, hands each call its row, and if calls are
  waiting, hands the lead to the oldest of them.  A leader whose own call is not in its
  batch (more than ``max_size`` were queued before it) runs batches until it is.
* **Concurrency.**  A batch holds one of the replica's ``concurrency`` slots while it
  runs (so batched and unbatched methods of a model never run more than ``concurrency``
  calls at once), and at most ``concurrency`` batches of one method run at once.
* **Errors.**  An exception raised by the method is every call's of that batch, with
  its type and traceback; the next batch runs as usual.  A result whose outputs do not
  have one row per call fails the batch with a message saying so.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

#: the attribute ``batched`` sets on a method: ``{"max_size", "wait", "stack"}``
BATCHED = "dasktensor_batched"


def batched(
    fn: Callable | None = None, *, max_size: int = 64, wait: float | str = "auto", stack=True
):
    """Mark a model's method as batched: concurrent calls run as one evaluation.

    Parameters
    ----------
    fn : callable, optional
        The method (``@batched`` without parentheses uses the defaults).
    max_size : int
        The most calls in one batch (64 by default; 1 runs every call alone, as an
        unbatched method would, but through the batch's arguments).
    wait : "auto" or float
        ``"auto"`` (the default): a batch smaller than the previous one waits until as
        many calls are queued, at most a quarter of the previous batch's time: callers
        that call back to back, as chains do, stay in one batch, and a lone caller never
        waits.  A number: seconds a batch waits after its first call for more calls to
        arrive; 0: never (a batch is what queued while the model was busy).
    stack : bool
        True (default): each argument arrives stacked along a new leading axis (one row
        per call) and the outputs are returned stacked the same way.  False: each
        argument arrives as a list (one item per call) and the method returns a list of
        results, one per call.

    Returns
    -------
    callable
        ``fn`` itself, marked (no wrapper: it pickles and calls as before).

    Examples
    --------
    >>> import numpy as np
    >>> class Surrogate:
    ...     @batched(max_size=128)
    ...     def logp(self, theta):  # theta: (calls, d), one row per call
    ...         return -0.5 * (theta**2).sum(axis=1)  # (calls,)
    >>> Surrogate.logp.dasktensor_batched
    {'max_size': 128, 'wait': 'auto', 'stack': True}
    >>> Surrogate().logp(np.ones((3, 2)))  # called directly, it is the plain method
    array([-1., -1., -1.])
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"batched expected max_size= an int >= 1, got {max_size!r}")
    if wait != "auto" and (
        isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < 3600
    ):
        raise ValueError(f"batched expected wait= seconds >= 0 (a number) or 'auto', got {wait!r}")
    if not isinstance(stack, bool):
        raise TypeError(f"batched expected stack= True or False, got {stack!r}")

    def mark(method: Callable) -> Callable:
        if not callable(method):
            raise TypeError(f"batched expected a method to mark, got {method!r}")
        seconds = wait if wait == "auto" else float(wait)
        setattr(method, BATCHED, {"max_size": max_size, "wait": seconds, "stack": stack})
        return method

    return mark if fn is None else mark(fn)


def options_of(target) -> dict | None:
    """The batching options of a method (bound or not) marked by :func:`batched`, or None."""
    found = getattr(target, BATCHED, None)
    return found if isinstance(found, dict) else None


class _Call:
    """One waiting call: its arguments, its group, and where its outcome goes."""

    __slots__ = ("args", "arrived", "done", "error", "group", "result", "signature")

    def __init__(self, args: Sequence, group: _Group, arrived: float):
        self.args = tuple(args)
        self.signature = tuple(_signature(a) for a in self.args)
        self.arrived = arrived
        self.group = group
        self.done = False
        self.result: object = None
        self.error: BaseException | None = None

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.result


class _Group:
    """The calls one thread waits for: one call, or the calls of one message that a
    caller process combined (its threads' calls of the same method).  The thread leads
    (runs batches) or waits until all its calls are done."""

    __slots__ = ("calls", "event", "lead", "left")

    def __init__(self, arguments: Sequence[Sequence]):
        arrived = time.monotonic()
        self.calls = [_Call(args, self, arrived) for args in arguments]
        self.left = len(self.calls)  # not done yet
        self.event = threading.Event()  # set when all are done, or when handed the lead
        self.lead = False


def _signature(value) -> tuple:
    """What must agree between the calls of one batch for an argument to stack."""
    if isinstance(value, np.ndarray):
        return (value.shape, value.dtype.str)
    if isinstance(value, np.generic):
        return ((), value.dtype.str)
    return (type(value),)


class Batcher:
    """The queue of one batched method of one replica, and the batches it runs.

    Parameters
    ----------
    method : callable
        The bound method (or the model itself) to call with a batch.
    options : dict
        What :func:`batched` recorded (``max_size``, ``wait``, ``stack``).
    slots : threading.Semaphore
        The replica's concurrency slots: a batch holds one while it runs.
    concurrency : int
        The most batches of this method at once.
    record : callable, optional
        ``record(start, stop, size, status)`` after each batch (the call log).

    Examples
    --------
    >>> import threading
    >>> batcher = Batcher(lambda x: 2 * x, {"max_size": 8, "wait": 0.0, "stack": True},
    ...                   threading.BoundedSemaphore(1), 1)
    >>> batcher.call((np.array([1.0, 2.0]),))
    array([2., 4.])
    """

    def __init__(
        self,
        method: Callable,
        options: dict,
        slots,
        concurrency: int,
        record: Callable | None = None,
    ):
        self.method = method
        self.max_size = int(options["max_size"])
        self.auto = options["wait"] == "auto"
        self.wait = 0.0 if self.auto else float(options["wait"])
        #: the size and seconds of the last batch (``wait="auto"`` waits for as many)
        self.last = (1, 0.0)
        self.stack = bool(options["stack"])
        self.slots = slots
        self.limit = max(1, int(concurrency))
        self.record = record
        self.queue: deque[_Call] = deque()
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)  # for batches that wait for more
        self.leaders = 0
        #: batches run, and calls served, so far
        self.batches = self.calls = 0

    def call(self, args: Sequence):
        """Run one call (from its connection's thread) as part of a batch; its result."""
        return self.call_many([args])[0].outcome()

    def call_many(self, arguments: Sequence[Sequence]) -> list[_Call]:
        """Run several calls (a caller process's combined message) as part of batches;
        the calls, done (``outcome()`` gives each one's result or raises its error)."""
        group = _Group(arguments)
        with self.lock:
            self.queue.extend(group.calls)
            self.arrived.notify()
            if self.leaders < self.limit:
                self.leaders += 1
                group.lead = True
        if not self._wait(group):
            self._lead(group)
        return group.calls

    def _wait(self, group: _Group) -> bool:
        """Wait until ``group``'s calls are done (True) or it is handed the lead (False)."""
        while not group.lead:
            group.event.wait()
            with self.lock:  # (left, lead and the event change under the lock only)
                if not group.left and not group.lead:
                    return True
                group.event.clear()
        return False

    def _lead(self, mine: _Group) -> None:
        """Run batches from the queue until ``mine``'s calls are done, then hand the lead
        on."""
        while True:
            with self.lock:
                if not mine.left or not self.queue:
                    self._hand_on(mine)
                    if not mine.left:
                        return
                    batch = None  # mine run in other leaders' batches
                else:
                    batch = self._take()
            if batch is None:
                if self._wait(mine):
                    return
                continue  # handed the lead again meanwhile
            if len(batch) < self.max_size:
                if self.wait > 0:
                    batch += self._wait_for_more(batch, batch[0].arrived + self.wait)
                elif self.auto and len(batch) < self.last[0]:
                    deadline = time.monotonic() + self.last[1] / 4
                    batch += self._wait_for_more(batch, deadline, self.last[0])
            self._run(batch)

    def _hand_on(self, mine: _Group) -> None:
        """Give up the lead (called with the lock held): to the group of the oldest
        waiting call, or to nobody when none waits."""
        mine.lead = False
        for waiting in self.queue:
            group = waiting.group
            if not group.lead:
                group.lead = True
                group.event.set()
                return
        self.leaders -= 1

    def _take(self, batch: list | None = None) -> list[_Call]:
        """Calls from the queue that stack with the oldest (or with ``batch``), oldest
        first, up to ``max_size`` in all (called with the lock held)."""
        batch = [] if batch is None else batch
        room = self.max_size - len(batch)
        signature = (batch[0] if batch else self.queue[0]).signature
        taken: list[_Call] = []
        kept: deque[_Call] = deque()
        while self.queue:
            c = self.queue.popleft()
            if len(taken) < room and c.signature == signature:
                taken.append(c)
            else:
                kept.append(c)
        self.queue = kept
        return taken

    def _wait_for_more(
        self, batch: list[_Call], deadline: float, enough: int | None = None
    ) -> list[_Call]:
        """More calls for ``batch``, arriving until ``deadline`` (``time.monotonic()``), or
        until the batch holds ``enough`` calls (default ``max_size``)."""
        enough = min(enough or self.max_size, self.max_size)
        more: list[_Call] = []
        with self.lock:
            while len(batch) + len(more) < enough:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.arrived.wait(left)
                if self.queue:
                    more += self._take(batch + more)
        return more

    def _run(self, batch: list[_Call]) -> None:
        start, status = time.time(), "OK"
        try:
            with self.slots:
                began = time.monotonic()
                try:
                    results = self._evaluate(batch)
                finally:
                    self.last = (len(batch), time.monotonic() - began)
        except Exception as e:  # every call of the batch gets the model's error
            status, results = "error", None
            error = e
        stop = time.time()
        with self.lock:
            for i, c in enumerate(batch):
                if results is None:
                    c.error = error
                else:
                    c.result = results[i]
                c.done = True
                group = c.group
                group.left -= 1
                if not group.left:
                    group.event.set()
            self.batches += 1
            self.calls += len(batch)
        if self.record is not None:
            self.record(start, stop, len(batch), status)

    def _evaluate(self, batch: list[_Call]) -> list:
        """The method on the batch's arguments; one result per call."""
        n = len(batch)
        columns = list(zip(*(c.args for c in batch), strict=True)) if batch[0].args else []
        if not self.stack:
            results = self.method(*(list(col) for col in columns))
            if not isinstance(results, list | tuple) or len(results) != n:
                raise ValueError(
                    f"a batched method with stack=False must return a list of {n} results "
                    f"(one per call), got {_describe(results)}"
                )
            return list(results)
        out = self.method(*(_stack(col) for col in columns))
        several = isinstance(out, tuple | list)
        outputs = out if several else (out,)
        for o in outputs:
            if np.ndim(o) == 0 or len(o) != n:
                raise ValueError(
                    f"a batched method must return its outputs stacked along a first axis of "
                    f"one row per call: {n} call(s), got {_describe(out)}"
                )
        if several:
            rows = zip(*outputs, strict=True)
            return list(rows) if type(out) is tuple else [type(out)(r) for r in rows]
        return list(out)


def _stack(column: tuple):
    """The arguments of a batch's calls stacked along a new first axis (a copy)."""
    if len(column) == 1 and type(column[0]) is np.ndarray:  # (np.stack's result, faster)
        return column[0][None].copy()
    return np.stack(column)


def _describe(value) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {[_describe(v) for v in value]}"
    shape = np.shape(value) if isinstance(value, np.ndarray | np.generic) else None
    return f"an array of shape {shape}" if shape is not None else f"{type(value).__name__}"
