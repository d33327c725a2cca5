"""A small UM-Bridge model and its server: the first example of the user guide's page
"Remote models over UM-Bridge" (``docs/user-guide/umbridge.md``) talks to it.

``Decay`` maps ``theta = [y0, k]`` to ``y0 exp(-k t)`` at five times and offers its
gradient (the vector-Jacobian product), so NUTS can sample through it.  Serve it with
UM-Bridge's own Python server::

    python docs/examples/decay_server.py 4242

Any ``umbridge.Model`` works the same way, served from a container or another host.
"""

from __future__ import annotations

import sys

import numpy as np
import umbridge

TIMES = np.array([0.0, 0.5, 1.0, 2.0, 4.0])


class Decay(umbridge.Model):
    """``y(t) = y0 exp(-k t)`` at ``TIMES``, for ``theta = [y0, k]``."""

    def __init__(self, name: str = "forward"):
        super().__init__(name)

    def get_input_sizes(self, config):
        return [2]

    def get_output_sizes(self, config):
        return [len(TIMES)]

    def __call__(self, parameters, config):
        y0, k = parameters[0]
        return [(y0 * np.exp(-k * TIMES)).tolist()]

    def gradient(self, out_wrt, in_wrt, parameters, sens, config):
        y0, k = parameters[0]
        e = np.exp(-k * TIMES)
        jacobian = np.stack([e, -TIMES * y0 * e], axis=1)  # d y / d [y0, k]
        return (np.asarray(sens) @ jacobian).tolist()

    def supports_evaluate(self):
        return True

    def supports_gradient(self):
        return True


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4242
    umbridge.serve_models([Decay()], port, max_workers=4)
