"""The pointwise log-likelihood of a posterior, vectorised and chunked on Dask.

``pm.compute_log_likelihood`` evaluates the elementwise log-likelihood of the observed
variables draw by draw and holds the whole ``(chain, draw, observation)`` result in
memory: 2.6 million observations exhausted 64 GB (pymc-devs/pymc#6864).  Here:

1. PyMC runs on the first draw only (Python thunks, no compilation): its result is the
   template of the answer (variables, dims, coords, attributes).
2. The graph PyMC evaluates -- the model with its value transforms removed, the
   observed variables' ``logp(sum=False)`` as a function of the free variables -- is
   vectorised over (chain, draw) (:mod:`dasktensor.dataparallel._vectorize`) and
   evaluated in chunks of draws, one Dask task each
   (:mod:`dasktensor.dataparallel._chunks`), with the data read from the model at each
   call (``pm.Data``).
3. The result is lazy: Dask arrays of ``(chain, draw, *observation shape)``, which
   ``to_zarr`` writes chunk by chunk, bigger than memory.  A chunk holds every
   observation of its draws: one draw of the largest observed variable must fit in a
   worker's memory, the whole result need not.
"""

from __future__ import annotations

from collections.abc import Sequence

from dasktensor.dataparallel._chunks import map_blocks
from dasktensor.dataparallel._idata import (
    bytes_per_draw,
    compute_dataset,
    first_draw,
    groups,
    lazy_dataset,
    sample_chunks,
)
from dasktensor.dataparallel._vectorize import Vectorized


def compute_log_likelihood(
    idata,
    model=None,
    var_names: Sequence[str] | None = None,
    chunks: int | str = "auto",
    extend_inferencedata: bool = True,
    client=None,
    progressbar: bool = True,
    compute: bool = False,
):
    """The elementwise log-likelihood of the posterior's draws, lazily, chunked on Dask.

    The contract of ``pm.compute_log_likelihood``: the observed variables (or
    ``var_names``), dims and coords of PyMC's ``log_likelihood`` group, the result type
    of the PyMC line (``InferenceData`` on PyMC 5, ``DataTree`` on PyMC 6), extended in
    place.  The variables are Dask arrays: nothing is computed until asked, and
    ``log_likelihood.to_zarr(path)`` streams a result bigger than memory.

    Parameters
    ----------
    idata : InferenceData or DataTree
        The trace, with a ``posterior`` group.
    model : pymc.Model, optional
        The model (from the context by default).
    var_names : list of str, optional
        Observed variables (all by default).
    chunks : int or "auto"
        Draws per chunk (one Dask task each); ``"auto"``: about
        ``dasktensor.pmap.chunk-bytes`` of output per chunk.
    extend_inferencedata : bool
        Add the ``log_likelihood`` group to ``idata`` and return it (as PyMC does), or
        return the group alone.
    client : distributed.Client, optional
        With ``compute=True``, compute there (Dask's current scheduler by default).
    progressbar : bool
        With ``compute=True``, show Dask's progress bar.
    compute : bool
        Compute the values now (NumPy-backed) instead of lazily.

    Returns
    -------
    InferenceData, DataTree or xarray.Dataset

    Examples
    --------
    >>> import numpy as np, pymc as pm
    >>> import dasktensor as dt
    >>> with pm.Model() as model:
    ...     mu = pm.Normal("mu")
    ...     y = pm.Normal("y", mu, 1.0, observed=np.zeros(3))
    ...     idata = pm.sample(50, tune=50, chains=2, progressbar=False,
    ...                       compute_convergence_checks=False, random_seed=1)
    >>> ll = dt.compute_log_likelihood(idata, model=model, extend_inferencedata=False)
    >>> ll["y"].shape, type(ll["y"].data).__name__
    ((2, 50, 3), 'Array')
    >>> expected = pm.compute_log_likelihood(idata, model=model, progressbar=False)
    >>> bool(np.allclose(ll["y"].values, expected["log_likelihood"]["y"].values))
    True
    """
    import pymc as pm
    from pymc.model.transform.conditioning import remove_value_transforms
    from pytensor.compile.mode import Mode

    model = pm.modelcontext(model)
    posterior = groups(idata)["posterior"]
    template = pm.compute_log_likelihood(
        first_draw(idata),
        var_names=var_names,
        extend_inferencedata=False,
        model=model,
        progressbar=False,
        compile_kwargs={"mode": Mode(linker="py", optimizer="None")},
    )
    names = list(template.data_vars)
    umodel = remove_value_transforms(model)
    inputs = list(umodel.value_vars)
    outputs = umodel.logp(vars=[umodel.named_vars[n] for n in names], sum=False)
    missing = [v.name for v in inputs if v.name not in posterior]
    if missing:
        raise ValueError(
            f"compute_log_likelihood: expected the posterior to hold every free variable of "
            f"the model; it lacks {missing} (it has {sorted(posterior.data_vars)})"
        )
    vec = Vectorized(inputs, outputs, [True] * len(inputs), n_batch=2, name="loglik")
    values = [posterior[v.name].data.astype(v.type.dtype, copy=False) for v in inputs]
    n_chains, n_draws = posterior.sizes["chain"], posterior.sizes["draw"]
    chunked = sample_chunks("compute_log_likelihood", n_chains, n_draws, chunks,
                            bytes_per_draw(template, names))  # fmt: skip
    arrays = map_blocks(
        vec, values, chunked, None, "loglik", fixed=vec.fixed_values_of_new(), client=client
    )
    dataset = lazy_dataset(template, dict(zip(names, arrays, strict=True)), posterior, chunked)
    if compute:
        dataset = compute_dataset(dataset, client, progressbar)
    if not extend_inferencedata:
        return dataset
    if hasattr(idata, "children"):  # DataTree, extended in place as PyMC does
        idata["log_likelihood"] = dataset
    else:
        idata.add_groups({"log_likelihood": dataset})
    return idata
