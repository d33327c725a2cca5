"""UM-Bridge models served by ``umbridge.serve_models`` in a subprocess (``tests/
test_umbridge.py``): ``python tests/_umbridge_models.py PORT [LOG]``.

* ``decay``: ``y(t) = y0 exp(-k t)`` on 5 times for ``theta = [y0, k]``, and a second
  output ``[y0 * k]``; Evaluate, Gradient and ApplyJacobian.  ``config={"delay": s}``
  sleeps ``s`` seconds a call; with ``LOG``, each Evaluate appends its start and stop
  times to that file.
* ``plain``: the same trajectory, Evaluate only.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import umbridge

T = np.array([0.0, 0.5, 1.0, 2.0, 4.0])


def trajectory(theta):
    y0, k = theta
    return y0 * np.exp(-k * T)


def jacobian(theta, out):
    """d output ``out`` / d theta, a matrix (rows: output entries)."""
    y0, k = theta
    if out == 0:
        y = trajectory(theta)
        return np.stack([y / y0, -T * y], axis=1)
    return np.array([[k, y0]])


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
        time.sleep(float(config.get("delay", 0.0)))
        theta = np.asarray(parameters[0])
        out = [trajectory(theta).tolist()]
        if self.derivatives:
            out.append([float(theta[0] * theta[1])])
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{start} {time.time()}\n")
        return out

    def gradient(self, out_wrt, in_wrt, parameters, sens, config):
        return (np.asarray(sens) @ jacobian(np.asarray(parameters[0]), out_wrt)).tolist()

    def apply_jacobian(self, out_wrt, in_wrt, parameters, vec, config):
        return (jacobian(np.asarray(parameters[0]), out_wrt) @ np.asarray(vec)).tolist()

    def supports_evaluate(self):
        return True

    def supports_gradient(self):
        return self.derivatives

    def supports_apply_jacobian(self):
        return self.derivatives


if __name__ == "__main__":
    port = int(sys.argv[1])
    log = sys.argv[2] if len(sys.argv) > 2 else None
    models = [Decay("decay", log=log), Decay("plain", derivatives=False)]
    umbridge.serve_models(models, port, max_workers=4)
