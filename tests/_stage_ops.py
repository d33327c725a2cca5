"""An Op for pipelined pmaps: it sleeps, and says when and where it ran.

``Stamped(seconds, resource)(x)`` returns ``x + 1`` and a stamp ``[start, end, offered,
pid]``: wall-clock times of its run, whether the Dask worker running it offers
``resource`` (1.0), does not (0.0) or is no Dask worker at all (-1.0), and the process.
It vectorises as itself (a chunk of any size is one run), so a pmap with chunks of one
element runs it once per chunk.  Importable by worker processes (tests/ is on their path).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.replace import _vectorize_node


class Stamped(Op):
    __props__ = ("seconds", "resource")

    def __init__(self, seconds: float, resource: str):
        self.seconds = seconds
        self.resource = resource

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type(), pt.vector(dtype="float64", shape=(4,))])

    def perform(self, node, inputs, outputs):
        start = time.time()
        time.sleep(self.seconds)
        try:
            from distributed import get_worker

            offered = float(get_worker().state.total_resources.get(self.resource, 0) >= 1)
        except ValueError:  # not in a Dask worker
            offered = -1.0
        outputs[0][0] = np.asarray(inputs[0] + 1.0, dtype=node.outputs[0].dtype)
        outputs[1][0] = np.array([start, time.time(), offered, os.getpid()])


@_vectorize_node.register(Stamped)
def _vectorize_stamped(op, node, x):
    return op.make_node(x)


class OnlyWith(Op):
    """``x`` unchanged, after checking that the Dask worker running it offers
    ``resource``: a stage that ran on another worker fails.  Outside any worker (PyMC's
    one-draw run in the caller, which the posterior predictive takes as its template) it
    passes."""

    __props__ = ("resource",)

    def __init__(self, resource: str):
        self.resource = resource

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        from distributed import get_worker

        try:
            offered = get_worker().state.total_resources
        except ValueError:  # not in a worker
            offered = {self.resource: 1}
        if offered.get(self.resource, 0) < 1:
            raise RuntimeError(f"ran on a worker offering {offered}, not {self.resource}")
        outputs[0][0] = np.array(inputs[0], copy=True)


@_vectorize_node.register(OnlyWith)
def _vectorize_only_with(op, node, x):
    return op.make_node(x)
