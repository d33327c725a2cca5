"""Heavy Ops for the PyMC integration tests (``tests/test_pymc.py``).

They live in an importable module, not in the test file, so that PyMC's ``spawn``
children and the workers of a distributed cluster can unpickle graphs that contain them.

Both Ops set ``dasktensor_heavy = True``: the planner gives each node a task of its own,
so a PyMC logp/dlogp function that contains them is a multi-task plan that really runs on
a Dask scheduler (the threaded one, or a distributed client).

Every ``perform`` records where it ran, once per (log file, process, thread, Op class),
into the file named by the environment variable :data:`LOG_ENV` when it is set.  Tests
read that file to see that heavy tasks ran in Dask's threads inside PyMC's sampler
processes.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

LOG_ENV = "DASKTENSOR_TEST_HEAVY_LOG"

_seen: set[tuple[str, int, str, str]] = set()
_seen_lock = threading.Lock()


def _record(op: Op) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    key = (path, os.getpid(), threading.current_thread().name, type(op).__name__)
    with _seen_lock:
        if key in _seen:
            return
        _seen.add(key)
    with open(path, "a") as f:  # one short line per append: atomic enough across processes
        f.write("\t".join(map(str, key[1:])) + "\n")


def read_log(path) -> list[tuple[int, str, str]]:
    """The ``(pid, thread name, Op class name)`` rows recorded in ``path``."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            pid, thread, op = line.rstrip("\n").split("\t")
            rows.append((int(pid), thread, op))
    return rows


class HeavyScale(Op):
    """``factor * x``, elementwise, computed in numpy; its gradient is again a HeavyScale."""

    dasktensor_heavy = True
    dasktensor_name = "heavy-scale"
    __props__ = ("factor",)

    def __init__(self, factor: float):
        self.factor = float(factor)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        _record(self)
        (x,) = inputs
        outputs[0][0] = np.asarray(self.factor * x, dtype=node.outputs[0].dtype)

    def infer_shape(self, *args):  # (fgraph, node, shapes) on PyTensor 2, (node, shapes) on 3
        return [args[-1][0]]

    # the vector-Jacobian product is ``pullback`` on PyTensor 3 and ``L_op`` on PyTensor 2
    def pullback(self, inputs, outputs, output_grads):
        return [HeavyScale(self.factor)(output_grads[0])]

    L_op = pullback


class HeavyNormalLogp(Op):
    """Sum of the ``Normal(0, sigma)`` log-densities of the entries of ``x`` (a scalar).

    Its gradient is ``g * HeavyScale(-1 / sigma**2)(x)``: a second heavy node, independent
    of this one, so that the logp/dlogp function has two heavy tasks that can run at once.
    """

    dasktensor_heavy = True
    dasktensor_name = "heavy-normal-logp"
    __props__ = ("sigma",)

    def __init__(self, sigma: float = 1.0):
        self.sigma = float(sigma)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [pt.scalar(dtype=x.dtype)])

    def perform(self, node, inputs, outputs):
        _record(self)
        (x,) = inputs
        z = x / self.sigma
        logp = -0.5 * np.sum(z * z) - x.size * (math.log(self.sigma) + 0.5 * math.log(2 * math.pi))
        outputs[0][0] = np.asarray(logp, dtype=node.outputs[0].dtype)

    def infer_shape(self, *args):
        return [()]

    def pullback(self, inputs, outputs, output_grads):
        (x,) = inputs
        return [output_grads[0] * HeavyScale(-1.0 / self.sigma**2)(x)]

    L_op = pullback
