"""Posterior predictive sampling: PyMC's forward graph, vectorised, chunked, on Dask.

``pm.sample_posterior_predictive`` evaluates its forward function once per draw in a
Python loop.  Here the same function is obtained from PyMC itself, then vectorised over
(chain, draw) (:mod:`dasktensor._vectorize`) and evaluated in chunks on Dask
(:mod:`dasktensor._chunks`), as ``pmap`` does:

1. PyMC runs on the first draw of the first chain only.  While it does, dasktensor keeps the
   forward function PyMC compiles (``compile_forward_sampling_function``): its inputs are
   the trace variables PyMC decided to condition on, its outputs the variables it samples
   or recomputes.  PyMC's own rules (which variables are volatile, ``pm.Data`` changed by
   ``pm.set_data``, ``var_names``, ``predictions``) thus apply unchanged on either PyMC
   line, and PyMC's result gives the exact structure to return: groups, dims, coords,
   attributes, and the result type (``InferenceData`` on PyMC 5, ``DataTree`` on PyMC 6).
2. The function's graph (before rewrites) is vectorised over (chain, draw) and evaluated
   in chunks of draws as Dask tasks, with per-chunk random generators.
3. The arrays of PyMC's one-draw result are replaced by Dask arrays of the full size, so
   ``result.to_zarr(...)`` streams a result bigger than memory chunk by chunk.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

from pytensor.graph.basic import equal_computations

from dasktensor._chunks import _as_dask, _split, auto_chunk, compute_arrays, map_blocks
from dasktensor._vectorize import Vectorized

_capture_lock = threading.Lock()


def _forward_function(model, small, var_names, predictions):
    """Run PyMC on a one-draw trace; return its result and the forward function it built."""
    import pymc as pm
    import pymc.sampling.forward as forward
    from pytensor.compile.mode import Mode

    captured = []
    original = forward.compile_forward_sampling_function

    def keep(*args, **kwargs):
        fn, volatile = original(*args, **kwargs)
        captured.append(fn)
        return fn, volatile

    with _capture_lock:
        forward.compile_forward_sampling_function = keep
        try:
            result = pm.sample_posterior_predictive(
                small,
                model=model,
                var_names=var_names,
                predictions=predictions,
                progressbar=False,
                random_seed=0,
                # one draw, for the structure of the result: Python thunks, no rewrites and
                # no backend compilation (the chunks compile the graph once per process)
                compile_kwargs={"mode": Mode(linker="py", optimizer=None)},
            )
        finally:
            forward.compile_forward_sampling_function = original
    if len(captured) != 1:  # pragma: no cover - PyMC changed how it samples
        raise RuntimeError(
            "dasktensor could not find PyMC's forward sampling function "
            f"({len(captured)} were compiled); please report this with your PyMC version"
        )
    return result, captured[0]


# vectorised forward graphs of recent calls, per model: a later call whose forward graph
# is the same computation (PyMC builds it anew each time) reuses the vectorised graph and
# its compiled runner, here and on the workers
_vectorized_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_PER_MODEL = 8
_cache_lock = threading.Lock()


def _vectorized(model, inputs: list, outputs: list):
    """The vectorised forward graph of ``inputs -> outputs`` and its fixed inputs' values,
    from the cache when an earlier call had the same graph."""
    with _cache_lock:
        entries = _vectorized_cache.setdefault(model, [])
        for i, (ins, outs, vec) in enumerate(entries):
            if (
                [v.name for v in ins] == [v.name for v in inputs]
                and len(outs) == len(outputs)
                and equal_computations(outputs, outs, inputs, ins)
            ):
                fixed = vec.fixed_values()
                if fixed is not None:
                    entries.append(entries.pop(i))  # most recently used last
                    return vec, fixed
    vec = Vectorized(inputs, outputs, [True] * len(inputs), n_batch=2, name="predictive")
    with _cache_lock:
        entries = _vectorized_cache.setdefault(model, [])
        entries.append((inputs, outputs, vec))
        del entries[:-_CACHE_PER_MODEL]
    return vec, vec.fixed_values()


def _groups(obj) -> dict:
    """Name -> Dataset of the groups of an InferenceData or a DataTree (a Dataset is
    taken as the posterior)."""
    import xarray as xr

    if isinstance(obj, xr.Dataset):
        return {"posterior": obj}
    if hasattr(obj, "children"):  # xarray.DataTree
        return {name: node.to_dataset() for name, node in obj.children.items()}
    return {name: obj[name] for name in obj.groups()}


def _first_draw(idata):
    """The trace with its posterior cut to chain 0, draw 0 (other groups unchanged)."""
    posterior = _groups(idata)["posterior"]
    small = posterior.isel(chain=[0], draw=[0])
    if idata is posterior:
        return small
    if hasattr(idata, "children"):
        out = idata.copy()
        out["posterior"] = small
        return out
    import arviz as az

    groups = _groups(idata)
    groups["posterior"] = small
    return az.InferenceData(**groups)


def _sample_chunks(n_chains: int, n_draws: int, per_chunk: int):
    """Chunks of the (chain, draw) axes holding about ``per_chunk`` draws each."""
    if per_chunk >= n_draws:
        chains = max(1, min(n_chains, per_chunk // n_draws))
        return _split(n_chains, chains), (n_draws,)
    return (1,) * n_chains, _split(n_draws, per_chunk)


def sample_posterior_predictive(
    idata,
    model=None,
    var_names: Sequence[str] | None = None,
    chunks: int | str = "auto",
    random_seed=None,
    predictions: bool = False,
    client=None,
    progressbar: bool = True,
    compute: bool = False,
):
    """Posterior predictive samples, computed by the vectorised forward graph on Dask.

    The contract of ``pm.sample_posterior_predictive``: the same variables (observed
    ones, or ``var_names``; Deterministics), dims, coords and result type (``DataTree``
    on PyMC 6, ``InferenceData`` on PyMC 5), ``pm.Data`` / ``pm.set_data`` for new data,
    ``predictions=True``.  The draws are computed in chunks of (chain, draw) by one
    vectorised call each, in parallel on Dask, into Dask-backed variables: the result is
    lazy, and ``result.to_zarr(path)`` writes it chunk by chunk, also when it is bigger
    than memory.

    Parameters
    ----------
    idata : InferenceData, DataTree or xarray.Dataset
        The trace, with a ``posterior`` group (or the posterior itself).
    model : pymc.Model, optional
        The model (from the context by default).
    var_names : list of str, optional
        Variables to sample (observed variables and their Deterministics by default).
    chunks : int or "auto"
        Draws per chunk (one Dask task each).  ``"auto"`` aims at
        ``dasktensor.pmap.chunk-bytes`` of output per chunk: one small job is one
        vectorised call, not one task per worker.
    random_seed : int or SeedSequence, optional
        Chunk ``i`` draws from the ``i``-th generator spawned from this seed: the same
        seed and chunks give the same draws on any scheduler and number of workers.
    predictions : bool
        Put the samples in a ``predictions`` group (as PyMC does).
    client : distributed.Client, optional
        Compute there (with ``compute=True``); by default Dask's current scheduler (the
        default client if there is one).
    progressbar : bool
        With ``compute=True``, show Dask's progress bar (``distributed.progress`` on a
        client, ``dask.diagnostics.ProgressBar`` for runs over a second locally).  A lazy
        result shows progress where it is computed or written: on the dashboard, or
        within ``dask.diagnostics.ProgressBar()``.
    compute : bool
        Compute the draws now (NumPy-backed result) instead of returning them lazily.

    Returns
    -------
    xarray.DataTree or arviz.InferenceData
        What ``pm.sample_posterior_predictive`` returns on this PyMC line.

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> import dasktensor as dt
    >>> with pm.Model() as model:
    ...     mu = pm.Normal("mu")
    ...     y = pm.Normal("y", mu, 1.0, observed=np.zeros(3))
    ...     idata = pm.sample(50, tune=50, chains=2, progressbar=False,
    ...                       compute_convergence_checks=False, random_seed=1)
    >>> pp = dt.sample_posterior_predictive(idata, model=model, random_seed=2)
    >>> pp["posterior_predictive"]["y"].shape, pp["posterior_predictive"]["y"].chunks
    ((2, 50, 3), ((2,), (50,), (3,)))
    """
    import pymc as pm
    import xarray as xr

    model = pm.modelcontext(model)
    posterior = _groups(idata)["posterior"]
    n_chains, n_draws = posterior.sizes["chain"], posterior.sizes["draw"]
    small_result, fn = _forward_function(model, _first_draw(idata), var_names, predictions)

    inputs = [i.variable for i in fn.maker.inputs if not i.implicit]
    outputs = [o.variable for o in fn.maker.outputs]
    missing = [v.name for v in inputs if v.name not in posterior]
    if missing:
        raise ValueError(
            f"sample_posterior_predictive: PyMC conditions on {missing}, which the "
            f"posterior does not hold (it has {sorted(posterior.data_vars)})"
        )
    vec, fixed = _vectorized(model, inputs, outputs)
    values = [posterior[v.name].data for v in inputs]

    group = "predictions" if predictions else "posterior_predictive"
    template = _groups(small_result)[group]
    if chunks == "auto":
        per_draw = sum(
            template[o.name].dtype.itemsize * math.prod(template[o.name].shape[2:])
            for o in outputs
            if o.name in template
        )
        per_chunk = auto_chunk(n_chains * n_draws, per_draw)
    elif isinstance(chunks, int) and chunks > 0:
        per_chunk = chunks
    else:
        raise ValueError(
            f"sample_posterior_predictive(chunks=...) expected 'auto' or an int > 0, "
            f"got {chunks!r}"
        )
    sample_chunks = _sample_chunks(n_chains, n_draws, per_chunk)
    arrays = map_blocks(vec, values, sample_chunks, random_seed, "predictive", fixed=fixed)
    computed = dict(zip([o.name for o in outputs], arrays))

    data_vars = {}
    for name, var in template.data_vars.items():
        if name in computed:
            data = computed[name]
        elif name in posterior:  # passed through from the trace, as PyMC does
            value = posterior[name].data
            data = _as_dask(value, sample_chunks + tuple((d,) for d in value.shape[2:]))
        else:  # pragma: no cover - PyMC put something unexpected in its result
            raise RuntimeError(f"dasktensor cannot compute {name!r} of PyMC's result")
        coords = {k: c for k, c in var.coords.items() if k not in ("chain", "draw")}
        coords.update(chain=posterior["chain"], draw=posterior["draw"])
        data_vars[name] = xr.DataArray(data, dims=var.dims, coords=coords, attrs=var.attrs)
    dataset = xr.Dataset(data_vars, attrs=template.attrs)
    if compute:
        dataset = _compute(dataset, client, progressbar)
    return _replace_group(small_result, group, dataset)


def _compute(dataset, client, progressbar: bool):
    """The dataset with its Dask-backed variables computed into NumPy arrays."""
    import dask.array as da

    names = [n for n, v in dataset.data_vars.items() if isinstance(v.data, da.Array)]
    values = compute_arrays([dataset[n].data for n in names], client, progressbar)
    return dataset.assign({n: dataset[n].copy(data=v) for n, v in zip(names, values)})


def _replace_group(result, group: str, dataset):
    if hasattr(result, "children"):  # DataTree
        out = result.copy()
        out[group] = dataset
        return out
    import arviz as az

    groups = _groups(result)
    groups[group] = dataset
    return az.InferenceData(**groups)
