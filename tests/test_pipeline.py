"""Pipelined pmaps: a graph with dt.annotate blocks runs each chunk as a chain of placed
stages, chunks streaming through them, with a bound on the chunks between stages."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import warnings

import dask
import numpy as np
import pytensor.tensor as pt
import pytest
from _stage_ops import OnlyWith, Stamped
from dask.utils import key_split

import dasktensor as dt

X = np.random.default_rng(0).normal(size=(10, 3))


def model(x, annotated: bool, jax: bool = False):
    """An unplaced start, a HOST block, two GPU blocks in a row, an unplaced end with a
    random draw; ``annotated=False`` is the same graph without the blocks."""
    from pytensor.tensor.random.utils import RandomStream

    with warnings.catch_warnings():  # RandomStream's deprecation on PyTensor 3
        warnings.simplefilter("ignore")
        srng = RandomStream(1)
        noise = srng.normal(size=(3,))
    host = dt.annotate(resources={"HOST": 1}, name="host") if annotated else _nothing()
    gpu = {"resources": {"GPU": 1}, "mode": "JAX" if jax else None}
    a = pt.exp(x) * 2
    with host:
        b = pt.tanh(a).sum() + a
    with dt.annotate(**gpu, name="gpu") if annotated else _nothing():
        c = pt.sin(b) * 3
    with dt.annotate(**gpu, name="gpu-more") if annotated else _nothing():
        d = c**2 + 1
    return d + noise, b


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_stages_follow_the_blocks_and_blocks_of_one_placement_fuse():
    g = dt.pmap(lambda x: model(x, True), chunks=3, random_seed=5)
    with pytest.raises(RuntimeError, match="call the pmap first"):
        _ = g.plan
    y = g(X)
    plan = g.plan
    assert [s.name for s in plan.stages] == ["pre", "host", "gpu-gpu-more", "post"]
    assert [s.blocks for s in plan.stages] == [(), ("host",), ("gpu", "gpu-more"), ()]
    assert [s.placement.resources for s in plan.stages] == [None, {"HOST": 1}, {"GPU": 1}, None]
    assert [s.deps for s in plan.stages] == [(), (0,), (1,), (0, 2)]
    text = str(plan)
    assert "pmap-host: blocks host" in text and "Placement(resources={'GPU': 1})" in text
    assert "at most 4 chunk(s) in flight per stage" in text
    assert repr(g).startswith("<pmap 'pmap': 4 stage(s) per chunk")
    # the stages' names are the keys' names: the task stream shows them per chunk
    names = [key_split(k) for k in dict(y[0].dask)]
    for stage in ("pmap-pre", "pmap-host", "pmap-gpu-gpu-more", "pmap-post"):
        assert names.count(stage) == 4  # 10 elements in chunks of 3


def test_a_graph_without_blocks_keeps_one_task_per_chunk():
    g = dt.pmap(lambda x: model(x, False), chunks=3, random_seed=5)
    y = g(X)
    assert g.plan is None and repr(g) == "<pmap 'pmap': one task per chunk>"
    assert sorted(key_split(k) for k in dict(y[0].dask)).count("pmap") == 4 + 4  # + outputs
    assert not any("stage" in key_split(k) or "pre" in key_split(k) for k in dict(y[0].dask))


@pytest.mark.parametrize("inflight", [1, 4])
def test_values_and_draws_equal_the_unannotated_function(inflight):
    with dask.config.set({"dasktensor.pmap.inflight": inflight, "scheduler": "threads"}):
        placed = dt.pmap(lambda x: model(x, True), chunks=2, random_seed=5)(X)
        plain = dt.pmap(lambda x: model(x, False), chunks=2, random_seed=5)(X)
        got, want = dask.compute(*placed), dask.compute(*plain)
        again = dask.compute(*placed)
    for a, b, c in zip(got, want, again):
        np.testing.assert_allclose(a, b, rtol=1e-12)
        np.testing.assert_array_equal(a, c)  # a lazy result computed twice: the same draws
    other = dt.pmap(lambda x: model(x, True), chunks=2, random_seed=6)(X)[0].compute()
    assert not np.allclose(other, got[0])


def test_a_lazy_result_without_blocks_draws_the_same_numbers_when_computed_again():
    y = dt.pmap(lambda x: model(x, False), chunks=2, random_seed=5)(X)[0]
    with dask.config.set(scheduler="threads"):
        np.testing.assert_array_equal(y.compute(), y.compute())


#: run in a child process: JAX runs in worker processes only in this suite (a process
#: that ran JAX warns when it forks, and later tests fork: pm.sample(cores=2))
_JAX_CHILD = """
import json, sys, warnings
import dask, numpy as np, pytensor.tensor as pt
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import dasktensor as dt
import dasktensor.engine._runners as runners
from test_pipeline import X, model

seen = []
original = runners._as_numpy
def counting(x):
    seen.append(type(x).__name__)
    return original(x)
runners._as_numpy = counting

out = {{}}
g = dt.pmap(lambda x: model(x, True, jax=True), chunks=5, random_seed=5)
y = g(X)
out["fused"] = [[s.name, list(s.blocks), s.placement.mode] for s in g.plan.stages]
with dask.config.set(scheduler="sync"):
    got = dask.compute(*y)
    want = dask.compute(*dt.pmap(lambda x: model(x, False), chunks=5, random_seed=5)(X))
out["fused_conversions"] = list(seen)
out["fused_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))

x = pt.vector("x")
with dt.annotate(mode="JAX", name="first"):
    a = pt.sin(x) * 2
with dt.annotate(mode="JAX", retries=1, name="second"):
    b = pt.exp(a).sum()
g = dt.pmap(([x], b), chunks=5)
y = g(X)
out["apart"] = [s.name for s in g.plan.stages]
seen.clear()
with dask.config.set(scheduler="sync"):
    out["apart_diff"] = float(np.max(np.abs(y.compute() - np.exp(np.sin(X) * 2).sum(axis=1))))
out["apart_conversions"] = list(seen)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def jax_child() -> dict:
    pytest.importorskip("jax")
    script = _JAX_CHILD.format(tests=str(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_two_jax_blocks_in_a_row_are_one_jax_function(jax_child):
    """The two GPU blocks (mode="JAX") fuse into one stage compiled with JAX: one
    conversion to NumPy per chunk (its one output); the intermediate between the blocks
    stayed a JAX array inside one JAX function."""
    assert ["gpu-gpu-more", ["gpu", "gpu-more"], "JAX"] in jax_child["fused"]
    conversions = jax_child["fused_conversions"]
    assert len(conversions) == 2 and all("Array" in n for n in conversions), conversions
    assert jax_child["fused_diff"] < 1e-6


def test_jax_blocks_of_different_placements_hand_numpy_arrays_on(jax_child):
    """The counterpart: blocks that cannot fuse convert at each stage's end."""
    assert jax_child["apart"] == ["first", "second"]
    assert len(jax_child["apart_conversions"]) == 4
    assert jax_child["apart_diff"] < 1e-6


def test_a_bad_inflight_setting_fails_clearly():
    g = dt.pmap(lambda x: model(x, True), chunks=2)
    with (
        dask.config.set({"dasktensor.pmap.inflight": 0}),
        pytest.raises(ValueError, match=r"pmap.inflight' expected an int >= 1, got 0"),
    ):
        g(X)


# ----------------------------------------------------------------- on a cluster of three


@pytest.fixture(scope="module")
def staged_cluster():
    """Worker processes: two offer {"HOST": 1}, one {"GPU": 1}."""
    from distributed import Nanny, Scheduler, SpecCluster

    def worker(resources):
        return {
            "cls": Nanny,
            "options": {"nthreads": 1, "host": "127.0.0.1", "resources": resources},
        }

    with SpecCluster(
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}},
        workers={
            "host-a": worker({"HOST": 1}),
            "host-b": worker({"HOST": 1}),
            "gpu": worker({"GPU": 1}),
        },
    ) as cluster:
        yield cluster


@pytest.fixture
def staged(staged_cluster):
    from distributed import Client

    with Client(staged_cluster) as client:  # the default client while the test runs
        client.wait_for_workers(3, timeout=60)
        yield client


def stamped(host_seconds: float, gpu_seconds: float):
    """A pmap: a HOST block and a GPU block, each a Stamped op; returns the values and
    the two stamps per element."""

    def fn(x):
        with dt.annotate(resources={"HOST": 1}, name="host"):
            y, host = Stamped(host_seconds, "HOST")(x * 2.0)
        with dt.annotate(resources={"GPU": 1}, name="gpu"):
            z, gpu = Stamped(gpu_seconds, "GPU")(pt.sqrt(y))
        return z, host, gpu

    return dt.pmap(fn, chunks=1, name="staged")


def test_each_block_runs_on_a_worker_offering_its_resource(staged):
    x = np.abs(X[:6]) + 1.0
    z, host, gpu = stamped(0.0, 0.0)(x, compute=True, progressbar=False)
    np.testing.assert_allclose(z, np.sqrt(x * 2.0 + 1.0) + 1.0, rtol=1e-12)
    assert (host[:, 2] == 1.0).all() and (gpu[:, 2] == 1.0).all()  # asked in the stage
    by_resource = {
        next(iter(w["resources"])): pid
        for pid, w in zip(
            staged.run(os.getpid).values(), staged.scheduler_info(n_workers=-1)["workers"].values()
        )
    }
    assert set(gpu[:, 3]) == {by_resource["GPU"]}


def test_a_lazy_result_computed_by_dask_keeps_the_placement(staged):
    """Dask's array optimisation fuses tasks and drops layer annotations; the stages of
    a lazy result computed by ``dask.compute`` still run where their blocks say."""
    x = np.abs(X[:6]) + 1.0
    z, host, gpu = dask.compute(*stamped(0.0, 0.0)(x))  # optimised, on the default client
    np.testing.assert_allclose(z, np.sqrt(x * 2.0 + 1.0) + 1.0, rtol=1e-12)
    assert (host[:, 2] == 1.0).all() and (gpu[:, 2] == 1.0).all()
    assert len(set(host[:, 3]) & set(gpu[:, 3])) == 0  # the two stages were never fused


@pytest.mark.parametrize("inflight", [4, 1])
def test_chunks_stream_through_the_stages(staged, inflight):
    """The next chunk's HOST stage runs while the GPU worker runs a chunk's GPU stage:
    taking the chunks in the order the GPU ran them, each next chunk's first stage began
    before the previous chunk's second stage ended.  With ``inflight=1`` the chunks go one
    after another, and none does.  The intervals are measured inside the stages."""
    n = 8
    g = stamped(0.15, 0.15)
    with dask.config.set({"dasktensor.pmap.inflight": inflight}):
        g(np.ones((n, 2)), compute=True, progressbar=False)  # compiles the stages
        _, host, gpu = g(np.ones((n, 2)), compute=True, progressbar=False)
    order = np.argsort(gpu[:, 0])
    streamed = [int(b) for a, b in itertools.pairwise(order) if host[b, 0] < gpu[a, 1]]
    wall = max(gpu[:, 1]) - min(host[:, 0])
    print(
        f"inflight={inflight}: chunks whose HOST stage began before the previous GPU "
        f"stage ended: {streamed}; wall {wall:.2f} s for {n} x (0.15 + 0.15) s of stages"
    )
    if inflight == 1:
        assert streamed == []
    else:
        assert len(streamed) >= n - 2


@pytest.mark.parametrize("inflight", [2, 100])
def test_backpressure_bounds_the_chunks_waiting_between_stages(staged, inflight):
    """A GPU stage 6x slower than the HOST stage: with inflight=2 a HOST stage of chunk
    i starts only after the GPU stage of chunk i - 2 has ended, and no more than 2
    chunks' HOST outputs wait at any moment; with 100 they pile up."""
    n = 16
    with dask.config.set({"dasktensor.pmap.inflight": inflight}):
        _, host, gpu = stamped(0.01, 0.06)(np.ones((n, 2)), compute=True, progressbar=False)
    # chunks whose HOST output waits for its GPU stage, at each moment a HOST stage ends
    waiting = max(
        int(np.sum((host[:, 1] <= t) & (gpu[:, 1] > t))) for t in host[:, 1]
    )  # fmt: skip
    print(f"inflight={inflight}: at most {waiting} HOST outputs waited for the GPU stage")
    if inflight == 2:
        assert all(host[i, 0] >= gpu[i - inflight, 1] for i in range(inflight, n))
        assert waiting <= inflight
    else:
        assert waiting > 4  # the bound above is the setting's doing


def test_a_worker_killed_mid_pipeline_loses_nothing(staged):
    """A HOST worker is killed while chunks are in the pipeline: the chunk stages it held
    are computed again (Dask recomputes lost keys; the nanny restarts the process), and
    the values are those of the run without the fault."""
    x = np.abs(X) + 1.0
    g = stamped(0.1, 0.1)
    want = np.sqrt(x * 2.0 + 1.0) + 1.0
    host_pid = next(
        pid
        for address, pid in staged.run(os.getpid).items()
        if "HOST" in staged.scheduler_info(n_workers=-1)["workers"][address]["resources"]
    )
    killer = threading.Timer(0.6, os.kill, (host_pid, signal.SIGKILL))
    killer.start()
    try:
        z, _, _ = g(x, compute=True, progressbar=False)
    finally:
        killer.join()
    np.testing.assert_allclose(z, want, rtol=1e-12)
    assert host_pid not in staged.run(os.getpid).values()  # the kill did happen
    staged.wait_for_workers(3, timeout=60)


def test_a_resource_no_worker_offers_fails_clearly(staged):
    x = pt.vector("x")
    with dt.annotate(resources={"TPU": 1}, name="tpu"):
        y = pt.exp(x)
    g = dt.pmap(([x], y), chunks=2)
    with (
        dask.config.set({"dasktensor.placement.resource-timeout": "0.5s"}),
        pytest.raises(dt.NoWorkerWithResourcesError, match=r"offers the resources \{'TPU'"),
    ):
        g(X)


def test_the_task_stream_shows_each_chunks_stages(staged):
    from distributed import get_task_stream

    with get_task_stream(staged) as ts:
        stamped(0.0, 0.0)(np.ones((5, 2)), compute=True, progressbar=False)
    names = [key_split(t["key"]) for t in ts.data]
    assert names.count("staged-host") == 5 and names.count("staged-gpu") == 5


def test_a_posterior_predictive_runs_its_surrogate_block_on_the_gpu_worker(staged):
    """PyMC's linear regression with its mean in an annotated block that checks, where it
    runs, that the worker offers a GPU: the draws equal those of the model without it."""
    import pymc as pm
    from _pymc_models import RNG, X, group_of, linear_regression, trace

    _, idata = trace("linear-regression")
    with pm.Model(coords={"obs": np.arange(len(X))}) as placed:
        a = pm.Normal("a", 0.0, 5.0)
        b = pm.Normal("b", 0.0, 5.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        with dt.annotate(resources={"GPU": 1}, name="surrogate"):
            mu = OnlyWith("GPU")(a + b * X)
        # (no Deterministic: PyMC would take mu from the trace and never run the block)
        pm.Normal("y", mu, sigma, observed=RNG.normal(size=30))

    def draws(model, **kwargs):
        result = dt.sample_posterior_predictive(
            idata, model=model, random_seed=7, chunks=100, compute=True, progressbar=False,
            **kwargs,
        )  # fmt: skip
        return np.asarray(group_of(result)["y"])

    got = draws(placed, client=staged)
    np.testing.assert_allclose(got, draws(linear_regression()), rtol=1e-12)
