"""Ops wrapping Python callables, and their concurrent calls outside the DASK mode.

* ``_callable.py``: ``ArraysToArraysOp``, ``LogpOp``, ``LogpGradOp`` (heavy by
  declaration: the planner gives each call a task of its own) and the call-target
  protocol, :class:`RemoteCallTarget`, that remote models implement;
* ``_parallel_calls.py``: the rewrite merging independent calls into one
  :class:`ParallelCallsOp` that runs them at once, in PyTensor's other modes (what
  ``pm.sample`` uses by default).
"""

from dasktensor.ops._callable import ArraysToArraysOp as ArraysToArraysOp
from dasktensor.ops._callable import LogpGradOp as LogpGradOp
from dasktensor.ops._callable import LogpOp as LogpOp
from dasktensor.ops._callable import RemoteCallTarget as RemoteCallTarget
from dasktensor.ops._callable import arrays_to_arrays_op as arrays_to_arrays_op
from dasktensor.ops._callable import logp_grad_op as logp_grad_op
from dasktensor.ops._callable import logp_op as logp_op
from dasktensor.ops._parallel_calls import ParallelCallsOp as ParallelCallsOp

__all__ = [
    "ArraysToArraysOp",
    "LogpGradOp",
    "LogpOp",
    "ParallelCallsOp",
    "RemoteCallTarget",
    "arrays_to_arrays_op",
    "logp_grad_op",
    "logp_op",
]
