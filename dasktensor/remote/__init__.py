"""Remote models: an object built once per worker and called straight on its workers.

``RemoteModel(factory)`` keeps a model (a simulator, a solver, a network on a GPU) alive on
the workers of a Dask cluster and turns its methods into Ops.  Dask places the model (the
control plane), and the calls then go straight to the workers that hold it on sockets of
their own (the data plane, ``dasktensor_worker.wire``): about a tenth of a millisecond on
loopback, instead of the ~13 ms of a task's round trip through the scheduler.

The caller's side, by concern (each module's docstring argues its part):

* :mod:`~dasktensor.remote._model`: :class:`RemoteModel`, the public front (options
  checked once into a :class:`~dasktensor.remote._spec.ModelSpec`, Ops made, calls
  delegated);
* :mod:`~dasktensor.remote._replicas`: the replica set, found or built with Dask tasks
  that honour the model's ``resources``, refreshed in the background, dropped on failure;
* :mod:`~dasktensor.remote._leases`: how long replicas live (the leases of the process
  that made a model, shared models' leases, the tasks holding a replica's resources);
* :mod:`~dasktensor.remote._probes`: silent workers found by probing their call servers;
* :mod:`~dasktensor.remote._policy`: the pure choice of a replica for each call (spreads
  load over replicas without coordination between callers);
* :mod:`~dasktensor.remote._channel`: this process's connections to the workers' call
  servers (pooled per worker, TLS with the client's credentials, reset after ``fork``);
* :mod:`~dasktensor.remote._calls`: one call's request, reply, retries and failover, and
  :func:`~dasktensor.remote._calls.call_many` for calls sent together;
* :mod:`~dasktensor.remote._target`: :class:`RemoteMethod`, a model's method as the
  function of a callable Op (a ``dasktensor.ops._callable.RemoteCallTarget``);
* :mod:`~dasktensor.remote._umbridge` and :mod:`~dasktensor.remote._umbridge_server`:
  UM-Bridge models as Ops (``dt.umbridge_op``), and remote models served to UM-Bridge
  clients (``dt.serve_umbridge``);
* :mod:`~dasktensor.remote._summary`: what the workers hold and answered
  (``dt.cluster_summary``, and a ``RemoteModel``'s view in Jupyter).

The worker's side (the plugin holding replicas, the call server and its messages, the
build task) is the top-level package ``dasktensor_worker``, which imports neither
dasktensor nor PyTensor: a bare ``dask worker`` serves models without that import.

Nothing here holds a live Client, Future or loop across pickling: a ``RemoteModel``
pickles as its factory, its options and its identity (``key``), so that its Ops can go
into ``pm.sample(cores=2)`` (fork or spawn) and reach the same replicas from there.
"""

from __future__ import annotations

from dasktensor.remote._model import RemoteModel as RemoteModel
from dasktensor.remote._spec import RemoteModelError as RemoteModelError
from dasktensor.remote._summary import ClusterSummary as ClusterSummary
from dasktensor.remote._summary import cluster_summary as cluster_summary
from dasktensor.remote._target import RemoteMethod as RemoteMethod
from dasktensor.remote._umbridge import UMBridgeError as UMBridgeError
from dasktensor.remote._umbridge import umbridge_op as umbridge_op
from dasktensor.remote._umbridge_server import UMBridgeServer as UMBridgeServer
from dasktensor.remote._umbridge_server import serve_umbridge as serve_umbridge

__all__ = [
    "ClusterSummary",
    "RemoteMethod",
    "RemoteModel",
    "RemoteModelError",
    "UMBridgeError",
    "UMBridgeServer",
    "cluster_summary",
    "serve_umbridge",
    "umbridge_op",
]
