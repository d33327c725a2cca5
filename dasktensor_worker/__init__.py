"""The worker side of dasktensor's remote models, importable without PyTensor.

A ``dasktensor.RemoteModel`` keeps a model object alive on Dask workers and calls it there
(see ``dasktensor.remote``).  Everything that runs on the *worker* for that lives in this
top-level package, beside ``dasktensor`` rather than inside it, because ``import
dasktensor.anything`` first runs ``dasktensor/__init__.py``, which imports PyTensor: 1-2 s
that a bare ``dask worker`` (started without ``--preload dasktensor``) would otherwise pay
on the first build of a model that does not even use PyTensor.  So this package imports
only the standard library, NumPy, ``dask.config`` and ``distributed``, and never
``dasktensor``, ``pytensor`` or ``pymc`` (``tests/test_worker_side.py`` checks it).

Modules:

* :mod:`dasktensor_worker.wire`: the data plane of the calls (framed messages on plain or
  TLS sockets, the worker's call server), used by both sides (caller and worker);
* :mod:`dasktensor_worker.replica`: one model object on one worker and how many calls it
  runs at once;
* :mod:`dasktensor_worker.batching`: ``batched`` (``dt.batched``), concurrent calls of a
  method coalesced into one vectorised evaluation;
* :mod:`dasktensor_worker.plugin`: :class:`~dasktensor_worker.plugin.ModelHost`, the
  ``distributed.WorkerPlugin`` that holds a worker's replicas and runs their call server;
* :mod:`dasktensor_worker.tasks`: the functions the caller ships to the cluster (the build
  task, and the ``client.run`` / ``run_on_scheduler`` helpers);
* :mod:`dasktensor_worker.calllog`: each worker's log of the calls it answered;
* :mod:`dasktensor_worker.devices`: the GPUs a process sees (``CUDA_VISIBLE_DEVICES``,
  ``nvidia-smi``) and the short label of a worker's device (``"GPU 0 (NAME)"``,
  ``"cpu"``) that the calls page and a function's plan show;
* :mod:`dasktensor_worker.monitor`: the scheduler's channel monitor, which gathers the
  call logs for the dashboard page, the Prometheus metrics and ``dt.Adaptive``;
* :mod:`dasktensor_worker.pages`: ``CallsPage``, the scheduler plugin a client registers
  to start the monitor and add its page (no Bokeh);
* :mod:`dasktensor_worker.dashboard`: the dashboard's calls page (Bokeh; ``dask scheduler
  --preload dasktensor_worker.dashboard``).

Importing this package itself imports nothing heavy (not even ``distributed``);
``dasktensor_worker.ModelHost`` is loaded on first use.  A model's module may mark its
methods with ``from dasktensor_worker import batched`` (NumPy only) where workers do not
have PyTensor.
"""

from __future__ import annotations

from dasktensor_worker.batching import batched as batched

__all__ = ["ModelHost", "batched"]


def __getattr__(name: str):
    if name == "ModelHost":  # imports distributed: only when asked for
        from dasktensor_worker.plugin import ModelHost

        return ModelHost
    raise AttributeError(f"module 'dasktensor_worker' has no attribute {name!r}")
