"""``dt.sample``: ``pm.sample``'s chains as Dask work that survives lost workers and resumes.

* ``_sample.py``: ``dt.sample`` itself: ``pm.sample`` with its loop over the chains
  replaced, for the calling thread, by a chain runner;
* ``_chains.py``: the caller's side: chains advanced in segments (Dask tasks), retried,
  twinned away from silent workers, recorded into PyMC's traces;
* ``_segments.py``: the worker's side: a run's step method, compiled once per worker, and
  the segments of draws that restore a chain's state and continue it;
* ``_store.py``: checkpoints in a zarr store, and resuming from them;
* ``_breakdown.py``: where a run's wall time went (:func:`last_breakdown`).
"""

from dasktensor.sampling._breakdown import Breakdown as Breakdown
from dasktensor.sampling._breakdown import last_breakdown as last_breakdown
from dasktensor.sampling._sample import sample as sample
from dasktensor.sampling._store import StoreMismatchError as StoreMismatchError

__all__ = ["Breakdown", "StoreMismatchError", "last_breakdown", "sample"]
