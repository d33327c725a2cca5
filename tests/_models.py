"""Model classes for RemoteModel tests (importable by worker processes)."""

from __future__ import annotations

import os
import time

import numpy as np

from dasktensor_worker import batched


class Probe:
    """A model that says where it runs; every build appends its process id to a file."""

    def __init__(self, log: str | None = None, delay: float = 0.0):
        self.pid = os.getpid()
        self.delay = delay
        self.calls = 0
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{self.pid}\n")

    def logp_grad(self, x, mu):
        """log N(x | mu, 1) summed, and its gradients with respect to x and mu."""
        self.calls += 1
        time.sleep(self.delay)
        r = x - mu
        return -0.5 * float(r @ r), -r, np.asarray(r.sum())

    def where(self, seconds=0.0):
        """Sleeps, then returns this process's id and when the call ran."""
        t0 = time.time()
        time.sleep(float(seconds))
        return self.pid, np.array([t0, time.time()])

    def sum_and_corner(self, x):
        """Depends on the memory layout only if strides are mishandled."""
        return np.array([x.sum(), x[0, -1]])

    def refuse(self, x):
        raise FloatingPointError(f"the model refuses {x.tolist()}")

    def fails_first_time(self, x, marker):
        """Raises on the first call in the whole cluster (a file records it), then works."""
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise ConnectionError("transient failure of the model service")
        return float(np.sum(x))

    def scale(self, x, k):
        return x * k

    def scale_in_a_list(self, x, k):  # one output as pytensor-federated's functions give it
        return [x * k]


def broken_factory():
    raise RuntimeError("weights file not found")


def record_then_sleep(pidfile: str, seconds: float):
    """A model function for the killed-worker test: says where it runs, then works."""

    class Sleeper:
        def work(self, x):
            with open(pidfile, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(seconds)
            return x * 2.0

    return Sleeper()


class Doubler:
    """A batched model: ``double`` takes the waiting calls' rows at once (``delay`` s a
    batch, whatever its size)."""

    def __init__(self, delay: float = 0.05):
        self.delay = delay

    @batched
    def double(self, x):  # (calls, n)
        time.sleep(self.delay)
        return 2 * x


class Decay:
    """A vector-valued simulator with its vjp and jvp: ``y(t) = y0 exp(-k t)`` on a
    grid of times, for ``theta = [y0, k]``; the trajectory of each ``theta`` solved is
    kept (keyed by its bytes), so the vjp at the same point reuses it, as an ODE
    solver's adjoint reuses its forward solution."""

    def __init__(self, times=(0.0, 0.5, 1.0, 2.0, 4.0), delay: float = 0.0):
        self.t = np.asarray(times, dtype=float)
        self.delay = delay
        self.solved: dict[bytes, np.ndarray] = {}
        self.reused = 0

    def solve(self, theta):
        time.sleep(self.delay)
        y = theta[0] * np.exp(-theta[1] * self.t)
        if len(self.solved) > 64:
            self.solved.clear()
        self.solved[theta.tobytes()] = y
        return y

    def solve_vjp(self, theta, g):
        y = self.solved.get(theta.tobytes())
        if y is None:
            y = theta[0] * np.exp(-theta[1] * self.t)
        else:
            self.reused += 1
        return np.array([g @ (y / theta[0]), g @ (-self.t * y)])

    def solve_jvp(self, theta, v):
        y = theta[0] * np.exp(-theta[1] * self.t)
        return v[0] * y / theta[0] - v[1] * self.t * y

    def reuses(self):
        return self.reused
