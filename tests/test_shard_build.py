"""Building a sharded function's shards: what the first evaluation pays.

The shards' rows travel straight to their workers, not through the scheduler
(``remote._replicas._sent_ahead``); each shard compiles its partial graph while it is
built, with the first call's arguments (``ShardServer._warm``), while the caller compiles
the combine graph (``Split.warm_combine``), once per process for all copies of a function
(``_shared_runner``).  Real PyMC models on real worker processes; no timings asserted.
"""

from __future__ import annotations

import os
import pickle
import signal

import dask
import numpy as np
import pytest
from _clusters import local_cluster
from _shard_models import hierarchical, linear_regression
from test_sharded import MIN_ROWS, assert_same, compiled, points_for, shards_on

from dasktensor.remote._replicas import SEND_AHEAD_BYTES, _sent_ahead
from dasktensor.sharding._executor import ShardFactory, ShardServer

#: rows whose shards (X, y and X.T: 7 float64 a row) carry more than SEND_AHEAD_BYTES each
BIG = 80_000


@pytest.fixture(scope="module")
def process_cluster():
    """A cluster of this module's own: a test kills a worker."""
    with local_cluster() as cluster:
        yield cluster


def _runner_state(keys, dask_worker=None):
    """On a worker: ``{key: (calls, compiled functions)}`` of the shard stages in ``keys``."""
    replicas = dask_worker.plugins["dasktensor-models"].replicas
    return {
        k: (r.model.calls, len(r.model.runner.compiled_functions))
        for k, r in replicas.items()
        if k in keys
    }


def test_a_large_factory_is_sent_straight_to_its_worker(client):
    workers = sorted(client.scheduler_info()["workers"])
    factory = ShardFactory(lambda rows: (rows.sum(),), [np.ones(SEND_AHEAD_BYTES // 8 + 1)])
    sent = _sent_ahead(client, factory, factory.nbytes, workers[1:])
    assert list(sent) == workers[1:]
    [future] = sent.values()
    assert client.who_has([future])[future.key] == (workers[1],)
    assert client.submit(lambda f: f().run(), future, workers=workers[1:]).result() == [
        np.float64(SEND_AHEAD_BYTES // 8 + 1)
    ]
    small = ShardFactory(lambda rows: (rows.sum(),), [np.ones(4)])
    assert _sent_ahead(client, small, small.nbytes, workers) == {}


# the default-mode function holds the 80,000 rows as constants, which Numba says it cannot
# cache (a warning of the reference, not of the shards)
@pytest.mark.filterwarnings("ignore:Cannot cache compiled function:numba.core.errors.NumbaWarning")
def test_large_shards_equal_the_default_mode_and_survive_a_killed_worker(client):
    f, ref = compiled(linear_regression(BIG), client, block_rows=10_000)
    points = points_for(f, 2)
    assert_same(f, ref, points[:1])
    sizes = [m._spec.factory.nbytes for s in f.maker.linker.sharded.stages() for m in s.models]
    assert len(sizes) == 2 and min(sizes) > SEND_AHEAD_BYTES, sizes
    address = next(a for a, h in shards_on(client, f).items() if h)
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
    assert_same(f, ref, points)  # rebuilt elsewhere, its rows sent ahead again
    held = shards_on(client, f)
    assert address not in held and sum(len(h) for h in held.values()) == 2, held


def test_shards_compile_while_built_and_the_caller_its_combine_graph(client):
    f, ref = compiled(hierarchical(3000), client)
    ex = f.maker.linker.sharded
    (q,) = points_for(f, 1)
    entry = ex.entry_for(client, [q])  # what the first evaluation does before its calls
    keys = [m.key for m in entry.stages.models]
    state = {k: v for found in client.run(_runner_state, keys).values() for k, v in found.items()}
    assert sorted(state) == sorted(keys)
    # compiled on the worker, and run by no call yet
    assert all(calls == 0 and compiled >= 1 for calls, compiled in state.values()), state
    assert len(ex.split.combine.compiled_functions) >= 1
    assert_same(f, ref, [q])


def test_copies_of_a_function_share_one_combine_runner(client):
    f, ref = compiled(linear_regression(3000), client)
    g, _ = compiled(linear_regression(3000), client)
    with dask.config.set(MIN_ROWS):  # (a copy is linked again with the settings)
        copy = pickle.loads(pickle.dumps(f))
    assert g.maker.linker.sharded.split.combine is f.maker.linker.sharded.split.combine
    assert copy.maker.linker.sharded.split.combine is f.maker.linker.sharded.split.combine
    points = points_for(f, 2)
    for fn in (f, g, copy):
        assert_same(fn, ref, points)


def test_a_warm_up_that_fails_leaves_the_error_to_the_first_call():
    def runner(rows, scale):
        if scale == 0:
            raise ZeroDivisionError("scale is 0")
        return ((rows / scale).sum(),)

    server = ShardServer(runner, [np.arange(4.0)], warm=[0.0])  # built all the same
    assert server.run(2.0) == [np.float64(3.0)] and server.calls == 1
    with pytest.raises(ZeroDivisionError, match="scale is 0"):
        server.run(0.0)
