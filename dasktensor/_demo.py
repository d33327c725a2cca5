"""The graph behind ``dasktensor demo``: four slow model calls between cheap stages."""

from __future__ import annotations

import time

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op


class SlowModel(Op):
    """Stand-in for an expensive model call: sleeps ``delay`` seconds, then ``sin(x) * k``.

    Marked heavy, so the planner gives each call a task of its own.
    """

    dasktensor_heavy = True
    dasktensor_name = "slow-model"
    __props__ = ("delay", "k")

    def __init__(self, delay: float, k: float):
        self.delay = float(delay)
        self.k = float(k)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        if x.ndim != 1:
            raise TypeError(f"{self} expected a vector, got {x.type}")
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        time.sleep(self.delay)
        outputs[0][0] = np.sin(inputs[0]) * self.k


def demo_graph(delay: float, n_models: int = 4, n_cheap: int = 50):
    """A branchy graph: cheap preprocessing, ``n_models`` slow calls, cheap combination."""
    x = pt.vector("x")
    h = x
    for i in range(n_cheap):  # cheap nodes before the models
        h = pt.tanh(h * (1.0 + i / n_cheap)) + x
    ys = [SlowModel(delay, k + 1.0)(h + k) for k in range(n_models)]
    total = sum((y**2).sum() for y in ys)
    return x, [total, pt.stack([y.mean() for y in ys])]
