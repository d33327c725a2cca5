"""Heavy test Ops, importable by worker processes (tests/ is on their sys.path)."""

from __future__ import annotations

import time

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op


class Scale(Op):
    """Heavy ``x * k`` that sleeps ``delay`` seconds; fails when ``x`` holds ``fail_on``."""

    dasktensor_heavy = True
    dasktensor_name = "scale-heavy"
    __props__ = ("k", "delay", "fail_on")

    def __init__(self, k: float = 2.0, delay: float = 0.0, fail_on: float | None = None):
        self.k = k
        self.delay = delay
        self.fail_on = fail_on

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        (x,) = inputs
        if self.fail_on is not None and np.any(x == self.fail_on):
            raise ValueError(f"scale-heavy refuses {self.fail_on}")
        if self.delay:
            time.sleep(self.delay)
        outputs[0][0] = np.asarray(x * self.k, dtype=node.outputs[0].dtype)


CALLS = {"normal": 0}


def normal_logp_and_grad(x, mu):
    """log N(x | mu, 1) summed, and its gradients with respect to x and mu."""
    CALLS["normal"] += 1
    r = x - mu
    return -0.5 * float(r @ r), -r, np.asarray(r.sum())


def strided_sum_and_first(x):
    """Depends on the memory layout only if strides are mishandled."""
    return np.array([x.sum(), x[0, -1]])


def make_rendezvous(parties: int):
    """A logp+grad function whose calls only return once ``parties`` calls are running.

    Run one after another, the first call would wait forever: its barrier times out and
    raises ``threading.BrokenBarrierError`` instead.
    """
    import threading

    barrier = threading.Barrier(parties, timeout=30)

    def rendezvous_normal(x):
        barrier.wait()
        return -0.5 * float(x @ x), -x

    return rendezvous_normal


def failing_logp(x):
    if np.any(x < 0):
        raise FloatingPointError("negative input refused by the model")
    return float(x.sum())


def slow_unless_positive(x):
    """Hangs (30 s) on non-positive input: a stand-in for a model that does not answer."""
    if np.any(x <= 0):
        time.sleep(30)
    return float(x.sum())


def fails_first_time(x, marker: str):
    """Raises on the first call in the whole cluster (a file records it), then works."""
    import os

    if not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("transient failure of the model service")
    return float(x.sum())
