"""dasktensor: run PyTensor graphs on Dask.

Independent expensive parts of a PyTensor graph (remote model calls, annotated
subgraphs, large matrix work) run in parallel as Dask tasks, locally or on a distributed
cluster; everything cheap is fused into a few stages compiled by PyTensor's own backend.
Importing dasktensor registers the ``"DASK"`` mode with PyTensor.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from dasktensor import _config  # noqa: F401  (loads dasktensor.yaml into dask.config)
from dasktensor._function import DaskFunction as DaskFunction
from dasktensor._function import function as function
from dasktensor._linker import DASK as DASK
from dasktensor._linker import DaskLinker as DaskLinker
from dasktensor._linker import dask_mode as dask_mode
from dasktensor._placement import Placement as Placement
from dasktensor.cluster import Adaptive as Adaptive
from dasktensor.cluster import ClusterInfo as ClusterInfo
from dasktensor.cluster import NoGPUError as NoGPUError
from dasktensor.cluster import NoWorkerWithResourcesError as NoWorkerWithResourcesError
from dasktensor.cluster import SchedulerLostError as SchedulerLostError
from dasktensor.cluster import calls_link as calls_link
from dasktensor.cluster import connect as connect
from dasktensor.cluster import info as info
from dasktensor.dataparallel import Pipeline as Pipeline
from dasktensor.dataparallel import PMapped as PMapped
from dasktensor.dataparallel import compute_log_likelihood as compute_log_likelihood
from dasktensor.dataparallel import pmap as pmap
from dasktensor.dataparallel import sample_posterior_predictive as sample_posterior_predictive
from dasktensor.engine import Placed as Placed
from dasktensor.engine import Plan as Plan
from dasktensor.engine import Task as Task
from dasktensor.engine import annotate as annotate
from dasktensor.engine import is_heavy as is_heavy
from dasktensor.engine import mark_heavy as mark_heavy
from dasktensor.engine import plan_graph as plan_graph
from dasktensor.ops import ArraysToArraysOp as ArraysToArraysOp
from dasktensor.ops import LogpGradOp as LogpGradOp
from dasktensor.ops import LogpOp as LogpOp
from dasktensor.ops import ParallelCallsOp as ParallelCallsOp
from dasktensor.ops import arrays_to_arrays_op as arrays_to_arrays_op
from dasktensor.ops import logp_grad_op as logp_grad_op
from dasktensor.ops import logp_op as logp_op
from dasktensor.remote import ClusterSummary as ClusterSummary
from dasktensor.remote import RemoteModel as RemoteModel
from dasktensor.remote import RemoteModelError as RemoteModelError
from dasktensor.remote import UMBridgeError as UMBridgeError
from dasktensor.remote import cluster_summary as cluster_summary
from dasktensor.remote import serve_umbridge as serve_umbridge
from dasktensor.remote import umbridge_op as umbridge_op
from dasktensor.sampling import StoreMismatchError as StoreMismatchError
from dasktensor.sampling import sample as sample
from dasktensor_worker.batching import batched as batched

try:
    __version__ = _version("dasktensor")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "Adaptive",
    "ArraysToArraysOp",
    "ClusterInfo",
    "ClusterSummary",
    "DASK",
    "DaskFunction",
    "DaskLinker",
    "LogpGradOp",
    "LogpOp",
    "NoGPUError",
    "NoWorkerWithResourcesError",
    "PMapped",
    "Pipeline",
    "ParallelCallsOp",
    "Placed",
    "Placement",
    "Plan",
    "RemoteModel",
    "RemoteModelError",
    "SchedulerLostError",
    "StoreMismatchError",
    "UMBridgeError",
    "Task",
    "annotate",
    "arrays_to_arrays_op",
    "batched",
    "calls_link",
    "compute_log_likelihood",
    "cluster_summary",
    "connect",
    "dask_mode",
    "function",
    "info",
    "is_heavy",
    "logp_grad_op",
    "logp_op",
    "mark_heavy",
    "plan_graph",
    "pmap",
    "sample",
    "sample_posterior_predictive",
    "serve_umbridge",
    "umbridge_op",
]
