"""dt.compute_log_likelihood: PyMC's contract, vectorised draws, lazy, streamed to zarr."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pymc as pm
import pytest
from _pymc_models import RNG, group_names, group_of, trace

import dasktensor as dt


def pymc_loglik(idata, model, **kwargs):
    return pm.compute_log_likelihood(
        idata.copy(), model=model, extend_inferencedata=False, progressbar=False, **kwargs
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear-regression", "hierarchical", "multivariate"])
def test_values_dims_and_coords_are_pymcs(name):
    model, idata = trace(name)
    got = dt.compute_log_likelihood(idata.copy(), model=model, extend_inferencedata=False)
    want = pymc_loglik(idata, model)
    assert type(got) is type(want) and set(got.data_vars) == set(want.data_vars)
    for var, expected in want.data_vars.items():
        assert isinstance(got[var].data, da.Array)  # lazy until asked
        assert got[var].dims == expected.dims and got[var].shape == expected.shape
        for dim in expected.dims:
            np.testing.assert_array_equal(got[var][dim].values, expected[dim].values)
        np.testing.assert_allclose(got[var].values, expected.values, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_the_trace_is_extended_in_place_as_pymc_does_and_var_names_select():
    model, idata = trace("with-data")
    mine = idata.copy()
    returned = dt.compute_log_likelihood(mine, model=model, var_names=["y"], compute=True,
                                         progressbar=False)  # fmt: skip
    assert returned is mine and "log_likelihood" in group_names(mine)
    expected = pymc_loglik(idata, model, var_names=["y"])["y"].values
    np.testing.assert_allclose(group_of(mine, "log_likelihood")["y"].values, expected, rtol=1e-10)
    assert isinstance(group_of(mine, "log_likelihood")["y"].data, np.ndarray)  # computed
    with pytest.raises(ValueError, match="var_names must refer to observed_RVs"):
        dt.compute_log_likelihood(idata.copy(), model=model, var_names=["slope"])


@pytest.mark.slow
def test_new_data_is_read_at_call_time():
    """pm.set_data changes what the next call computes (the values, not only the template)."""
    model, idata = trace("with-data")
    x = model["x"].get_value()
    try:
        with model:
            pm.set_data({"x": x * 2.0})
        got = dt.compute_log_likelihood(idata.copy(), model=model, extend_inferencedata=False)
        want = pymc_loglik(idata, model)
        np.testing.assert_allclose(got["y"].values, want["y"].values, rtol=1e-10)
    finally:
        with model:
            pm.set_data({"x": x})
    back = dt.compute_log_likelihood(idata.copy(), model=model, extend_inferencedata=False)
    assert not np.allclose(back["y"].values, got["y"].values)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bigger_than_memory_log_likelihood_streams_to_zarr(tmp_path):
    """Workers with 650 MiB each (PyMC imported: ~400) write a 2.9 GB log-likelihood; spot
    checks against scipy's normal log-density; every worker's memory stays under its limit."""
    import xarray as xr
    from _clusters import local_cluster
    from distributed import Client
    from scipy.stats import norm

    n_obs = 180_000
    x = np.linspace(0.0, 1.0, n_obs)
    y = RNG.normal(size=n_obs)
    with pm.Model() as model:
        a = pm.Normal("a")
        b = pm.Normal("b")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", a + b * x, sigma, observed=y)
    draws = {"chain": np.arange(4), "draw": np.arange(500)}
    posterior = xr.Dataset(
        {
            "a": (("chain", "draw"), RNG.normal(size=(4, 500))),
            "b": (("chain", "draw"), RNG.normal(size=(4, 500))),
            "sigma": (("chain", "draw"), RNG.uniform(0.5, 2.0, size=(4, 500))),
        },
        coords=draws,
    )
    idata = _trace_of(posterior)
    with (
        local_cluster(n_workers=2, memory_limit="650MiB") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        ll = dt.compute_log_likelihood(idata, model=model, chunks=20, extend_inferencedata=False)
        assert ll["y"].nbytes > 4 * 650 * 2**20  # several times a worker's memory limit
        store = tmp_path / "loglik.zarr"
        ll.to_zarr(store, compute=False, consolidated=False).compute(scheduler=client)
        peak = client.run(lambda dask_worker: dask_worker.monitor.range_query(0)["memory"])
    written = xr.open_zarr(store, consolidated=False)["y"]
    assert written.shape == (4, 500, n_obs)
    for c, d in [(0, 0), (2, 257), (3, 499)]:
        p = posterior.isel(chain=c, draw=d)
        expected = norm.logpdf(y, float(p["a"]) + float(p["b"]) * x, float(p["sigma"]))
        np.testing.assert_allclose(written[c, d].values, expected, rtol=1e-10)
    assert all(max(m) < 650 * 2**20 for m in peak.values()), peak


def _trace_of(posterior):
    """The trace type of this PyMC line (InferenceData or DataTree) holding ``posterior``."""
    if pm.__version__.startswith("5"):
        import arviz as az

        return az.InferenceData(posterior=posterior)
    import xarray as xr

    return xr.DataTree.from_dict({"posterior": posterior})


def test_a_posterior_without_the_free_variables_is_refused():
    import xarray as xr

    model, _ = trace("linear-regression")
    posterior = xr.Dataset({"a": (("chain", "draw"), np.zeros((1, 2)))},
                           coords={"chain": [0], "draw": [0, 1]})  # fmt: skip
    with pytest.raises((ValueError, KeyError), match="b"):
        dt.compute_log_likelihood(_trace_of(posterior), model=model)
