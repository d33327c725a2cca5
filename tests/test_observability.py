"""Dask's own tools see the channel: Prometheus metrics, the demand, dt.Adaptive.

Calls through the channel skip the scheduler; the scheduler's channel monitor
(``dasktensor_worker.monitor``) gathers them from the workers' call logs.  Here: the
``dasktensor_*`` metrics on the scheduler's ``/metrics`` parsed with
``prometheus_client``'s parser; scale-down kept off busy workers and off a model's last
replica; ``cluster.adapt(Adaptive=dt.Adaptive)`` on a process ``LocalCluster`` scaling
up on calls alone and back down while calls go on, none failing.  (The dashboard page is
tested in Chromium in ``test_dashboard.py``.)
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import numpy as np
import pytest
from _clusters import eventually, local_cluster
from _models import Doubler, Probe

import dasktensor as dt
from dasktensor.cluster import scheduler_workers


def monitor_says(client, what: str, *args):
    """Call the scheduler's channel monitor's method ``what``."""

    def ask(dask_scheduler, what=what, args=args):
        return getattr(dask_scheduler.plugins["dasktensor-channel"], what)(*args)

    return client.run_on_scheduler(ask)


def metrics(cluster) -> dict:
    """The scheduler's ``/metrics``, parsed: ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    port = cluster.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("dasktensor_")
    }


def test_the_metrics_count_the_calls_errors_durations_replicas_and_batches():
    from concurrent.futures import ThreadPoolExecutor

    with local_cluster(n_workers=2) as cluster, dt.connect(cluster.scheduler_address) as c:
        probe = dt.RemoteModel(Probe, name="metered", scheduler=c)
        doubler = dt.RemoteModel(Doubler, name="doubler", replicas=1, scheduler=c)
        for _ in range(7):
            probe.call("where", 0.03)
        for _ in range(2):
            with pytest.raises(FloatingPointError):
                probe.call("refuse", np.ones(2))
        with ThreadPoolExecutor(6) as pool:  # six callers at once: batches of several
            got = list(pool.map(lambda k: doubler.call("double", np.full(3, k)), range(30)))
        np.testing.assert_array_equal(got[7], np.full(3, 14.0))

        def counted():
            m = metrics(cluster)
            calls = {k: v for k, v in m.items() if k[0] == "dasktensor_calls_total"}
            return m if sum(calls.values()) == 7 + 2 + 30 else None

        m = eventually(counted, 10)
        assert m, "the metrics did not count 39 calls"
        workers = set(scheduler_workers(c))

        def total(name, **labels):
            return sum(
                v
                for (n, ls), v in m.items()
                if n == name and all(dict(ls).get(k) == w for k, w in labels.items())
            )

        assert total("dasktensor_calls_total", model="metered", method="where") == 7
        assert total("dasktensor_calls_total", model="metered", method="refuse") == 2
        assert total("dasktensor_call_errors_total", model="metered", method="refuse") == 2
        assert total("dasktensor_call_errors_total", model="metered", method="where") == 0
        labelled = {dict(ls)["worker"] for (n, ls) in m if n == "dasktensor_calls_total"}
        assert labelled <= workers
        # the histogram: 9 calls of metered, the 7 of 30 ms above 25 ms, all under 1 s
        assert total("dasktensor_call_seconds_count", model="metered") == 9
        assert total("dasktensor_call_seconds_bucket", model="metered", le="+Inf") == 9
        assert total("dasktensor_call_seconds_bucket", model="metered", le="0.025") <= 2
        assert total("dasktensor_call_seconds_bucket", model="metered", le="1.0") == 9
        assert 7 * 0.03 <= total("dasktensor_call_seconds_sum", model="metered") < 9
        assert total("dasktensor_replicas", model="metered") == 2  # one on each worker
        assert total("dasktensor_replicas", model="doubler") == 1
        assert total("dasktensor_calls_in_flight", model="metered") == 0
        # 30 calls of six callers on one replica: fewer evaluations than calls
        assert total("dasktensor_batch_size", model="doubler") > 1
        batches = total("dasktensor_evaluations_total", model="doubler")
        assert 30 / batches == pytest.approx(total("dasktensor_batch_size", model="doubler"))
        assert total("dasktensor_evaluations_total", model="metered") == 9


def test_scale_down_keeps_workers_with_calls_in_flight_and_a_models_last_replica():
    with local_cluster(n_workers=2) as cluster, dt.connect(cluster.scheduler_address) as c:
        model = dt.RemoteModel(Probe, name="kept", scheduler=c)
        assert len(model.start()) == 2
        pids = c.run(os.getpid)
        call = threading.Thread(target=model.call, args=("where", 4.0))
        call.start()

        def busy_worker():
            busy = monitor_says(c, "demand")["workers"]
            return [a for a, n in busy.items() if n]

        (busy,) = eventually(busy_worker, 10)
        assert set(pids) == set(scheduler_workers(c))
        # Dask's own choice (any Adaptive, cluster.scale down): the idle worker only
        assert c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.workers_to_close(n=2)) == [
            a for a in pids if a != busy
        ]
        call.join()
        time.sleep(1.5)  # the monitor's next look: nothing in flight
        # used a moment ago: one of its two holders stays
        closing = c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.workers_to_close(n=2))
        assert len(closing) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_adapt_scales_up_on_calls_alone_and_down_with_calls_going_on_none_failing():
    with local_cluster(n_workers=1) as cluster, dt.connect(cluster.scheduler_address) as c:
        model = dt.RemoteModel(Probe, name="adapted", scheduler=c)
        model.start()
        adaptive = cluster.adapt(
            Adaptive=dt.Adaptive, minimum=1, maximum=3, interval="500ms", wait_count=2
        )
        assert isinstance(adaptive, dt.Adaptive)
        answered: list = []
        failures: list = []
        callers = 6
        stop = [threading.Event() for _ in range(callers)]

        def caller(i):
            while not stop[i].is_set():
                try:
                    pid, _ = model.call("where", 0.05)
                    answered.append((time.monotonic(), int(pid)))
                except BaseException as e:  # noqa: BLE001 (any failure fails the test)
                    failures.append(e)
                    return

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        try:
            t0 = time.monotonic()
            up = eventually(lambda: len(scheduler_workers(c)) == 3, 60)
            assert up, f"adapt did not scale to 3 workers in 60 s ({adaptive.log})"
            # the new workers serve calls (replicas built on them at a refresh)
            served = eventually(lambda: len({p for t, p in answered if t > t0}) >= 3, 30)
            assert served, "the calls did not reach the new workers"
            for i in range(1, callers):  # one caller goes on while the cluster shrinks
                stop[i].set()
            down = eventually(lambda: len(scheduler_workers(c)) == 1, 90)
            assert down, f"adapt did not come back to 1 worker in 90 s ({adaptive.log})"
            before = len(answered)
            assert eventually(lambda: len(answered) > before + 5, 10)  # still answered
        finally:
            for s in stop:
                s.set()
            for t in threads:
                t.join(30)
            cluster.adapt(minimum=1, maximum=1)
        assert not failures, failures
