"""dt.function behaves like pytensor.function: pickling, copies, threads, event loops."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import threading

import cloudpickle
import dask
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _ops import Scale

import dasktensor as dt

HERE = pathlib.Path(__file__).parent


def heavy_graph():
    x = pt.vector("x")
    a = Scale(2.0)(pt.exp(x))
    b = Scale(3.0)(pt.sin(x))
    return x, [(a + b).sum(), a]


def test_pytensor_function_accepts_the_registered_mode():
    x, outs = heavy_graph()
    f = pytensor.function([x], outs, mode="DASK")
    assert isinstance(f.maker.linker, dt.DaskLinker)
    assert len(f.maker.linker.plan.tasks) > 1
    ref = pytensor.function([x], outs)
    for g, w in zip(f(np.arange(3.0)), ref(np.arange(3.0))):
        np.testing.assert_allclose(g, w)


def test_dt_function_refuses_a_mode_argument():
    x = pt.vector("x")
    with pytest.raises(TypeError, match="takes no mode="):
        dt.function([x], x, mode="FAST_RUN")


def test_pickled_function_works_in_another_process(tmp_path):
    x, outs = heavy_graph()
    f = dt.function([x], outs)
    path = tmp_path / "f.pkl"
    path.write_bytes(cloudpickle.dumps(f))
    code = (
        "import pickle, sys, numpy as np; "
        f"f = pickle.loads(open({str(path)!r}, 'rb').read()); "
        "print(repr([np.asarray(v).tolist() for v in f(np.arange(3.0))]))"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = eval(out.stdout.strip().splitlines()[-1])
    want = [np.asarray(v).tolist() for v in f(np.arange(3.0))]
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1])


def test_pickled_function_keeps_its_cluster(client):
    x, outs = heavy_graph()
    f = dt.function([x], outs, scheduler=client)
    g = cloudpickle.loads(cloudpickle.dumps(f))
    np.testing.assert_allclose(g(np.arange(3.0))[0], f(np.arange(3.0))[0])
    assert g.maker.linker.executor.scheduler.address == client.scheduler.address


def test_copy_shares_shared_variables_and_updates():
    x = pt.vector("x")
    acc = pytensor.shared(np.zeros(2), name="acc")
    f = dt.function([x], Scale(1.0)(x).sum(), updates={acc: acc + Scale(1.0)(x)})
    g = f.copy()
    f(np.ones(2))
    g(np.ones(2))
    np.testing.assert_allclose(acc.get_value(), [2.0, 2.0])


def test_concurrent_calls_from_eight_threads():
    x, outs = heavy_graph()
    f = dt.function([x], outs)
    ref = pytensor.function([x], outs)
    inputs = [np.linspace(0, 1, 4) * i for i in range(8)]
    expected = [ref(v) for v in inputs]
    results: dict[int, list] = {}
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            results[i] = [f(inputs[i]) for _ in range(5)]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        for got in results[i]:
            np.testing.assert_allclose(got[0], expected[i][0])
            np.testing.assert_allclose(got[1], expected[i][1])


def test_a_runner_pickled_by_several_threads_at_once_pickles_whole_in_each():
    """Threads that submit one graph at once pickle its runners at once: none may see
    the pickled subgraph before its token (CI saw ``no attribute '_token'``)."""
    import pickle

    from dasktensor.engine._runners import TaskRunner

    x = pt.vector("x")
    outs = [pt.exp(x).sum() + pt.sin(x).sum() * i for i in range(1, 4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            runner = TaskRunner([x], outs, name="shared")
            barrier = threading.Barrier(4)
            pickled, errors = [], []

            def dump(runner=runner, barrier=barrier, pickled=pickled, errors=errors):
                barrier.wait()
                try:
                    pickled.append(pickle.dumps(runner))
                except Exception as exc:  # noqa: BLE001 - the failure is the finding
                    errors.append(exc)

            threads = [threading.Thread(target=dump) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert len(set(pickled)) == 1
    finally:
        sys.setswitchinterval(interval)
    copy = pickle.loads(pickled[0])
    np.testing.assert_allclose(copy(np.arange(3.0)), runner(np.arange(3.0)))


@pytest.mark.parametrize("where", ["threads", "cluster"])
def test_calls_inside_a_running_loop_and_after_asyncio_run(where, request):
    scheduler = request.getfixturevalue("client") if where == "cluster" else None
    x, outs = heavy_graph()
    f = dt.function([x], outs, scheduler=scheduler)
    want = f(np.arange(3.0))[0]

    async def main():
        inside = f(np.arange(3.0))[0]  # a sync call inside a running loop (Jupyter)
        awaited = await f.acall(np.arange(3.0))
        both = await asyncio.gather(f.acall(np.arange(3.0)), f.acall(np.arange(3.0)))
        return inside, awaited[0], [b[0] for b in both]

    inside, awaited, both = asyncio.run(main())
    after = f(np.arange(3.0))[0]  # after asyncio.run() closed its loop
    for v in (inside, awaited, *both, after):
        np.testing.assert_allclose(v, want)


def test_to_dask_returns_delayed_objects_with_readable_keys():
    from dask.utils import key_split

    x, outs = heavy_graph()
    f = dt.function([x], outs)
    total, a = f.to_dask(np.arange(3.0))
    prefixes = {key_split(k) for k in total.__dask_graph__()}
    assert "scale-heavy" in prefixes
    got_total, got_a = dask.compute(total, a, scheduler="sync")
    want = f(np.arange(3.0))
    np.testing.assert_allclose(got_total, want[0])
    np.testing.assert_allclose(got_a, want[1])
    with pytest.raises(TypeError, match="expected 1 input value"):
        f.to_dask()


def test_plan_is_printable_and_explains_the_partition():
    x, outs = heavy_graph()
    text = str(dt.function([x], outs).plan)
    assert "scale-heavy" in text and "marked heavy" in text and "on cluster" in text
