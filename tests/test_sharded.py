"""Sharded execution (``dasktensor.sharding._executor``): sums over data rows split over workers.

Real PyMC models, compiled as ``pm.sample`` compiles them
(``model.logp_dlogp_function(ravel_inputs=True, mode=...)``), on real worker processes.
The data are small (a few thousand rows) and ``dasktensor.shard.min-rows``,
``dasktensor.shard.min-work`` and ``dasktensor.shard.block-rows`` are lowered while
compiling, so that the tests stay fast and shards run their rows in several blocks;
values and gradients must equal the default mode's to round-off (sharding changes the
order of additions only).
"""

from __future__ import annotations

import os
import signal
import time

import dask
import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from _clusters import eventually, local_cluster
from _shard_models import (
    ar1_data_model,
    data_model,
    design,
    gp_model,
    hierarchical,
    linear_regression,
    logistic_regression,
)
from distributed import Client, LocalCluster

import dasktensor as dt
from dasktensor.cluster import scheduler_workers
from dasktensor.sharding._executor import ShardServer
from dasktensor.sharding._policy import check_shards

N = 3000
# small data sharded all the same: fewer rows, no least work per shard, and shards that
# run their rows in several blocks (1,500 rows per shard: 400, 400, 400, 300)
BLOCK_ROWS = 400
MIN_ROWS = {
    "dasktensor.shard.min-rows": 1000,
    "dasktensor.shard.min-work": 0,
    "dasktensor.shard.block-rows": BLOCK_ROWS,
}
RTOL = 1e-10


# ----------------------------------------------------------------------------- helpers


def compiled(model, scheduler, shards=2, min_rows=1000, min_work=0, block_rows=BLOCK_ROWS):
    """(DASK-mode logp+dlogp function with sharding, default-mode function)."""
    settings = {
        "dasktensor.shard.min-rows": min_rows,
        "dasktensor.shard.min-work": min_work,
        "dasktensor.shard.block-rows": block_rows,
    }
    with dask.config.set(settings):
        mode = dt.dask_mode(scheduler=scheduler, shards=shards)
        f = model.logp_dlogp_function(ravel_inputs=True, mode=mode)._pytensor_function
    ref = model.logp_dlogp_function(ravel_inputs=True)._pytensor_function
    return f, ref


def points_for(f, n=3, scale=0.3):
    size = f.maker.fgraph.inputs[0].type.shape
    rng = np.random.default_rng(11)
    return [rng.normal(scale=scale, size=size) for _ in range(n)]


def assert_same(f, ref, points, rtol=RTOL):
    for q in points:
        got, want = f(q), ref(q)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-12)


def _shards_here(keys, dask_worker=None):
    """On a worker: ``{key: (bytes held, bytes received by calls, calls)}`` of the shard
    stages among ``keys`` it holds."""
    host = dask_worker.plugins.get("dasktensor-models")
    replicas = getattr(host, "replicas", {})
    return {
        k: (r.model.held, r.model.received, r.model.calls)
        for k, r in replicas.items()
        if k in keys and type(r.model).__name__ == ShardServer.__name__
    }


def shards_on(client, f) -> dict[str, dict]:
    keys = [m.key for s in f.maker.linker.sharded.stages() for m in s.models]
    return client.run(_shards_here, keys)


# ----------------------------------------------------------------------------- sharded


@pytest.mark.parametrize(
    "make", [linear_regression, logistic_regression, hierarchical], ids=lambda m: m.__name__
)
def test_models_shard_one_per_worker_and_equal_the_default_mode(client, make):
    f, ref = compiled(make(N), client)
    text = str(f.maker.linker.plan)
    assert "sharded: into 2 shards (shards=2)" in text and f"the {N} rows" in text
    assert_same(f, ref, points_for(f))
    assert f"now: 2 shards of ~{N // 2} rows on" in str(f.maker.linker.plan)
    held = shards_on(client, f)
    assert sorted(len(h) for h in held.values()) == [1, 1], held  # one shard per worker
    assert f.maker.linker.sharded.stats["builds"] == 1


def _blocks_here(keys, dask_worker=None):
    """On a worker: ``{key: number of row blocks}`` of the shard stages among ``keys``."""
    replicas = dask_worker.plugins["dasktensor-models"].replicas
    return {k: len(r.model.ranges) for k, r in replicas.items() if k in keys}


@pytest.mark.parametrize("block_rows", [0, BLOCK_ROWS, 1], ids=["whole", "blocks", "rows"])
def test_shards_run_their_rows_in_blocks(client, block_rows):
    f, ref = compiled(hierarchical(N), client, block_rows=block_rows)
    assert_same(f, ref, points_for(f))
    keys = [m.key for s in f.maker.linker.sharded.stages() for m in s.models]
    blocks = sorted(n for b in client.run(_blocks_here, keys).values() for n in b.values())
    expected = {0: 0, BLOCK_ROWS: -(-(N // 2) // BLOCK_ROWS), 1: N // 2}[block_rows]
    assert blocks == [expected, expected]


def test_a_failed_parameter_check_costs_a_second_round(client):
    _, y = design(N)
    xs = np.random.default_rng(3).uniform(0.5, 1.0, N)
    with pm.Model() as model:
        p = pm.Flat("p")  # not transformed: p * xs > 1 fails Bernoulli's check (row by row)
        pm.Bernoulli("y", p=p * xs, observed=(y > 0).astype("int64"))
    f, ref = compiled(model, client)
    stats = f.maker.linker.sharded.stats
    assert "assumed true: 1 check" in str(f.maker.linker.plan)
    assert_same(f, ref, [np.array([0.3])])
    assert stats["rounds"] == stats["calls"] == 1
    got, want = f(np.array([1.5])), ref(np.array([1.5]))
    assert got[0] == want[0] == -np.inf
    assert stats["rounds"] == 3 and stats["calls"] == 2


def test_shard_data_is_sent_once_not_per_call(client):
    f, _ = compiled(linear_regression(N), client)
    q = points_for(f, 1)[0]
    f(q)
    before = {k: v for h in shards_on(client, f).values() for k, v in h.items()}
    stats = dict(f.maker.linker.sharded.stats)
    for _ in range(10):
        f(q)
    after = {k: v for h in shards_on(client, f).values() for k, v in h.items()}
    X_bytes = N * 3 * 8
    assert sum(v[0] for v in after.values()) >= 2 * X_bytes  # X and X.T, held
    # ten calls sent each shard the 5 parameters (40 bytes), nothing else
    assert all(after[k][2] - before[k][2] == 10 for k in after)
    assert all(after[k][1] - before[k][1] == 10 * q.nbytes for k in after)
    sent = f.maker.linker.sharded.stats["bytes_sent"] - stats["bytes_sent"]
    assert sent == 10 * 2 * q.nbytes


def test_a_shared_parameter_that_changes_is_sent_not_a_rebuild(client):
    import pytensor

    y = pt.constant(np.linspace(0.0, 1.0, N), name="y")
    mu = pytensor.shared(0.5, name="mu")  # e.g. PyMC's extra_vars, set before each call
    s = pt.dscalar("s")
    with dask.config.set(MIN_ROWS):
        f = dt.function([s], ((y - mu) ** 2 / s).sum(), scheduler=client, shards=2)
    ex = f.maker.linker.sharded
    for value in (0.1, 0.2, 0.3):
        mu.set_value(value)
        np.testing.assert_allclose(f(2.0), ((np.linspace(0, 1, N) - value) ** 2).sum() / 2)
    assert ex.stats["builds"] == 1 and ex.stats["calls"] == 3


def test_copies_and_pickles_of_a_sharded_function_shard_again(client):
    import pickle

    f, ref = compiled(linear_regression(N), client)
    points = points_for(f, 2)
    with dask.config.set(MIN_ROWS):  # the setting is read when a copy is linked
        copies = (f.copy(), pickle.loads(pickle.dumps(f)))
    for g in copies:
        assert_same(g, ref, points)
        assert "sharded: into 2 shards" in str(g.maker.linker.plan)
        assert g.maker.linker.sharded.stats["calls"] == 2


def test_data_model_follows_set_data(client):
    model = data_model(N)
    f, ref = compiled(model, client)
    ex = f.maker.linker.sharded
    text = str(f.maker.linker.plan)
    assert "X (axis 0)" in text and "y_obs (axis 0)" in text
    points = points_for(f, 2)
    assert_same(f, ref, points)
    first = [m.key for s in ex.stages() for m in s.models]
    # new values, same length: the shards are cut and sent again, the old ones released
    X2, y2 = design(N, rng=1)
    pm.set_data({"X": X2, "y_obs": y2}, model=model)
    assert_same(f, ref, points)
    assert ex.stats["builds"] == 2
    held = shards_on(client, f)
    assert sorted(len(h) for h in held.values()) == [1, 1]

    def released():  # in a thread of the caller's (the release may not run on Dask's loop)
        return not {k for h in client.run(_shards_here, first).values() for k in h}

    assert eventually(released), "the stages of the old data were not released"
    # a new length: the shards are found again (N - 500 rows), and used
    X3, y3 = design(N - 500, rng=2)
    pm.set_data({"X": X3, "y_obs": y3}, model=model)
    assert_same(f, ref, points)
    assert ex.stats["builds"] == 3 and f"the {N - 500} rows" in str(f.maker.linker.plan)
    assert sum(v[0] for h in shards_on(client, f).values() for v in h.values()) == (
        X3.nbytes + y3.nbytes
    )


# ----------------------------------------------------------------------------- not sharded


@pytest.mark.parametrize(
    "make, why",
    [(lambda: gp_model(60), "MvNormal"), (lambda: ar1_data_model(N), "shifts rows")],
    ids=["gp", "ar1-data"],
)
def test_models_that_are_not_sums_over_rows_say_why(client, make, why):
    model = make()
    f, ref = compiled(model, client, min_rows=50)
    text = str(f.maker.linker.plan)
    assert "not sharded:" in text and why in text, text
    assert f.maker.linker.sharded is None
    # The GP's Cholesky runs in a worker process whose BLAS has its own thread count:
    # LAPACK's blocking then differs in the last digits (2.5e-10 measured on CI).
    assert_same(f, ref, points_for(f, 2, scale=0.1), rtol=1e-8)


def test_turned_off_and_without_a_client(client):
    f, ref = compiled(linear_regression(N), client, shards=False)
    assert "not sharded: turned off (shards=False)" in str(f.maker.linker.plan)
    # a sharded function with the local scheduler: unsharded, in this process
    g, _ = compiled(linear_regression(N), "threads")
    assert "sharded: into 2 shards" in str(g.maker.linker.plan)
    assert_same(g, ref, points_for(g, 2))
    assert g.maker.linker.sharded.stats == {"calls": 0, "rounds": 0, "bytes_sent": 0, "builds": 0}
    with pytest.raises(ValueError, match="shards"):
        check_shards(-1)


def test_the_cost_estimate_decides_whether_and_into_how_many_shards(client):
    model = linear_regression(N)
    plan = compiled(model, client, shards=2)[0].maker.linker.sharded.split.plan
    # a few thousand rows are far less than two shards' worth of the default min-work
    f, ref = compiled(model, client, shards=None, min_work=dt_default("shard.min-work"))
    text = str(f.maker.linker.plan)
    assert "not sharded: the estimated work of an evaluation" in text, text
    assert f"{plan.work:.1e} element operations over {N} rows" in text
    assert f.maker.linker.sharded is None
    assert_same(f, ref, points_for(f, 2))
    # work for 1.5 shards: unsharded; for 2.5: one shard per worker (2); shards=K overrides
    assert (
        compiled(model, client, shards=None, min_work=plan.work / 1.5)[0].maker.linker.sharded
        is None
    )
    g, _ = compiled(model, client, shards=None, min_work=plan.work / 2.5)
    assert_same(g, ref, points_for(g, 2))
    assert [len(s.models) for s in g.maker.linker.sharded.stages()] == [2]
    h, _ = compiled(model, client, shards=3, min_work=plan.work)
    assert_same(h, ref, points_for(h, 1))
    assert [len(s.models) for s in h.maker.linker.sharded.stages()] == [3]


def dt_default(key: str):
    """A dasktensor setting's value as shipped (dasktensor.yaml)."""
    import yaml

    import dasktensor

    with open(os.path.join(os.path.dirname(dasktensor.__file__), "dasktensor.yaml")) as f:
        value = yaml.safe_load(f)["dasktensor"]
    for part in key.split("."):
        value = value[part]
    return value


def test_one_worker_is_not_sharded():
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        f, ref = compiled(linear_regression(N), client, shards=None)
        assert "one shard per worker" in str(f.maker.linker.plan)
        assert_same(f, ref, points_for(f, 2))
        assert "now: unsharded" in str(f.maker.linker.plan)
        assert f.maker.linker.sharded.stats["calls"] == 0


def test_remote_model_prefers_its_workers(client):
    workers = sorted(scheduler_workers(client))
    for target in workers:
        model = dt.RemoteModel(dict, name="pinned", replicas=1, workers=[target], scheduler=client)
        try:
            assert model.start() == [target]
            assert model.preferred_workers == (target,)
        finally:
            model.close()


def test_factories_carrying_data_build_without_dasks_large_graph_warning(client):
    from concurrent.futures import ThreadPoolExecutor

    from dasktensor.sharding._executor import ShardFactory

    rows = np.ones(12 * 2**20 // 8)  # over Dask's 10 MiB warning threshold
    models = [
        dt.RemoteModel(ShardFactory(np.sum, [rows]), name="big", replicas=1, scheduler=client)
        for _ in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:  # (warnings are errors in this test suite)
            assert all(pool.map(lambda m: m.start(), models))
    finally:
        for m in models:
            m.close()
    assert dask.config.get("distributed.admin.large-graph-warning-threshold") == "10MB"


# ----------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_a_killed_worker_holding_a_shard_costs_a_rebuild_not_a_wrong_answer():
    """The lost shard is rebuilt with its rows, without waiting for Dask's connect
    timeout: looking for the shard asks the workers the scheduler listed a moment
    before, the killed one among them, and Dask retries a dead worker's address until
    that timeout (120 s here; the rebuild took 60 s more at Dask's default 30 s)."""
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "120s"}),
        local_cluster() as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        f, ref = compiled(hierarchical(N), client)
        points = points_for(f, 3)
        assert_same(f, ref, points[:1])
        address = next(a for a, h in shards_on(client, f).items() if h)
        os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
        t0 = time.monotonic()
        assert_same(f, ref, points)  # the lost shard is rebuilt, with its rows
        took = time.monotonic() - t0
        held = shards_on(client, f)
        assert address not in held and sum(len(h) for h in held.values()) == 2, held
    print(f"a killed worker's shard: the next evaluations took {took:.1f} s")
    assert took < 60, f"{took:.1f} s: a wait for Dask's connect timeout (120 s here)?"


# ----------------------------------------------------------------------------- pm.sample


def draws(model, **kwargs):
    with model:
        idata = pm.sample(
            draws=20,
            tune=20,
            chains=kwargs.pop("chains", 1),
            cores=kwargs.pop("cores", 1),
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
            nuts_sampler="pymc",
            **kwargs,
        )
    return {v.name: idata.posterior[v.name].values for v in model.free_RVs}


FORK_WARNING = r"ignore:This process \(pid=\d+\) is multi-threaded:DeprecationWarning"


def _shard_calls(dask_worker=None) -> int:
    """On a worker: calls answered by all the shard stages it holds."""
    host = dask_worker.plugins.get("dasktensor-models")
    replicas = getattr(host, "replicas", {}).values()
    return sum(r.model.calls for r in replicas if type(r.model).__name__ == "ShardServer")


@pytest.mark.slow
@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.parametrize("cores", [1, 2])
def test_pm_sample_in_the_dask_mode_draws_as_the_default_mode(process_cluster, cores):
    expected = draws(linear_regression(N), chains=cores, cores=cores)
    with Client(process_cluster) as c, dask.config.set(MIN_ROWS):  # the default client
        before = c.run(_shard_calls)
        mode = {"mode": "DASK"}
        got = draws(linear_regression(N), chains=cores, cores=cores, compile_kwargs=mode)
        after = c.run(_shard_calls)
    # every worker computed its shard of (nearly) every evaluation of the sampler(s)
    assert all(after[w] - before[w] > 40 * cores for w in after), (before, after)
    # the order of additions differs (two partial sums): the draws agree to round-off
    # (about 1e-12 after 40 iterations), not bit for bit
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-8)
