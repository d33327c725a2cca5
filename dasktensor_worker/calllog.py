"""What a worker's model replicas did: the call log behind the dashboard's calls page.

Calls through the remote-call channel skip the scheduler, so Dask's task stream never sees
them: a worker busy answering a sampler would look idle.  Each worker's
:class:`~dasktensor_worker.plugin.ModelHost` therefore records the calls it answers (model,
method, start, stop, outcome, and how many calls a batch served), keeps totals per
model and counts the calls in flight.  A batched method's batch is one record.  The
scheduler's page (:mod:`dasktensor_worker.dashboard`) asks every worker for what happened
since its last look through the ``dasktensor_call_log`` handler.

Calls are recorded by the call server's threads and read by the log handler on the
worker's event loop, under one lock (a few microseconds a call).  The log keeps the last
``maxlen`` calls; a page looking less often than that many calls loses the oldest from
its picture (the totals stay right).
"""

from __future__ import annotations

import threading
import time
from collections import deque

#: the worker handler the dashboard page asks for records
LOG_HANDLER = "dasktensor_call_log"


class CallLog:
    """Calls answered by one worker: recent records, totals per model, calls in flight.

    Examples
    --------
    >>> log = CallLog()
    >>> start = log.started("normal")
    >>> log.since(0.0)["inflight"]
    {'normal': 1}
    >>> log.finished("normal", "logp_grad", start, "OK")
    >>> seen = log.since(0.0)
    >>> [(r[0], r[1], r[4], r[5]) for r in seen["records"]], seen["totals"]["normal"][:2]
    ([('normal', 'logp_grad', 'OK', 1)], [1, 0])
    >>> log.since(seen["now"])["records"]  # nothing new since
    []
    """

    def __init__(self, maxlen: int = 20_000):
        #: ``(model name, method, start, stop, status, calls)``, wall-clock seconds; calls
        #: is 1, or the size of a batched method's batch
        self.records: deque[tuple[str, str, float, float, str, int]] = deque(maxlen=maxlen)
        #: model name -> ``[calls, errors, seconds, records]`` (records: calls alone and
        #: batches, whose seconds are counted once)
        self.totals: dict[str, list] = {}
        self.inflight: dict[str, int] = {}
        self.lock = threading.Lock()

    def started(self, name: str) -> float:
        """Count a call of model ``name`` in flight; its start time."""
        with self.lock:
            self.inflight[name] = self.inflight.get(name, 0) + 1
        return time.time()

    def finished(
        self, name: str, method: str | None, start: float, status: str, record: bool = True
    ) -> None:
        """A call that ended with ``status`` (``"OK"`` or ``"error"``): no longer in flight,
        and recorded unless ``record`` is false (a batched call: its batch is recorded)."""
        stop = time.time()
        with self.lock:
            self.inflight[name] = max(self.inflight.get(name, 1) - 1, 0)
            if record:
                self._record(name, method or "__call__", start, stop, 1, status)

    def batch(self, name: str, method: str, start: float, stop: float, size: int, status: str):
        """Record a batch of ``size`` calls of a batched method."""
        with self.lock:
            self._record(name, method, start, stop, size, status)

    def _record(self, name, method, start, stop, size, status) -> None:
        self.records.append((name, method, start, stop, status, size))
        totals = self.totals.setdefault(name, [0, 0, 0.0, 0])
        totals[0] += size
        totals[1] += size if status != "OK" else 0
        totals[2] += stop - start
        totals[3] += 1

    def since(self, when: float) -> dict:
        """The calls that ended after ``when``, the totals, and the calls in flight."""
        records = []
        with self.lock:
            for record in reversed(self.records):  # newest first: stop at the first old one
                if record[3] <= when:
                    break
                records.append(list(record))
            totals = {name: list(t) for name, t in self.totals.items()}
            inflight = {name: n for name, n in self.inflight.items() if n}
        records.reverse()
        return {"records": records, "totals": totals, "inflight": inflight, "now": time.time()}

    async def handle(self, since: float = 0.0) -> dict:
        """The ``dasktensor_call_log`` handler."""
        return self.since(float(since))
