"""A UM-Bridge server for P20-P22 (``umbridge.serve_models``, UM-Bridge's own):
``python benchmarks/_umbridge_server.py PORT [MAX_WORKERS]``.

``forward``: 2 inputs -> the 2-vector ``theta * 2`` after sleeping ``config["delay"]``
seconds (0 by default), with its Gradient.  Up to ``MAX_WORKERS`` requests at once (4 by
default; ``serve_models``'s own default is 1).  P22 also builds ``Forward`` on the
workers of a cluster, as ``dt.serve_umbridge``'s model."""

from __future__ import annotations

import sys
import time

import umbridge


class Forward(umbridge.Model):
    def __init__(self):
        super().__init__("forward")

    def get_input_sizes(self, config):
        return [2]

    def get_output_sizes(self, config):
        return [2]

    def __call__(self, parameters, config):
        time.sleep(float(config.get("delay", 0.0)))
        return [[2.0 * v for v in parameters[0]]]

    def gradient(self, out_wrt, in_wrt, parameters, sens, config):
        return [2.0 * s for s in sens]

    def supports_evaluate(self):
        return True

    def supports_gradient(self):
        return True


if __name__ == "__main__":
    max_workers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    umbridge.serve_models([Forward()], int(sys.argv[1]), max_workers=max_workers)
