"""Execution on real distributed clusters: placement, resources, keys, errors, failover.

These tests run the task path (``dasktensor.execute.path: tasks``: a Dask task per cluster
task and call), whose tasks the task stream records; ``tests/test_resident.py`` tests the
same on the default channel path.
"""

from __future__ import annotations

import dask
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import gpu_worker_address, heavy_function_on_its_own_cluster
from _ops import Scale
from dask.utils import key_split
from distributed import Client, get_task_stream

import dasktensor as dt


@pytest.fixture(autouse=True)
def task_path():
    with dask.config.set({"dasktensor.execute.path": "tasks"}):
        yield


def test_annotated_tasks_run_only_on_the_worker_with_the_resource(mixed_cluster):
    x = pt.vector("x")
    outs = []
    for k in range(4):
        with dt.annotate(resources={"GPU": 1}, name="on-gpu"):
            y = pt.exp(x * (k + 1.0))
        outs.append(y.sum())
        outs.append(Scale(k + 1.0, delay=0.2)(x).sum())  # unannotated: any worker
    with Client(mixed_cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        f = dt.function([x], sum(outs), scheduler=client)
        on_gpu = [t for t in f.plan.tasks if t.name == "on-gpu"]
        assert len(on_gpu) == 4
        assert all(t.placement == dt.Placement(resources={"GPU": 1}) for t in on_gpu)
        xv = np.linspace(0, 1, 5)
        with get_task_stream(client) as ts:
            for _ in range(3):
                np.testing.assert_allclose(f(xv), pytensor.function([x], sum(outs))(xv))
        gpu = gpu_worker_address(client)
        ran = {}
        for rec in ts.data:
            ran.setdefault(key_split(rec["key"]), set()).add(rec["worker"])
        assert ran["on-gpu"] == {gpu}
        assert len(ran["scale-heavy"]) == 2, "unannotated tasks should use both workers"


@pytest.mark.timeout(120)  # a task waiting forever for its resource fails here
def test_missing_resource_fails_with_a_clear_error_after_the_timeout(mixed_cluster):
    x = pt.vector("x")
    with dt.annotate(resources={"TPU": 1}):
        y = pt.exp(x)
    with Client(mixed_cluster, set_as_default=False) as client:
        f = dt.function([x], y.sum(), scheduler=client)
        with dask.config.set({"dasktensor.placement.resource-timeout": "1s"}):
            with pytest.raises(dt.NoWorkerWithResourcesError, match=r"\{'TPU': 1\}") as info:
                f(np.ones(3))
        assert "dask worker" in str(info.value) and "GPU" in str(info.value)


def test_keys_are_fresh_per_call_and_read_like_the_model(client):
    x = pt.vector("x")
    y = Scale(3.0)(pt.exp(x)).sum()
    f = dt.function([x], y, scheduler=client)
    for v in (1.0, 2.0, 3.0):  # reused keys would return the first call's result
        np.testing.assert_allclose(f(np.full(2, v)), 2 * np.exp(v) * 3.0)
    prefixes = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes))
    assert "scale-heavy" in prefixes


def test_remote_exception_reaches_the_caller_and_the_next_call_works(client):
    x = pt.vector("x")
    f = dt.function([x], Scale(2.0, fail_on=-1.0)(x).sum(), scheduler=client)
    with pytest.raises(ValueError, match="scale-heavy refuses -1.0") as info:
        f(np.array([1.0, -1.0]))
    assert "perform" in "".join(__import__("traceback").format_tb(info.tb))
    assert float(f(np.array([1.0, 2.0]))) == 6.0


def test_independent_heavy_calls_run_concurrently(client):
    x = pt.vector("x")
    out = sum(Scale(k + 1.0, delay=0.5)(x).sum() for k in range(2))
    f = dt.function([x], out, scheduler=client)
    f(np.ones(2))
    with get_task_stream(client) as ts:
        f(np.ones(2))
    spans = sorted((r["startstops"][0]["start"], r["startstops"][0]["stop"]) for r in ts.data)
    assert len(spans) == 2
    assert spans[1][0] < spans[0][1], f"heavy calls did not overlap: {spans}"


def test_to_dask_graph_carries_annotations_and_computes_on_the_cluster(mixed_cluster):
    x = pt.vector("x")
    with dt.annotate(resources={"GPU": 1}, retries=1, name="placed"):
        y = pt.exp(x)
    f = dt.function([x], [y.sum(), x * 2])
    total, doubled = f.to_dask(np.arange(3.0))
    annotations = total.__dask_graph__().layers
    assert any(
        (layer.annotations or {}).get("resources") == {"GPU": 1} for layer in annotations.values()
    )
    with Client(mixed_cluster, set_as_default=False) as client:
        with get_task_stream(client) as ts:
            got = client.compute([total, doubled], sync=True)
        np.testing.assert_allclose(got[0], np.exp(np.arange(3.0)).sum())
        np.testing.assert_allclose(got[1], [0.0, 2.0, 4.0])
        placed = {r["worker"] for r in ts.data if key_split(r["key"]) == "placed"}
        assert placed == {gpu_worker_address(client)}


def test_a_killed_worker_is_recomputed_elsewhere():
    with heavy_function_on_its_own_cluster(delay=1.0) as (client, f):
        assert float(f(np.ones(2))) == 10.0

        import os
        import signal
        import threading

        pids = client.run(os.getpid)  # both workers are busy with one heavy call each
        killer = threading.Timer(0.4, os.kill, (next(iter(pids.values())), signal.SIGKILL))
        killer.start()
        assert float(f(np.full(2, 2.0))) == 20.0
        killer.join()
        client.wait_for_workers(2, timeout=60)  # the nanny restarts the worker (~1 s)
        assert len(client.run(os.getpid)) == 2


def test_shared_weights_stay_on_the_cluster_until_they_change(client):
    w = pytensor.shared(np.ones(70_000), name="w")  # 560 kB: scattered, not embedded
    x = pt.vector("x")
    out = Scale(2.0)(x * w).sum() + Scale(3.0)(w).sum()
    f = dt.function([x], out, scheduler=client)
    executor = f.maker.linker.executor
    assert float(f(np.ones(70_000))) == 5 * 70_000
    (first,) = {future.key for _, future in executor._resident.values()}
    assert float(f(np.full(70_000, 2.0))) == 7 * 70_000
    assert {future.key for _, future in executor._resident.values()} == {first}
    w.set_value(np.full(70_000, 2.0))  # a new value is sent again, never a stale one
    assert float(f(np.ones(70_000))) == 10 * 70_000
    assert {future.key for _, future in executor._resident.values()} != {first}
