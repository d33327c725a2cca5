"""Traces and results as PyMC gives them, on either line: groups, chunks, lazy datasets.

PyMC 5 returns ``arviz.InferenceData``, PyMC 6 ``xarray.DataTree``.  The vectorised
fronts over a posterior (``dt.sample_posterior_predictive``,
``dt.compute_log_likelihood``) take PyMC's result on one draw as the template of theirs
(groups, dims, coords, attributes, result type) and replace its arrays by Dask arrays of
the full size, chunked over (chain, draw); these helpers do the parts they share.
"""

from __future__ import annotations

import math

from dasktensor.dataparallel._chunks import _as_dask, _split, auto_chunk, compute_arrays


def groups(obj) -> dict:
    """Name -> Dataset of the groups of an InferenceData or a DataTree (a Dataset is
    taken as the posterior)."""
    import xarray as xr

    if isinstance(obj, xr.Dataset):
        return {"posterior": obj}
    if hasattr(obj, "children"):  # xarray.DataTree
        return {name: node.to_dataset() for name, node in obj.children.items()}
    if not callable(getattr(obj, "groups", None)):
        raise TypeError(
            "expected a trace: an arviz.InferenceData, an xarray.DataTree or an "
            f"xarray.Dataset (the posterior), got {type(obj).__name__}"
        )
    return {name: obj[name] for name in obj.groups()}


def posterior_of(owner: str, idata):
    """The posterior of a trace, with at least one chain and one draw (PyMC runs on the
    first draw for the template)."""
    found = groups(idata)
    if "posterior" not in found:
        raise ValueError(f"{owner} expected a trace with a posterior, got groups {sorted(found)}")
    posterior = found["posterior"]
    sizes = dict(posterior.sizes)
    if "chain" not in sizes or "draw" not in sizes:
        raise ValueError(
            f"{owner} expected a posterior with dims (chain, draw, ...), got {tuple(sizes)}"
        )
    if not (sizes["chain"] and sizes["draw"]):
        raise ValueError(
            f"{owner} expected a posterior of one draw at least, got {sizes['chain']} "
            f"chain(s) of {sizes['draw']} draw(s)"
        )
    return posterior


def first_draw(idata):
    """The trace with its posterior cut to chain 0, draw 0 (other groups unchanged)."""
    posterior = groups(idata)["posterior"]
    small = posterior.isel(chain=[0], draw=[0])
    if idata is posterior:
        return small
    return replace_group(idata, "posterior", small)


def sample_chunks(owner: str, n_chains: int, n_draws: int, chunks, per_draw: int):
    """Chunks of the (chain, draw) axes: ``chunks`` draws each, or for ``"auto"`` about
    ``dasktensor.pmap.chunk-bytes`` of output (``per_draw`` bytes a draw) each."""
    if chunks == "auto":
        per_chunk = auto_chunk(n_chains * n_draws, per_draw)
    elif isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0:
        per_chunk = chunks
    else:
        raise ValueError(f"{owner}(chunks=...) expected 'auto' or an int > 0, got {chunks!r}")
    if per_chunk >= n_draws:
        chains = max(1, min(n_chains, per_chunk // n_draws))
        return _split(n_chains, chains), (n_draws,)
    return (1,) * n_chains, _split(n_draws, per_chunk)


def bytes_per_draw(template, names) -> int:
    """Bytes of one draw of the variables ``names`` of a one-draw ``template`` dataset."""
    return sum(
        template[n].dtype.itemsize * math.prod(template[n].shape[2:])
        for n in names
        if n in template
    )


def lazy_dataset(template, computed: dict, posterior, chunks):
    """``template`` (a one-draw dataset) at the size of ``posterior``: variables from
    ``computed`` (Dask arrays), or passed through from the posterior, as PyMC does."""
    import xarray as xr

    data_vars = {}
    for name, var in template.data_vars.items():
        if name in computed:
            data = computed[name]
        elif name in posterior:
            value = posterior[name].data
            data = _as_dask(value, chunks + tuple((d,) for d in value.shape[2:]))
        else:  # pragma: no cover - PyMC put something unexpected in its result
            raise RuntimeError(f"dasktensor cannot compute {name!r} of PyMC's result")
        coords = {k: c for k, c in var.coords.items() if k not in ("chain", "draw")}
        coords.update(chain=posterior["chain"], draw=posterior["draw"])
        data_vars[name] = xr.DataArray(data, dims=var.dims, coords=coords, attrs=var.attrs)
    return xr.Dataset(data_vars, attrs=template.attrs)


def compute_dataset(dataset, client, progressbar: bool):
    """The dataset with its Dask-backed variables computed into NumPy arrays."""
    import dask.array as da

    names = [n for n, v in dataset.data_vars.items() if isinstance(v.data, da.Array)]
    values = compute_arrays([dataset[n].data for n in names], client, progressbar)
    return dataset.assign({n: dataset[n].copy(data=v) for n, v in zip(names, values, strict=True)})


def replace_group(result, group: str, dataset):
    """``result`` (InferenceData or DataTree) with ``group`` set to ``dataset``."""
    if hasattr(result, "children"):  # DataTree
        out = result.copy()
        out[group] = dataset
        return out
    import arviz as az

    found = groups(result)
    found[group] = dataset
    return az.InferenceData(**found)
