"""The nanny of the worker processes that dasktensor starts, with glibc's own malloc.

Dask's nannies start every worker with ``MALLOC_TRIM_THRESHOLD_=65536``
(``distributed.nanny.pre-spawn-environ``), so that memory a worker frees goes back to the
system at once.  Setting that variable also switches off glibc's adaptive mmap threshold:
every allocation of more than 128 KiB is then a fresh ``mmap``, whose pages fault in one
by one when first written, and an ``munmap`` when freed.  A NumPy temporary of a model's
evaluation is such an allocation, made and freed on every call: a kernel with 1 MiB
temporaries, and the gradient of a 20,000-row regression, ran slower under Dask's setting
(``benchmarks/bench_p28_worker_malloc.py``, on the performance page).
dasktensor's workers serve model calls back to back, where the allocator's reuse matters
more than handing memory back early.

:class:`Nanny` is Dask's, with ``MALLOC_TRIM_THRESHOLD_`` taken from the setting
``dasktensor.cluster.malloc-trim-threshold``: null (the default) leaves it unset, so
glibc adapts its thresholds as in any Python process; a number sets it (65536 is Dask's
choice).  ``dt.connect``'s embedded cluster and ``dasktensor worker --gpus`` start their
workers with it.  A cluster started with ``dask worker`` keeps Dask's setting unless a
Dask configuration file of its hosts sets ``distributed.nanny.pre-spawn-environ.
MALLOC_TRIM_THRESHOLD_`` to null (see the performance page).
"""

from __future__ import annotations

import os

import dask
from distributed import Nanny as _DaskNanny

from dasktensor import _config

VARIABLE = "MALLOC_TRIM_THRESHOLD_"


def _dask_default() -> str | None:
    """The value Dask's own configuration gives the variable (``"65536"``), if any."""
    value = dask.config.get(f"distributed.nanny.pre-spawn-environ.{VARIABLE}", None)
    return None if value is None else str(value)


def spawn_environ() -> dict:
    """The configuration under which a worker process is spawned: Dask's
    ``pre-spawn-environ`` with ``MALLOC_TRIM_THRESHOLD_`` from
    ``dasktensor.cluster.malloc-trim-threshold`` (None: unset).

    Examples
    --------
    >>> import dask
    >>> spawn_environ()
    {'distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_': None}
    >>> with dask.config.set({"dasktensor.cluster.malloc-trim-threshold": 65536}):
    ...     spawn_environ()
    {'distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_': 65536}
    """
    return {f"distributed.nanny.pre-spawn-environ.{VARIABLE}": _threshold()}


def _threshold() -> int | None:
    value = _config.get("cluster.malloc-trim-threshold")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            "dasktensor.cluster.malloc-trim-threshold expected null (glibc's own "
            f"thresholds) or a number of bytes >= 0, got {value!r}"
        )
    return value


class Nanny(_DaskNanny):
    """Dask's ``Nanny``, its worker spawned with ``MALLOC_TRIM_THRESHOLD_`` as
    ``dasktensor.cluster.malloc-trim-threshold`` says (unset by default).

    Dask's nanny also writes its ``pre-spawn-environ`` into the environment of the
    process that runs it (the caller's, for a ``LocalCluster``), where a spawned worker
    inherits it: a value equal to Dask's own, left there by an earlier cluster of this
    process, is removed before this nanny's worker is spawned (or restarted).  A value
    the environment holds otherwise (set in the shell) is the user's, and is kept.

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1)  # doctest: +SKIP
    >>> def variable():  # read on the worker
    ...     return __import__("os").environ.get("MALLOC_TRIM_THRESHOLD_")
    >>> client.run(variable)  # doctest: +SKIP
    {'tcp://127.0.0.1:40211': None}
    """

    def __init__(self, *args, **kwargs):
        with dask.config.set(spawn_environ()):
            super().__init__(*args, **kwargs)

    async def instantiate(self):
        # (called for the first spawn and for every restart)
        inherited = os.environ.get(VARIABLE)
        if (
            _threshold() is None
            and inherited is not None
            and inherited == _dask_default()
            and VARIABLE not in self.env
        ):
            os.environ.pop(VARIABLE, None)
        return await super().instantiate()
