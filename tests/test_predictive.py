"""dt.sample_posterior_predictive: PyMC's contract, vectorised draws, chunks on Dask."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pymc as pm
import pytest
from _pymc_models import (
    MODELS,
    RNG,
    group_names,
    group_of,
    linear_regression,
    pymc_predictive,
    trace,
    with_data,
)

import dasktensor as dt


def assert_same_structure(got, want):
    assert type(got) is type(want)
    assert set(got.data_vars) == set(want.data_vars)
    for name, var in want.data_vars.items():
        assert got[name].dims == var.dims, name
        assert got[name].shape == var.shape, name
        for dim in var.dims:
            np.testing.assert_array_equal(got[name][dim].values, var[dim].values)


def assert_same_distribution(got, want):
    """Per element: means within 5 standard errors; per variable: sd within 10 %.

    Both draw from the same posterior draws, so a per-element mean differs only by the
    predictive noise: its standard error is sqrt((s1^2 + s2^2) / n).  The sd compared is
    the per-element sd over draws (averaged over elements as a variance); with n = 800
    draws its relative standard error is ~2.5 % per element, less on average, so 10 % is
    far outside chance and well inside a wrong model's error (30 % more noise fails).
    """
    for name in want.data_vars:
        g = np.asarray(got[name]).reshape(-1, *got[name].shape[2:])
        w = np.asarray(want[name]).reshape(-1, *want[name].shape[2:])
        n = len(w)
        se = np.sqrt((g.var(axis=0) + w.var(axis=0)) / n) + 1e-12
        z = np.abs(g.mean(axis=0) - w.mean(axis=0)) / se
        assert z.max() < 5.0, f"{name}: means differ by {z.max():.1f} standard errors"
        ratio = np.sqrt((g.var(axis=0).mean() + 1e-24) / (w.var(axis=0).mean() + 1e-24))
        assert abs(ratio - 1.0) < 0.1, f"{name}: standard deviations differ ({ratio:.3f})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_same_variables_dims_coords_and_distribution_as_pymc(name):
    model, idata = trace(name)
    var_names = ["y", "mu"] if name == "linear-regression" else None
    if name == "hierarchical":
        var_names = ["y", "theta"]
    got = dt.sample_posterior_predictive(idata, model=model, var_names=var_names, random_seed=1)
    want = pymc_predictive(idata, model, var_names=var_names)
    assert type(got) is type(want)
    assert group_names(got) == group_names(want)
    pp, ref = group_of(got), group_of(want)
    assert all(isinstance(v.data, da.Array) for v in pp.data_vars.values())  # lazy
    assert_same_structure(pp, ref)
    assert_same_distribution(pp, ref)


@pytest.mark.slow
def test_the_comparison_fails_on_a_wrong_model():
    model, idata = trace("linear-regression")
    wrong = linear_regression(noise_scale=1.3)  # same names, 30 % more noise
    got = dt.sample_posterior_predictive(idata, model=wrong, random_seed=1)
    want = pymc_predictive(idata, model)
    with pytest.raises(AssertionError, match="standard deviations differ"):
        assert_same_distribution(group_of(got), group_of(want))


@pytest.mark.slow
def test_set_data_and_predictions_group():
    model, idata = trace("with-data")
    new_x = np.linspace(2.0, 3.0, 7)
    with model:
        pm.set_data({"x": new_x, "y_data": np.zeros(7)}, coords={"obs": np.arange(7)})
    try:
        got = dt.sample_posterior_predictive(idata, model=model, predictions=True, random_seed=2)
        want = pymc_predictive(idata, model, predictions=True)
    finally:
        with model:
            pm.set_data(
                {"x": np.linspace(0.0, 1.0, 20), "y_data": np.zeros(20)},
                coords={"obs": np.arange(20)},
            )
    pred, ref = group_of(got, "predictions"), group_of(want, "predictions")
    assert pred["y"].shape == (2, 400, 7)
    assert_same_structure(pred, ref)
    assert_same_distribution(pred, ref)
    slope = np.asarray(group_of(idata, "posterior")["slope"]).mean()
    np.testing.assert_allclose(np.asarray(pred["y"]).mean(axis=(0, 1)), slope * new_x, atol=0.1)


@pytest.mark.slow
def test_draws_do_not_depend_on_the_scheduler_or_number_of_workers(client):
    from _clusters import local_cluster
    from distributed import Client

    model, idata = trace("linear-regression")

    def run(**kwargs):
        result = dt.sample_posterior_predictive(
            idata,
            model=model,
            random_seed=7,
            chunks=150,
            compute=True,
            progressbar=False,
            **kwargs,
        )
        return np.asarray(group_of(result)["y"])

    threads = run()
    np.testing.assert_array_equal(run(client=client), threads)  # 2 worker processes
    with local_cluster(n_workers=1) as one, Client(one, set_as_default=False) as c1:
        np.testing.assert_array_equal(run(client=c1), threads)
    assert not np.array_equal(
        np.asarray(
            group_of(dt.sample_posterior_predictive(idata, model=model, random_seed=8))["y"]
        ),
        threads,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bigger_than_memory_output_streams_to_zarr(tmp_path):
    """Workers with 650 MiB each (PyMC imported: ~400) write a 2.9 GB result; spot checks
    against a recompute."""
    import xarray as xr
    from _clusters import local_cluster
    from distributed import Client

    n_obs = 180_000
    x = np.linspace(0.0, 1.0, n_obs)
    with pm.Model() as model:
        a = pm.Normal("a")
        b = pm.Normal("b")
        pm.Normal("y", a + b * x, 1.0, observed=np.zeros(n_obs))
    posterior = xr.Dataset(
        {
            "a": (("chain", "draw"), RNG.normal(size=(4, 500))),
            "b": (("chain", "draw"), RNG.normal(size=(4, 500))),
        },
        coords={"chain": np.arange(4), "draw": np.arange(500)},
    )
    idata = _trace_of(posterior)
    with (
        local_cluster(n_workers=2, memory_limit="650MiB") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        result = dt.sample_posterior_predictive(idata, model=model, random_seed=3, chunks=20)
        y = group_of(result)["y"]
        assert y.nbytes > 4 * 650 * 2**20  # several times a worker's memory limit
        store = tmp_path / "pp.zarr"
        group_of(result).to_zarr(store, compute=False, consolidated=False).compute(
            scheduler=client
        )
        peak = client.run(lambda dask_worker: dask_worker.monitor.range_query(0)["memory"])
    written = xr.open_zarr(store, consolidated=False)["y"]
    assert written.shape == (4, 500, n_obs)
    # spot checks: chunks recomputed on their own (same seed and chunks) match the store
    again = group_of(dt.sample_posterior_predictive(idata, model=model, random_seed=3, chunks=20))
    for c, d in [(0, 0), (2, 257), (3, 499)]:
        np.testing.assert_array_equal(written[c, d].values, again["y"][c, d].values)
        a, b = posterior["a"][c, d].item(), posterior["b"][c, d].item()
        residual = written[c, d].values - (a + b * x)
        assert abs(residual.mean()) < 0.02 and abs(residual.std() - 1.0) < 0.02
    assert all(max(m) < 650 * 2**20 for m in peak.values()), peak


def _trace_of(posterior):
    """The trace type of this PyMC line (InferenceData or DataTree) holding ``posterior``."""
    if pm.__version__.startswith("5"):
        import arviz as az

        return az.InferenceData(posterior=posterior)
    import xarray as xr

    return xr.DataTree.from_dict({"posterior": posterior})


@pytest.mark.slow
def test_a_posterior_dataset_is_accepted_as_pymc_does():
    model, idata = trace("linear-regression")
    posterior = group_of(idata, "posterior")
    got = dt.sample_posterior_predictive(posterior, model=model, random_seed=1)
    want = pymc_predictive(posterior, model)
    assert_same_structure(group_of(got), group_of(want))
    assert_same_distribution(group_of(got), group_of(want))


def test_bad_chunks_fail_clearly():
    import xarray as xr

    posterior = xr.Dataset(
        {v: (("chain", "draw"), np.ones((1, 2))) for v in ("a", "b", "sigma")},
        coords={"chain": [0], "draw": [0, 1]},
    )
    with pytest.raises(ValueError, match=r"chunks=...\) expected 'auto' or an int > 0, got -1"):
        dt.sample_posterior_predictive(_trace_of(posterior), model=linear_regression(), chunks=-1)


def test_later_calls_reuse_the_vectorised_graph_and_read_data_at_call_time():
    """A second call runs neither PyMC nor a compiler (nothing that decides PyMC's forward
    function changed); new values of a pm.Data variable are read at each call (PyMC runs
    again on one draw: what it samples may change with the data), and a new length builds
    the graph again."""
    import xarray as xr

    from dasktensor.dataparallel._predictive import _vectorized_cache

    rng = np.random.default_rng(4)
    posterior = xr.Dataset(
        {
            "slope": (("chain", "draw"), rng.normal(3.0, 0.01, (2, 300))),
            "sigma": (("chain", "draw"), np.full((2, 300), 0.1)),
        },
        coords={"chain": [0, 1], "draw": np.arange(300)},
    )
    idata = _trace_of(posterior)
    model = with_data()

    def mean_y(**kwargs):
        result = dt.sample_posterior_predictive(idata, model=model, random_seed=5, **kwargs)
        y = np.asarray(group_of(result, "predictions" if kwargs else "posterior_predictive")["y"])
        return y.mean(axis=(0, 1))

    import pymc.sampling.forward as forward

    runs = []  # PyMC's one-draw runs (each compiles a forward function)
    original = forward.compile_forward_sampling_function

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    forward.compile_forward_sampling_function = counted
    try:
        first = mean_y()
        (entry,) = _vectorized_cache[model]
        np.testing.assert_array_equal(mean_y(), first)  # same seed, same draws
        assert _vectorized_cache[model] == [entry]  # found again: nothing vectorised or compiled
        assert len(runs) == 1  # the second call did not run PyMC either

        x = np.linspace(0.0, 1.0, 20)
        np.testing.assert_allclose(first, 3.0 * x, atol=0.03)
        with model:
            pm.set_data({"x": 2.0 * x})
        np.testing.assert_allclose(mean_y(), 6.0 * x, atol=0.03)  # new values, same graph
        assert _vectorized_cache[model][-1] is entry
        assert len(runs) == 2  # new data: PyMC decides again what it samples
    finally:
        forward.compile_forward_sampling_function = original

    new_x = np.linspace(1.0, 2.0, 7)
    with model:
        pm.set_data({"x": new_x, "y_data": np.zeros(7)}, coords={"obs": np.arange(7)})
    np.testing.assert_allclose(mean_y(predictions=True), 3.0 * new_x, atol=0.03)
    assert _vectorized_cache[model][-1] is not entry  # the size of y changed: built again
