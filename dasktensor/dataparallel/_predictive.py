"""Posterior predictive sampling: PyMC's forward graph, vectorised, chunked, on Dask.

``pm.sample_posterior_predictive`` evaluates its forward function once per draw in a
Python loop.  Here the same function is obtained from PyMC itself, then vectorised over
(chain, draw) (:mod:`dasktensor.dataparallel._vectorize`) and evaluated in chunks on Dask
(:mod:`dasktensor.dataparallel._chunks`), as ``pmap`` does:

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

import weakref
from collections.abc import Sequence

from pytensor.graph.basic import equal_computations

from dasktensor._runtime import runtime
from dasktensor.cluster import is_client
from dasktensor.dataparallel._chunks import map_blocks
from dasktensor.dataparallel._idata import (
    bytes_per_draw,
    compute_dataset,
    first_draw,
    groups,
    lazy_dataset,
    posterior_of,
    replace_group,
    sample_chunks,
)
from dasktensor.dataparallel._vectorize import Vectorized

_capture_lock = runtime.lock()


def _forward_function(model, small, var_names, predictions):
    """Run PyMC on a one-draw trace; return its result and the forward function it built."""
    import pymc as pm
    from pymc.sampling import forward
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
                compile_kwargs={"mode": Mode(linker="py", optimizer="None")},
            )
        finally:
            forward.compile_forward_sampling_function = original
    if len(captured) != 1:  # pragma: no cover - PyMC changed how it samples
        raise RuntimeError(
            "dasktensor could not find PyMC's forward sampling function "
            f"({len(captured)} were compiled); please report this with your PyMC version"
        )
    return result, captured[0]


# PyMC's one-draw results and forward functions of recent calls, per model, by what
# decides them: a warm call does not run PyMC at all
_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _template(model, idata, var_names, predictions):
    """PyMC's one-draw result and forward function for this call (see :func:`_decisive`):
    from an earlier call when nothing that decides them changed, else PyMC's run."""
    names, objects = _decisive(model, idata, var_names, predictions)
    with _cache_lock:
        for entry in _templates.get(model, []):
            if (
                entry[0] == names
                and len(entry[1]) == len(objects)
                and all(a is b for a, b in zip(entry[1], objects, strict=True))
            ):
                return entry[2], entry[3]
    small_result, fn = _forward_function(model, first_draw(idata), var_names, predictions)
    with _cache_lock:
        entries = _templates.setdefault(model, [])
        entries.append((names, objects, small_result, fn))
        del entries[:-_CACHE_PER_MODEL]
    return small_result, fn


def _decisive(model, idata, var_names, predictions) -> tuple[tuple, tuple]:
    """What decides PyMC's forward function and the structure of its result: names (by
    equality) and objects (by identity).

    PyMC samples the variables asked for or missing from the trace, and those depending
    on data (``pm.Data``) whose values differ from the trace's ``constant_data``; dims and
    coords come from the model.  So: the arguments, the posterior's variables (names,
    dims, shapes, dtypes), the model's variables, coords and data values, and the trace's
    constant data -- the values as objects (``pm.set_data`` puts new ones in place), kept
    alive by the cache so that identity means the same values.
    """
    found = groups(idata)
    posterior = found["posterior"]
    names = (
        tuple(var_names) if var_names is not None else None,
        bool(predictions),
        tuple((n, v.dims, v.shape[2:], v.dtype.str) for n, v in posterior.data_vars.items()),
        tuple(model.named_vars),
        tuple(model.coords),
    )
    constant = found.get("constant_data")
    objects = (
        *model.named_vars.values(),
        *model.coords.values(),
        *(v.get_value(borrow=True) for v in model.data_vars),
        *((constant[n].data for n in constant.data_vars) if constant is not None else ()),
    )
    return names, objects


# vectorised forward graphs of recent calls, per model: a later call whose forward graph
# is the same computation (PyMC builds it anew each time) reuses the vectorised graph and
# its compiled runner, here and on the workers
_vectorized_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_PER_MODEL = 8
_cache_lock = runtime.lock()


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

    model = pm.modelcontext(model)
    var_names = _check_arguments(model, var_names, client)
    posterior = posterior_of("sample_posterior_predictive", idata)
    n_chains, n_draws = posterior.sizes["chain"], posterior.sizes["draw"]
    small_result, fn = _template(model, idata, var_names, predictions)

    inputs = [i.variable for i in fn.maker.inputs if not i.implicit]
    outputs = [o.variable for o in fn.maker.outputs]
    missing = [v.name for v in inputs if v.name not in posterior]
    if missing:
        raise ValueError(
            f"sample_posterior_predictive: PyMC conditions on {missing}, which the "
            f"posterior does not hold (it has {sorted(posterior.data_vars)})"
        )
    vec, fixed = _vectorized(model, inputs, outputs)
    # PyMC casts the trace's values to its variables' dtypes (an int posterior of a float
    # variable); the compiled graph takes them as they are
    values = [posterior[v.name].data for v in inputs]
    values = [
        x if x.dtype == v.type.dtype else x.astype(v.type.dtype)
        for x, v in zip(values, inputs, strict=True)
    ]

    group = "predictions" if predictions else "posterior_predictive"
    template = groups(small_result)[group]
    names = [o.name for o in outputs]
    chunked = sample_chunks("sample_posterior_predictive", n_chains, n_draws, chunks,
                            bytes_per_draw(template, names))  # fmt: skip
    arrays = map_blocks(
        vec, values, chunked, random_seed, "predictive", fixed=fixed, client=client
    )
    dataset = lazy_dataset(template, dict(zip(names, arrays, strict=True)), posterior, chunked)
    if compute:
        dataset = compute_dataset(dataset, client, progressbar)
    return replace_group(small_result, group, dataset)


def _check_arguments(model, var_names, client) -> list[str] | None:
    """Refuse what PyMC fails on with messages that do not name the argument (``KeyError:
    'x'``, an AttributeError); ``var_names`` as a list (one name alone as PyMC 6 takes it)."""
    import pymc as pm

    owner = "sample_posterior_predictive"
    if not isinstance(model, pm.Model):
        raise TypeError(f"{owner} expected model= a pymc.Model, got {model!r}")
    if isinstance(var_names, str):
        var_names = [var_names]
    if var_names is not None:
        names = list(var_names) if hasattr(var_names, "__iter__") else [var_names]
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"{owner} expected var_names= a list of names, got {var_names!r}")
        var_names = names
        unknown = [n for n in var_names if n not in model.named_vars]
        if unknown:
            raise ValueError(
                f"{owner} expected var_names= among the model's variables "
                f"{sorted(model.named_vars)}, got {unknown}"
            )
    if client is not None and not is_client(client):
        raise TypeError(f"{owner} expected client= a distributed.Client, got {client!r}")
    return var_names
