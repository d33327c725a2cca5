"""Resident stages: cluster tasks compiled once on the workers and called through the channel.

``dasktensor.execute.path: channel``.  The corpus runs on this path too
(``tests/test_corpus.py``, settings ``channel`` and ``heavy0-channel``); here: what is
specific to it, on real worker processes.
"""

from __future__ import annotations

import gc
import os
import signal
import time

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

CHANNEL = {"dasktensor.execute.path": "channel"}


def _stages_here(dask_worker) -> dict[str, tuple[str, int]]:
    """On a worker: its resident stages, ``{model key: (task name, bytes received)}``."""
    from dasktensor.engine._resident import StageServer

    host = dask_worker.plugins.get("dasktensor-models")
    replicas = getattr(host, "replicas", {})
    return {
        key: (key.rsplit("-", 1)[0], r.model.received)
        for key, r in replicas.items()
        if isinstance(r.model, StageServer)
    }


def stages_on(client, besides=None) -> dict[str, dict[str, tuple[str, int]]]:
    """``{worker: {stage key: (task name, bytes received)}}``, without the stages in
    ``besides`` (an earlier result: those of other functions on the shared cluster)."""
    got = client.run(_stages_here)
    if besides is None:
        return got
    return {w: {k: v for k, v in s.items() if k not in besides.get(w, {})} for w, s in got.items()}


def branches(weights):
    """Two annotated branches reading a large shared matrix, and their sum."""
    x = pt.dvector("x")
    outs = []
    for k in range(2):
        with dt.annotate(name="branch"):
            outs.append(pt.tanh(weights @ pt.exp(x * (k + 1.0))).sum())
    return x, outs[0] + outs[1]


def test_stages_are_built_once_per_worker_and_called_outside_the_task_stream(client):
    w = pytensor.shared(np.random.default_rng(0).normal(size=(50, 8)), name="w")
    x, out = branches(w)
    f = dt.function([x], out, scheduler=client)
    ref = pytensor.function([x], out)
    xv = np.linspace(0, 0.1, 8)
    others = stages_on(client)
    with dask.config.set(CHANNEL), get_task_stream(client) as ts:
        for _ in range(5):
            np.testing.assert_allclose(f(xv), ref(xv), rtol=1e-12)
    names = [key_split(r["key"]) for r in ts.data]
    # the two branch stages are built (once per worker each), never submitted as tasks;
    # each has a lease, a task computing nothing that keeps its replicas alive
    assert sorted(names) == ["build-branch"] * 4 + ["dasktensor-lease-branch"] * 2, names
    held = stages_on(client, besides=others)
    assert all(sorted(n for n, _ in s.values()) == ["branch", "branch"] for s in held.values())


def test_large_data_stays_on_the_workers_until_it_changes(client):
    data = np.random.default_rng(1).normal(size=(400, 100)) * 0.1  # 320 kB: kept resident
    w = pytensor.shared(data, name="w")
    x, out = branches(w)
    f = dt.function([x], out, scheduler=client)
    ref = pytensor.function([x], out)
    xv = np.linspace(0, 0.1, 100)
    others = stages_on(client)

    def bytes_received():
        return sum(b for s in stages_on(client, besides=others).values() for _, b in s.values())

    with dask.config.set(CHANNEL):
        f(xv)
        received = bytes_received()
        assert data.nbytes <= received <= 4 * data.nbytes  # sent to a replica at most once
        for _ in range(6):
            np.testing.assert_allclose(f(xv), ref(xv), rtol=1e-12)
        again = bytes_received()
        assert again <= 4 * data.nbytes  # the later calls sent tokens, not the matrix
        # every replica has it now: calls send nothing large any more
        settled = again
        for _ in range(4):
            f(xv)
        assert bytes_received() == settled
        w.set_value(data * 2)  # a new value: sent again, and used
        np.testing.assert_allclose(f(xv), ref(xv), rtol=1e-12)
        after = bytes_received()
        assert after > settled


def test_stages_follow_their_placement(mixed_cluster):
    x = pt.vector("x")
    with dt.annotate(resources={"GPU": 1}, name="on-gpu"):
        y = pt.exp(x)
    out = y.sum() + Scale(2.0)(x).sum()
    with Client(mixed_cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        f = dt.function([x], out, scheduler=client)
        with dask.config.set(CHANNEL):
            np.testing.assert_allclose(f(np.zeros(3)), 3.0)
        gpu = gpu_worker_address(client)
        where = {
            address: sorted(name for name, _ in s.values())
            for address, s in stages_on(client).items()
        }
    assert "on-gpu" in where[gpu]
    assert all("on-gpu" not in names for a, names in where.items() if a != gpu)


def _calls_logged(dask_worker) -> list:
    """On a worker: the calls its replicas answered, ``[name, method, start, stop, status]``."""
    return dask_worker.plugins["dasktensor-models"].calls.since(0.0)["records"]


def test_independent_stages_are_called_at_once(client):
    x = pt.vector("x")
    out = sum(Scale(k + 1.0, delay=0.5)(x).sum() for k in range(2))
    f = dt.function([x], out, scheduler=client)
    f(np.ones(2))  # builds the stages
    before = {a: len(r) for a, r in client.run(_calls_logged).items()}
    assert float(f(np.ones(2))) == 6.0
    spans = sorted(
        (start, stop)
        for a, records in client.run(_calls_logged).items()
        for name, _, start, stop, *_ in records[before[a] :]
        if name == "scale-heavy"
    )
    assert len(spans) == 2, spans
    assert spans[1][0] < spans[0][1], f"the two stages' calls did not overlap: {spans}"


def test_stages_pinned_to_a_worker_run_there_alone(mixed_cluster):
    x = pt.vector("x")
    with Client(mixed_cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        gpu = gpu_worker_address(client)
        with dt.annotate(workers=[gpu], name="pinned"):
            y = pt.exp(x)
        out = y.sum() + Scale(2.0)(x).sum()
        f = dt.function([x], out, scheduler=client)
        with get_task_stream(client) as ts:
            for _ in range(3):
                np.testing.assert_allclose(f(np.zeros(3)), 3.0)
        assert not [r for r in ts.data if key_split(r["key"]) == "pinned"], "not a Dask task"
        where = {a for a, s in stages_on(client).items() for n, _ in s.values() if n == "pinned"}
        assert where == {gpu}
        model = dt.RemoteModel(
            dict,
            name="nowhere",
            workers=["no-such-worker"],
            allow_other_workers=False,
            scheduler=client,
        )
        with pytest.raises(dt.RemoteModelError, match=r"no-such-worker.*may run on these alone"):
            model.call("keys")


def test_a_killed_worker_costs_a_rebuild_not_a_wrong_answer():
    with (
        heavy_function_on_its_own_cluster(delay=0.2) as (client, f),
        dask.config.set(CHANNEL),
    ):
        assert float(f(np.ones(2))) == 10.0
        victim = next(iter(client.run(os.getpid).values()))
        os.kill(victim, signal.SIGKILL)
        for k in range(3):  # the stages it held are rebuilt where Dask has workers
            assert float(f(np.full(2, k + 2.0))) == 10.0 * (k + 2)


def test_stages_are_released_with_their_function(client):
    w = pytensor.shared(np.ones((4, 3)), name="w")
    x, out = branches(w)
    f = dt.function([x], out, scheduler=client)
    others = stages_on(client)
    with dask.config.set(CHANNEL):
        f(np.zeros(3))
    keys = {key for s in stages_on(client, besides=others).values() for key in s}
    assert keys
    del f
    gc.collect()  # the release runs in a thread (a finalizer may run on Dask's loop)
    deadline = time.monotonic() + 10
    while keys & (left := {k for s in stages_on(client).values() for k in s}):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not keys & left


def test_an_unknown_path_is_refused_naming_the_setting(client):
    x, out = branches(pytensor.shared(np.ones((2, 2))))
    f = dt.function([x], out, scheduler=client)
    with (
        dask.config.set({"dasktensor.execute.path": "fast"}),
        pytest.raises(ValueError, match=r"'dasktensor.execute.path' expected one of channel"),
    ):
        f(np.zeros(2))
