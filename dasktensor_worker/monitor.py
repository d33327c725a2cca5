"""The channel monitor: what the scheduler knows of the calls that skip it.

Remote-model calls, resident stages and shards go from their callers to the workers'
call servers, not through the scheduler, so Dask's own tools (the task stream, the
``/metrics`` endpoint, ``Adaptive``) see none of them.  :class:`ChannelMonitor` is a
``SchedulerPlugin`` that asks every worker's call log (:mod:`dasktensor_worker.calllog`)
once a second what happened (the ``dasktensor_call_log`` worker handler) and keeps:

* each worker's totals: calls and errors per model and method, a histogram of call
  durations per model, the calls in flight (running or waiting for a slot), the
  replicas it holds with their ``concurrency``, and the device they run on (``"GPU 0
  (NAME)"`` or ``"cpu"``, :mod:`dasktensor_worker.devices`);
* while the dashboard's page is open, the calls themselves (one record per call or
  batch), for its task-stream-like plot (:mod:`dasktensor_worker.dashboard`);
* the last few seconds of calls in flight and of evaluations per model, from which the
  demand for workers (``dt.Adaptive``) and the mean batch size are read.

It serves them three ways: the dashboard page, Prometheus metrics on the scheduler's
``/metrics`` (:class:`MetricsCollector`, when ``prometheus_client`` is installed), and the
scheduler handler ``dasktensor_channel`` that ``dt.Adaptive`` asks for the channel's
demand.  It also keeps scale-down off the workers it must not close
(:meth:`ChannelMonitor.valid_workers_downscaling`): those with calls in flight, and the
last holder of a model still in use.

The dashboard's page (:class:`dasktensor_worker.pages.CallsPage`, a plugin of its own,
Bokeh-free: the page's module is imported only on a scheduler that serves a Bokeh
dashboard) starts the monitor with it: a remote model registers the page when it first finds
its replicas on a cluster (idempotent), so do ``dt.connect`` and a scheduler started with
``dask scheduler --preload dasktensor_worker.dashboard``; ``dt.Adaptive`` starts the
monitor alone if it finds none.  This module imports no Bokeh: a scheduler without it
gets the metrics and the demand, not the page.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import threading
import time
import weakref
from collections import deque

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps
from tornado.ioloop import PeriodicCallback

from dasktensor_worker.calllog import BUCKETS, LOG_HANDLER
from dasktensor_worker.plugin import CallLogHandler

logger = logging.getLogger(__name__)

#: the scheduler handler ``dt.Adaptive`` asks for the channel's demand
DEMAND_HANDLER = "dasktensor_channel"


class ChannelMonitor(SchedulerPlugin):
    """Gather the workers' call logs on the scheduler, once a second.

    Parameters
    ----------
    interval : float
        Seconds between two looks at the workers.
    window : float
        Seconds of history behind the demand (the most calls in flight in that time)
        and the mean batch size.
    in_use : float
        A model that answered a call in the last ``in_use`` seconds keeps one replica
        through scale-down.

    Examples
    --------
    >>> import distributed
    >>> from dasktensor_worker.monitor import ChannelMonitor
    >>> with distributed.Client(processes=False, n_workers=1) as client:  # doctest: +SKIP
    ...     client.register_plugin(ChannelMonitor())
    ...     client.run_on_scheduler(lambda dask_scheduler: sorted(
    ...         dask_scheduler.plugins["dasktensor-channel"].demand()))
    ['models', 'target', 'workers']
    """

    name = "dasktensor-channel"
    idempotent = True

    def __init__(self, interval: float = 1.0, window: float = 5.0, in_use: float = 30.0):
        self.interval = interval
        self.window = window
        self.in_use = in_use
        self.scheduler = None
        #: worker address -> its last reply (see ``ModelHost.call_log``)
        self.replies: dict[str, dict] = {}
        #: ``(time, {model: calls in flight}, {model: (calls, evaluations) since the look
        #: before})``, a window's worth
        self.history: deque = deque()
        #: model -> mean calls per evaluation over the last window with evaluations
        self.batch: dict[str, float] = {}
        self._counts: dict[str, list] = {}  # model -> [calls, evaluations] at the last look
        #: model -> time.time() of the last change of its call count
        self.last_call: dict[str, float] = {}
        #: the calls seen while the page is open: ``(number, worker, record)``
        self.records: deque = deque(maxlen=20_000)
        self.numbered = 0
        #: the page asks for records until this time.time() (it renews it while open)
        self.watched_until = 0.0
        self._seen: dict[str, dict] = {}  # worker -> {record: stop}: records already taken
        self._since: dict[str, float] = {}  # worker -> stop of the newest record taken
        self._callback: PeriodicCallback | None = None
        self._polling = False
        self._lock = threading.Lock()  # the metrics are read on the scrape's thread

    def __getstate__(self):  # sent to the scheduler: its settings, not its state
        return {"interval": self.interval, "window": self.window, "in_use": self.in_use}

    def __setstate__(self, state):
        self.__init__(**state)

    # -- the plugin's life ------------------------------------------------------------

    async def start(self, scheduler) -> None:
        self.begin(scheduler)

    def begin(self, scheduler) -> None:
        """Start watching ``scheduler``'s workers (what :meth:`start` does, callable from
        the scheduler's event loop without awaiting)."""
        if self.scheduler is scheduler:
            return
        self.scheduler = scheduler
        scheduler.handlers[DEMAND_HANDLER] = self.demand
        self._callback = PeriodicCallback(self.poll, self.interval * 1000)
        self._callback.start()
        _monitors.append(weakref.ref(self))
        register_metrics()
        # every worker answers the call log, models or not (in the background: the
        # plugin goes to every worker, which a silent one would hold up)
        self._handlers = asyncio.ensure_future(
            scheduler.register_worker_plugin(
                None, dumps(CallLogHandler()), name=CallLogHandler.name, idempotent=True
            )
        )

    async def close(self) -> None:
        if self._callback is not None:
            self._callback.stop()
        if self.scheduler is not None:
            if self.scheduler.handlers.get(DEMAND_HANDLER) == self.demand:
                del self.scheduler.handlers[DEMAND_HANDLER]

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.replies.pop(worker, None)
        self._seen.pop(worker, None)
        self._since.pop(worker, None)

    # -- gathering --------------------------------------------------------------------

    @property
    def watched(self) -> bool:
        """Whether the page is open (the calls themselves are fetched)."""
        return time.time() < self.watched_until

    async def poll(self) -> None:
        """Ask every worker for its call log (the calls themselves only while the page
        is open); a worker that does not answer within the interval keeps its last
        reply."""
        if self._polling or self.scheduler is None:
            return
        self._polling = True
        try:
            addresses = list(self.scheduler.workers)
            watched = self.watched
            replies = await asyncio.gather(
                *(self._ask(a, watched) for a in addresses), return_exceptions=True
            )
            now = time.time()
            with self._lock:
                for address, reply in zip(addresses, replies, strict=True):
                    if isinstance(reply, dict) and address in self.scheduler.workers:
                        self._take(address, reply, watched)
                self._remember(now)
        finally:
            self._polling = False

    async def _ask(self, address: str, watched: bool) -> dict:
        since = self._since.get(address, time.time() - 30) - 1.0 if watched else math.inf
        call = getattr(self.scheduler.rpc(address), LOG_HANDLER)
        return await asyncio.wait_for(call(since=since), max(self.interval, 0.5))

    def _take(self, address: str, reply: dict, watched: bool) -> None:
        old = self.replies.get(address, {}).get("totals", {})
        for name, totals in reply.get("totals", {}).items():
            if name not in old or old[name][0] != totals[0]:
                self.last_call[name] = time.time()
        self.replies[address] = reply
        if not watched:
            return
        seen = self._seen.setdefault(address, {})
        newest = self._since.get(address, 0.0)
        for record in reply.get("records", ()):
            key = tuple(record)
            if key in seen:
                continue
            seen[key] = record[3]
            newest = max(newest, record[3])
            self.numbered += 1
            self.records.append((self.numbered, address, record))
        self._since[address] = newest
        for key in [k for k, stop in seen.items() if stop < newest - 5.0]:
            del seen[key]

    def _remember(self, now: float) -> None:
        inflight: dict[str, int] = {}
        counts: dict[str, list] = {}  # model -> [calls, evaluations], all workers
        for reply in self.replies.values():
            for name, n in reply.get("inflight", {}).items():
                inflight[name] = inflight.get(name, 0) + n
            for name, t in reply.get("totals", {}).items():
                c = counts.setdefault(name, [0, 0])
                c[0] += t[0]
                c[1] += t[3]
        before = self._counts
        self._counts = counts
        news = {}  # what this look added (a model first seen: all it has)
        for name, (calls, evaluations) in counts.items():
            old = before.get(name, (0, 0))
            if evaluations > old[1]:
                news[name] = (calls - old[0], evaluations - old[1])
        self.history.append((now, inflight, news))
        while self.history and self.history[0][0] < now - self.window:
            self.history.popleft()
        window: dict[str, list] = {}
        for _, _, added in self.history:
            for name, (calls, evaluations) in added.items():
                w = window.setdefault(name, [0, 0])
                w[0] += calls
                w[1] += evaluations
        for name, (calls, evaluations) in window.items():
            self.batch[name] = calls / evaluations

    # -- what is known ----------------------------------------------------------------

    def models(self) -> dict[str, dict]:
        """Per model, over all workers: ``calls``, ``errors``, ``seconds`` (of calls or
        batches), ``evaluations`` (calls alone and batches), ``inflight``,
        ``replicas``, ``concurrency`` (of all replicas), ``scalable``, ``workers``
        (holding a replica), ``devices`` (``{worker: "GPU 0 (NAME)" or "cpu"}`` of those
        workers; ``"?"`` for one that did not say), ``durations`` (the histogram:
        cumulative counts per bound of ``BUCKETS``, all calls, the sum of durations),
        ``batch`` (mean calls per evaluation over the last window that had any; None
        before) and ``p99`` (seconds, from the histogram)."""
        with self._lock:
            replies = dict(self.replies)
            batch = dict(self.batch)
        found: dict[str, dict] = {}

        def entry(name):
            return found.setdefault(
                name,
                {
                    "calls": 0,
                    "errors": 0,
                    "seconds": 0.0,
                    "evaluations": 0,
                    "inflight": 0,
                    "replicas": 0,
                    "concurrency": 0,
                    "scalable": False,
                    "workers": [],
                    "devices": {},
                    "durations": [0] * (len(BUCKETS) + 1) + [0.0],
                },
            )

        for address, reply in sorted(replies.items()):
            for name, t in reply.get("totals", {}).items():
                e = entry(name)
                e["calls"] += t[0]
                e["errors"] += t[1]
                e["seconds"] += t[2]
                e["evaluations"] += t[3]
            for name, n in reply.get("inflight", {}).items():
                entry(name)["inflight"] += n
            for name, info in reply.get("models", {}).items():
                e = entry(name)
                e["replicas"] += info["replicas"]
                e["concurrency"] += info["concurrency"]
                e["scalable"] = e["scalable"] or info["scalable"]
                e["workers"].append(address)
                e["devices"][address] = reply.get("device") or "?"
            for name, counts in reply.get("durations", {}).items():
                e = entry(name)
                # (a worker of another version may count other buckets: the common ones)
                e["durations"] = [a + b for a, b in zip(e["durations"], counts, strict=False)]
        for name, e in found.items():
            e["batch"] = batch.get(name)
            e["p99"] = quantile(0.99, e["durations"])
        return found

    def device(self, worker: str) -> str:
        """The device of ``worker``'s replicas as it last said (``"GPU 0 (NAME)"``,
        ``"cpu"``), or ``"?"`` before it said (no model built there yet)."""
        with self._lock:
            return self.replies.get(worker, {}).get("device") or "?"

    def busiest(self) -> dict[str, int]:
        """Per model, the most calls in flight at one look during the window."""
        with self._lock:
            history = list(self.history)
        most: dict[str, int] = {}
        for _, inflight, _ in history:
            for name, n in inflight.items():
                most[name] = max(most.get(name, 0), n)
        return most

    def target(self) -> int:
        """The workers the channel's demand asks for: for each model with a replica on
        every worker (no ``replicas=`` limit), the most calls in flight in the window
        over the calls one replica runs at once; the largest over the models (their
        replicas share the workers).  0 when no such model is busy."""
        busiest = self.busiest()
        wanted = 0
        for name, e in self.models().items():
            if not e["scalable"] or not e["replicas"] or not busiest.get(name):
                continue
            per_replica = max(1, e["concurrency"] // e["replicas"])
            wanted = max(wanted, math.ceil(busiest[name] / per_replica))
        return wanted

    def demand(self, comm=None) -> dict:
        """The ``dasktensor_channel`` handler: ``{"target": workers wanted, "models":
        {name: {"inflight", "busiest", "replicas", "concurrency", "scalable"}},
        "workers": {address: calls in flight}, "tasks": Dask tasks processing or
        waiting, "memory": the workers' stored bytes over their memory limits}``."""
        busiest = self.busiest()
        models = {
            name: {
                "inflight": e["inflight"],
                "busiest": busiest.get(name, 0),
                "replicas": e["replicas"],
                "concurrency": e["concurrency"],
                "scalable": e["scalable"],
            }
            for name, e in self.models().items()
        }
        with self._lock:
            workers = {a: sum(r.get("inflight", {}).values()) for a, r in self.replies.items()}
        scheduler = self.scheduler
        tasks = len(scheduler.queued) + len(scheduler.unrunnable)
        tasks += sum(len(ws.processing) for ws in scheduler.workers.values())
        limit = sum(ws.memory_limit or 0 for ws in scheduler.workers.values())
        used = sum(ws.nbytes for ws in scheduler.workers.values())
        return {
            "target": self.target(),
            "models": models,
            "workers": workers,
            "tasks": tasks,
            "memory": used / limit if limit else 0.0,
        }

    # -- scale-down -------------------------------------------------------------------

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        """Of the workers Dask would close, those it may: not one with calls in flight
        (as of the last look), and not the last holder of a model that answered a call
        in the last ``in_use`` seconds (one holder is kept, the first by address)."""
        with self._lock:
            replies = dict(self.replies)
        busy = {a for a, r in replies.items() if any(r.get("inflight", {}).values())}
        closing = {ws.address for ws in workers if ws.address not in busy}
        now = time.time()
        keep = set()
        holders: dict[str, list] = {}
        for address, reply in replies.items():
            for name in reply.get("models", {}):
                holders.setdefault(name, []).append(address)
        for name, addresses in holders.items():
            if now - self.last_call.get(name, 0.0) > self.in_use:
                continue
            staying = [a for a in addresses if a not in closing or a in keep]
            if not staying:
                keep.add(sorted(addresses)[0])
        return [ws for ws in workers if ws.address in closing and ws.address not in keep]


def monitor_of(scheduler) -> ChannelMonitor:
    """The channel monitor of ``scheduler`` (on its event loop), started if it had none."""
    monitor = scheduler.plugins.get(ChannelMonitor.name)
    if monitor is None:
        monitor = ChannelMonitor()
        monitor.begin(scheduler)
        scheduler.add_plugin(monitor, name=ChannelMonitor.name, idempotent=True)
    return monitor


def quantile(q: float, durations: list) -> float | None:
    """The ``q`` quantile (seconds) of a histogram of ``BUCKETS`` (cumulative counts,
    the count of all, the sum), interpolated within its bucket as Prometheus's
    ``histogram_quantile`` does; None without calls."""
    total = durations[len(BUCKETS)]
    if not total:
        return None
    rank = q * total
    counts = durations[: len(BUCKETS)]
    i = bisect.bisect_left(counts, rank)
    if i == len(BUCKETS):  # beyond the last bound: say the last bound
        return float(BUCKETS[-1])
    lower = BUCKETS[i - 1] if i else 0.0
    below = counts[i - 1] if i else 0
    inside = counts[i] - below
    return lower + (BUCKETS[i] - lower) * ((rank - below) / inside if inside else 1.0)


_monitors: list[weakref.ref] = []


def current_monitor() -> ChannelMonitor | None:
    """The monitor of this process's newest running scheduler, or None."""
    alive = [m() for m in _monitors]
    _monitors[:] = [weakref.ref(m) for m in alive if m is not None]
    for monitor in reversed([m for m in alive if m is not None]):
        scheduler = monitor.scheduler
        if scheduler is not None and getattr(scheduler.status, "name", "") == "running":
            return monitor
    return None


class MetricsCollector:
    """The channel's Prometheus metrics, read from the newest running scheduler's
    monitor at each scrape of its ``/metrics`` (the scheduler's ``PrometheusHandler``
    serves ``prometheus_client``'s global registry, where this is registered once per
    process, as Dask registers its own collectors).

    ``dasktensor_calls_total{model,method,worker}``, ``dasktensor_call_errors_total``
    (same labels), ``dasktensor_call_seconds{model}`` (a histogram: a batch's duration
    counts for each of its calls), ``dasktensor_calls_in_flight{model}``,
    ``dasktensor_replicas{model}``, ``dasktensor_evaluations_total{model}`` (calls alone
    and batches: ``rate(calls) / rate(evaluations)`` is the batch size over any span)
    and ``dasktensor_batch_size{model}`` (mean calls per evaluation over the last 5 s
    that had any).
    """

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        monitor = current_monitor()
        if monitor is None:
            return
        with monitor._lock:
            replies = dict(monitor.replies)
        calls = CounterMetricFamily(
            "dasktensor_calls",
            "Calls answered by remote models, resident stages and shards",
            labels=["model", "method", "worker"],
        )
        errors = CounterMetricFamily(
            "dasktensor_call_errors",
            "Calls that raised in the model",
            labels=["model", "method", "worker"],
        )
        for address, reply in sorted(replies.items()):
            for model, methods in sorted(reply.get("methods", {}).items()):
                for method, (n, failed) in sorted(methods.items()):
                    calls.add_metric([model, method, address], n)
                    errors.add_metric([model, method, address], failed)
        seconds = HistogramMetricFamily(
            "dasktensor_call_seconds",
            "Duration of the calls (a batch's for each of its calls)",
            labels=["model"],
        )
        inflight = GaugeMetricFamily(
            "dasktensor_calls_in_flight", "Calls running or waiting on a worker", labels=["model"]
        )
        replicas = GaugeMetricFamily(
            "dasktensor_replicas", "Replicas held by the workers", labels=["model"]
        )
        batch = GaugeMetricFamily(
            "dasktensor_batch_size",
            "Mean calls per evaluation (a call alone or a batch) over the last seconds with any",
            labels=["model"],
        )
        evaluations = CounterMetricFamily(
            "dasktensor_evaluations",
            "Evaluations of the models: calls alone, and batches of calls",
            labels=["model"],
        )
        for name, e in sorted(monitor.models().items()):
            evaluations.add_metric([name], e["evaluations"])
            d = e["durations"]
            buckets = [(_bound(b), d[i]) for i, b in enumerate(BUCKETS)]
            buckets.append(("+Inf", d[len(BUCKETS)]))
            seconds.add_metric([name], buckets, d[-1])
            inflight.add_metric([name], e["inflight"])
            replicas.add_metric([name], e["replicas"])
            if e["batch"] is not None:
                batch.add_metric([name], e["batch"])
        yield from (calls, errors, evaluations, seconds, inflight, replicas, batch)


def _bound(b: float) -> str:
    return repr(float(b))


_registered = False


def register_metrics() -> None:
    """Register :class:`MetricsCollector` with ``prometheus_client`` (once a process;
    nothing without ``prometheus_client``)."""
    global _registered
    if _registered:
        return
    try:
        import prometheus_client
    except ImportError:
        return
    prometheus_client.REGISTRY.register(MetricsCollector())
    _registered = True
