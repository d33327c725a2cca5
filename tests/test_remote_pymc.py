"""pm.sample with remote models: the same draws as the model computed locally, in one
process, in two forked or spawned sampler processes, and in the DASK mode."""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytest
from test_pymc import FORK_WITH_THREADS

from dasktensor.cli import _demo

SEED = 20261130
SETTINGS = {"draws": 20, "tune": 20, "random_seed": SEED, "progressbar": False}
DELAY = 0.002
_REFERENCE: dict = {}


def sample(model, chains: int, **kwargs) -> dict[str, np.ndarray]:
    with model, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded, use of fork.*")
        idata = pm.sample(
            chains=chains, cores=chains, compute_convergence_checks=False, **SETTINGS, **kwargs
        )
    return {v: idata.posterior[v].values for v in ("mu", "log_sigma")}


def local_draws(chains: int) -> dict[str, np.ndarray]:
    """The same sites computed in this process, one call after another."""
    if chains not in _REFERENCE:
        model = _demo.build_model(_demo.local_site_ops(4, DELAY))
        _REFERENCE[chains] = sample(model, chains, compile_kwargs={"mode": _demo.serial_mode()})
    return _REFERENCE[chains]


def calls_on_workers(client, models) -> dict[str, int]:
    """How many times each worker's replicas were called."""

    def count(keys, dask_worker=None):
        from dasktensor_worker.plugin import host_of

        host = host_of(dask_worker)
        return sum(host.replicas[k].model.calls for k in keys if k in host.replicas)

    return client.run(count, [m.key for m in models])


@pytest.fixture
def sites(client):
    models = _demo.remote_sites(4, DELAY, scheduler=client)
    yield models
    for m in models:
        m.close()


@pytest.mark.slow
@FORK_WITH_THREADS
@pytest.mark.parametrize(
    "chains, mp_ctx",
    [(1, None), (2, None), (2, "spawn")],
    ids=["one-process", "two-processes-default", "two-processes-spawn"],
)
def test_sample_with_remote_models_gives_the_local_draws(client, sites, chains, mp_ctx):
    kwargs = {} if mp_ctx is None else {"mp_ctx": mp_ctx}
    got = sample(_demo.build_model(_demo.site_ops(sites)), chains, **kwargs)
    want = local_draws(chains)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    calls = calls_on_workers(client, sites)
    assert all(n > 0 for n in calls.values()), calls  # every worker took calls


@pytest.mark.slow
def test_sample_in_the_dask_mode_with_remote_models(client, sites):
    got = sample(_demo.build_model(_demo.site_ops(sites)), 1, compile_kwargs={"mode": "DASK"})
    want = local_draws(1)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
