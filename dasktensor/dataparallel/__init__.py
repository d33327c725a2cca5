"""Data parallelism: graphs vectorised over a batch and evaluated chunk by chunk on Dask.

* ``_vectorize.py``: a graph written for one element, vectorised over leading batch axes
  and compiled (:class:`Vectorized`);
* ``_chunks.py``: the Dask side: chunks as tasks, Dask arrays out, chunk sizes by work,
  results assembled in place;
* ``_pipeline.py``: a vectorised graph with ``dt.annotate`` blocks cut into placed stages
  (:class:`Pipeline`), which chunks stream through;
* ``_arrays.py``: the Dask array type of a pipeline's outputs (its optimisation keeps the
  stages' placement);
* ``_pmap.py``: ``dt.pmap``;
* ``_predictive.py``: ``dt.sample_posterior_predictive``, PyMC's forward graph vectorised
  over (chain, draw);
* ``_loglik.py``: ``dt.compute_log_likelihood``;
* ``_idata.py``: traces and results as either PyMC line gives them.
"""

from dasktensor.dataparallel._loglik import compute_log_likelihood as compute_log_likelihood
from dasktensor.dataparallel._pipeline import Pipeline as Pipeline
from dasktensor.dataparallel._pipeline import Stage as Stage
from dasktensor.dataparallel._pmap import PMapped as PMapped
from dasktensor.dataparallel._pmap import pmap as pmap
from dasktensor.dataparallel._predictive import (
    sample_posterior_predictive as sample_posterior_predictive,
)

__all__ = [
    "PMapped",
    "Pipeline",
    "Stage",
    "compute_log_likelihood",
    "pmap",
    "sample_posterior_predictive",
]
