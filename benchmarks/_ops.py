"""Ops used by the benchmarks, in an importable module so that worker processes can
unpickle the graphs that contain them (``pickle`` stores the class by module and name).
"""

from __future__ import annotations

import time

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor import as_tensor_variable


class Sleep(Op):
    """``y = x + 1`` after sleeping ``seconds``: a stand-in for a remote model call.

    ``dasktensor_heavy = True`` makes the planner give every node a task of its own.
    ``seconds`` is part of ``__props__``, so two nodes with the same input would be
    merged by PyTensor; the benchmarks give every node its own input.
    """

    __props__ = ("seconds",)
    dasktensor_heavy = True
    dasktensor_name = "sleep"

    def __init__(self, seconds: float = 0.05):
        self.seconds = float(seconds)

    def make_node(self, x):
        x = as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        (x,) = inputs
        time.sleep(self.seconds)
        output_storage[0][0] = np.asarray(x + 1, dtype=node.outputs[0].dtype)

    def infer_shape(self, fgraph, node, shapes):
        return [shapes[0]]


def sleep_seconds(seconds: float) -> float:
    """The raw-Dask floor's task: sleep like a heavy node, with nothing around it."""
    time.sleep(seconds)
    return seconds


class Normal:
    """A remote model for the latency benchmarks: a standard normal's logp and gradient,
    after ``delay`` seconds of (simulated) work."""

    def __init__(self, delay: float = 0.0):
        self.delay = float(delay)

    def logp_grad(self, x):
        if self.delay:
            time.sleep(self.delay)
        return -0.5 * float(x @ x), -x
