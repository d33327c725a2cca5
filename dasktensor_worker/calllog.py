"""What a worker's model replicas did: the call log behind the dashboard's calls page.

Calls through the remote-call channel skip the scheduler, so Dask's task stream never sees
them: a worker busy answering a sampler would look idle.  Each worker's
:class:`~dasktensor_worker.plugin.ModelHost` therefore records the calls it answers (model,
method, start, stop, outcome, and how many calls a batch served), keeps totals per
model and counts the calls in flight.  A batched method's batch is one record.  The
scheduler's monitor (:mod:`dasktensor_worker.monitor`) asks every worker for what
happened since its last look through the ``dasktensor_call_log`` handler
(``ModelHost.call_log``), for the dashboard, the metrics and ``dt.Adaptive``.

Calls are recorded by the call server's threads and read by the log handler on the
worker's event loop, under one lock (a few microseconds a call).  The log keeps the last
``maxlen`` calls; a page looking less often than that many calls loses the oldest from
its picture (the totals stay right).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate

#: the worker handler the dashboard page asks for records
LOG_HANDLER = "dasktensor_call_log"
#: upper bounds (seconds) of the call-duration histogram's buckets, Prometheus-style (the
#: last, infinity, implied): from a fraction of a millisecond (a channel round trip) to
#: minutes (a simulator)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)


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
        #: model name -> method (``"__call__"``: the model itself) -> ``[calls, errors]``
        self.methods: dict[str, dict[str, list]] = {}
        #: model name -> calls whose duration was at most each of ``BUCKETS`` (cumulative
        #: counts, then all calls), and the sum of the durations (each call of a batch
        #: counts the batch's duration)
        self.durations: dict[str, list] = {}
        self.inflight: dict[str, int] = {}
        self.lock = threading.Lock()

    def started(self, name: str, n: int = 1) -> float:
        """Count ``n`` calls of model ``name`` in flight; their start time."""
        with self.lock:
            self.inflight[name] = self.inflight.get(name, 0) + n
        return time.time()

    def finished(
        self,
        name: str,
        method: str | None,
        start: float,
        status: str,
        record: bool = True,
        n: int = 1,
    ) -> None:
        """A call that ended with ``status`` (``"OK"`` or ``"error"``): no longer in flight,
        and recorded unless ``record`` is false (a batched call: its batch is recorded);
        ``n`` such calls, not recorded (the calls of one message, recorded by their
        batches)."""
        stop = time.time()
        with self.lock:
            self.inflight[name] = max(self.inflight.get(name, n) - n, 0)
            if record:
                self._record(name, method or "__call__", start, stop, 1, status)

    def batch(self, name: str, method: str, start: float, stop: float, size: int, status: str):
        """Record a batch of ``size`` calls of a batched method."""
        with self.lock:
            self._record(name, method, start, stop, size, status)

    def _record(self, name, method, start, stop, size, status) -> None:
        self.records.append((name, method, start, stop, status, size))
        errors = size if status != "OK" else 0
        totals = self.totals.setdefault(name, [0, 0, 0.0, 0])
        totals[0] += size
        totals[1] += errors
        totals[2] += stop - start
        totals[3] += 1
        by_model = self.methods.setdefault(name, {})
        by_method = by_model.setdefault("__call__" if method is None else str(method), [0, 0])
        by_method[0] += size
        by_method[1] += errors
        # per bucket here (one bisect a record); made cumulative when read (since())
        counts = self.durations.setdefault(name, [0] * (len(BUCKETS) + 1) + [0.0])
        seconds = stop - start
        counts[bisect_left(BUCKETS, seconds)] += size
        counts[-1] += size * seconds

    def since(self, when: float) -> dict:
        """The calls that ended after ``when``, the totals (per model, per method, the
        histogram of durations), and the calls in flight."""
        records = []
        with self.lock:
            for record in reversed(self.records):  # newest first: stop at the first old one
                if record[3] <= when:
                    break
                records.append(list(record))
            totals = {name: list(t) for name, t in self.totals.items()}
            methods = {n: {m: list(t) for m, t in ms.items()} for n, ms in self.methods.items()}
            durations = {name: _cumulative(c) for name, c in self.durations.items()}
            inflight = {name: n for name, n in self.inflight.items() if n}
        records.reverse()
        return {
            "records": records,
            "totals": totals,
            "methods": methods,
            "durations": durations,
            "inflight": inflight,
            "now": time.time(),
        }


def _cumulative(counts: list) -> list:
    """Counts per bucket (the last: over the last bound), then the sum of durations ->
    calls of at most each bound, all calls, the sum (what the monitor reads).

    >>> _cumulative([1, 0, 2, 5.0])
    [1, 1, 3, 5.0]
    """
    return [*accumulate(counts[:-1]), counts[-1]]
