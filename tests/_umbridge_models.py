"""UM-Bridge models served by ``umbridge.serve_models`` in a subprocess (``tests/
test_umbridge.py``): ``python tests/_umbridge_models.py PORT [LOG]``.

* ``decay``: ``y(t) = y0 exp(-k t)`` on 5 times for ``theta = [y0, k]``, and a second
  output ``[y0 * k]``; Evaluate, Gradient, ApplyJacobian and ApplyHessian.
  ``config={"delay": s}`` sleeps ``s`` seconds a call; with ``LOG``, each Evaluate
  appends its start and stop times and its process id to that file.  For the server's
  tests, Evaluate's config may also ask it to append its process id to the file
  ``"started"`` when it starts, to raise ``ValueError(config["fail"])``, or to return a
  trajectory one entry ``"short"``.
* ``plain``: the same trajectory, Evaluate only.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import umbridge

from dasktensor_worker.batching import batched

T = np.array([0.0, 0.5, 1.0, 2.0, 4.0])


def trajectory(theta):
    y0, k = theta
    return y0 * np.exp(-k * T)


def jacobian(theta, out):
    """d output ``out`` / d theta, a matrix (rows: output entries)."""
    y0, k = theta
    if out == 0:
        e = np.exp(-k * T)
        return np.stack([e, -T * y0 * e], axis=1)
    return np.array([[k, y0]])


def hessian(theta, out, sens):
    """The Hessian of ``sens @ output[out]`` with respect to theta (2 x 2)."""
    y0, k = theta
    if out == 0:
        e = np.exp(-k * T)
        cross = sens @ (-T * e)
        return np.array([[0.0, cross], [cross, sens @ (T * T * y0 * e)]])
    return sens[0] * np.array([[0.0, 1.0], [1.0, 0.0]])


class Decay(umbridge.Model):
    def __init__(self, name="decay", derivatives=True, log=None):
        super().__init__(name)
        self.derivatives = derivatives
        self.log = log

    def get_input_sizes(self, config):
        return [2]

    def get_output_sizes(self, config):
        return [5, 1] if self.derivatives else [5]

    def __call__(self, parameters, config):
        start = time.time()
        if "started" in config:
            with open(config["started"], "a") as f:
                f.write(f"{os.getpid()}\n")
        time.sleep(float(config.get("delay", 0.0)))
        if "fail" in config:
            raise ValueError(config["fail"])
        theta = np.asarray(parameters[0])
        out = [trajectory(theta).tolist()]
        if self.derivatives:
            out.append([float(theta[0] * theta[1])])
        if config.get("short"):
            out[0] = out[0][:-1]
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{start} {time.time()} {os.getpid()}\n")
        return out

    def gradient(self, out_wrt, in_wrt, parameters, sens, config):
        return (np.asarray(sens) @ jacobian(np.asarray(parameters[0]), out_wrt)).tolist()

    def apply_jacobian(self, out_wrt, in_wrt, parameters, vec, config):
        return (jacobian(np.asarray(parameters[0]), out_wrt) @ np.asarray(vec)).tolist()

    def apply_hessian(self, out_wrt, in_wrt1, in_wrt2, parameters, sens, vec, config):
        h = hessian(np.asarray(parameters[0]), out_wrt, np.asarray(sens))
        return (h @ np.asarray(vec)).tolist()

    def supports_evaluate(self):
        return True

    def supports_gradient(self):
        return self.derivatives

    def supports_apply_jacobian(self):
        return self.derivatives

    def supports_apply_hessian(self):
        return self.derivatives


class BatchedDecay(Decay):
    """``decay`` whose Evaluate serves concurrent calls as one batch (``@dt.batched`` with
    ``stack=False``: a list of each argument, one item per call); it keeps the sizes of
    its batches (``batch_sizes()``).  ``config={"delay": s}`` sleeps ``s`` a batch."""

    def __init__(self, name="batched"):
        super().__init__(name)
        self.sizes = []

    @batched(stack=False, max_size=8)
    def __call__(self, parameters, config):
        self.sizes.append(len(parameters))
        time.sleep(max(float(c.get("delay", 0.0)) for c in config))
        return [Decay.__call__(self, p, {}) for p in parameters]

    def batch_sizes(self):
        return list(self.sizes)


if __name__ == "__main__":
    port = int(sys.argv[1])
    log = sys.argv[2] if len(sys.argv) > 2 else None
    models = [Decay("decay", log=log), Decay("plain", derivatives=False)]
    umbridge.serve_models(models, port, max_workers=4)
