"""Ops used by the benchmarks, in an importable module so that worker processes can
unpickle the graphs that contain them (``pickle`` stores the class by module and name).
"""

from __future__ import annotations

import time

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor import as_tensor_variable

from dasktensor_worker import batched as dt_batched


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


class GpuPriced:
    """P14/P15: a normal likelihood over 1,000 rows priced like a GPU model: ``base`` s a
    call plus ``per_row`` s per row of it (slept), whatever the arithmetic costs.
    ``logp`` is batched; ``logp_alone`` is the same arithmetic for one vector, unbatched."""

    def __init__(self, base: float = 0.010, per_row: float = 0.0005):
        self.data = np.random.default_rng(0).normal(1.0, 0.5, size=1000)
        self.base, self.per_row = base, per_row

    @dt_batched(max_size=64)
    def logp(self, theta):  # (calls, 2): mu, log_sigma
        time.sleep(self.base + self.per_row * len(theta))
        r = self.data[None, :] - theta[:, 0:1]
        return -0.5 * (r**2).sum(axis=1) * np.exp(-2 * theta[:, 1]) - 1000 * theta[:, 1]

    @dt_batched(max_size=64, wait=0)
    def logp_eager(self, theta):  # the same, a batch never waiting for more calls
        return self.logp(theta)  # (called here, the plain method)

    def logp_alone(self, theta):  # (2,)
        time.sleep(self.base + self.per_row)
        r = self.data - theta[0]
        return -0.5 * (r**2).sum() * np.exp(-2 * theta[1]) - 1000 * theta[1]

    @dt_batched(max_size=64)
    def logp_grad(self, theta):
        time.sleep(self.base + self.per_row * len(theta))
        mu, log_sigma = theta[:, 0:1], theta[:, 1:2]
        r = self.data[None, :] - mu
        s = np.exp(-2 * log_sigma)
        logp = -0.5 * (r**2 * s).sum(axis=1) - 1000 * log_sigma[:, 0]
        return logp, np.stack([(r * s).sum(axis=1), (r**2 * s).sum(axis=1) - 1000], axis=1)

    def logp_grad_alone(self, theta):
        time.sleep(self.base + self.per_row)
        r = self.data - theta[0]
        s = np.exp(-2 * theta[1])
        logp = -0.5 * (r**2 * s).sum() - 1000 * theta[1]
        return logp, np.array([(r * s).sum(), (r**2 * s).sum() - 1000])


class MLP:
    """P17: a CPU stand-in for a neural surrogate, 2 layers of 1,000 x 1,000 (tanh), from
    a parameter vector of 2 to a scalar."""

    def __init__(self, width: int = 1000):
        rng = np.random.default_rng(0)
        self.w0 = rng.normal(size=(2, width))
        self.w1 = rng.normal(size=(width, width)) / np.sqrt(width)
        self.w2 = rng.normal(size=(width, width)) / np.sqrt(width)
        self.out = rng.normal(size=width) / np.sqrt(width)

    @dt_batched(max_size=64)
    def forward(self, theta):  # (calls, 2)
        h = np.tanh(theta @ self.w0)
        h = np.tanh(h @ self.w1)
        h = np.tanh(h @ self.w2)
        return h @ self.out

    def forward_alone(self, theta):  # (2,)
        h = np.tanh(theta @ self.w0)
        h = np.tanh(h @ self.w1)
        h = np.tanh(h @ self.w2)
        return h @ self.out


class SlowCall:
    """P18: a "50 ms model": ``work`` sleeps ``seconds`` and returns the process id of the
    worker that answered (which of the workers served the call)."""

    def __init__(self, seconds: float = 0.05):
        self.seconds = float(seconds)

    def work(self, x):
        import os

        time.sleep(self.seconds)
        return os.getpid()


class StageWork(Op):
    """One stage of a pipelined pmap (P24-P26): sleeps ``seconds`` per run, then returns
    ``x + 1`` -- or, with ``expand=n``, ``n`` values per element (a large intermediate),
    or, with ``reduce=True``, the mean over the last axis (a small result).

    Not heavy: it sits inside a ``dt.annotate`` block, which is the stage.  It vectorises
    as itself, so a chunk is one run whatever its size.
    """

    __props__ = ("seconds", "expand", "reduce")

    def __init__(self, seconds: float, expand: int | None = None, reduce: bool = False):
        self.seconds = float(seconds)
        self.expand = expand
        self.reduce = reduce

    def make_node(self, x):
        from pytensor.tensor import tensor

        x = as_tensor_variable(x)
        if self.expand is not None:
            out = tensor(dtype=x.dtype, shape=(*x.type.shape[:-1], self.expand))
        elif self.reduce:
            out = tensor(dtype=x.dtype, shape=(*x.type.shape[:-1], 1))
        else:
            out = x.type()
        return Apply(self, [x], [out])

    def perform(self, node, inputs, output_storage):
        (x,) = inputs
        time.sleep(self.seconds)
        if self.expand is not None:
            out = np.repeat(x[..., :1], self.expand, axis=-1) + 1.0
        elif self.reduce:
            out = x.mean(axis=-1, keepdims=True)
        else:
            out = x + 1
        output_storage[0][0] = np.asarray(out, dtype=node.outputs[0].dtype)


def _vectorize_stage_work(op, node, x):
    return op.make_node(x)


def _register() -> None:
    from pytensor.graph.replace import _vectorize_node

    _vectorize_node.register(StageWork)(_vectorize_stage_work)


_register()


class RowSum:
    """P27: the most trivial batched model, a row sum: what one replica's calls/s is
    when the model costs (nearly) nothing.  ``rowsum`` batches up to 64 calls;
    ``rowsum_alone`` is the same method with ``max_size=1`` (every call alone)."""

    @dt_batched(max_size=64)
    def rowsum(self, x):  # (calls, 8)
        return x.sum(axis=1)

    @dt_batched(max_size=1)
    def rowsum_alone(self, x):  # (1, 8)
        return x.sum(axis=1)


class JaxMLP:
    """P27 (GPU): a JAX MLP surrogate, ``layers`` dense layers of ``width`` units (tanh),
    from a row of 8 to a scalar, on JAX's default device (a GPU if there is one).

    XLA compiles a function per input shape, slowly (PITFALLS), so a batch is padded up
    to the next of ``BUCKETS`` rows and the three shapes are compiled (and run once) in
    ``__init__``.  ``forward`` batches up to 64 calls; ``forward_alone`` is the same
    method with ``max_size=1``.  Both return ``(y, x.sum(axis=1))``: the row sum, exact
    in NumPy on the host, lets each caller check that it got its own row back.
    """

    BUCKETS = (1, 8, 64)

    def __init__(self, width: int = 8192, layers: int = 4, dim: int = 8):
        import jax
        import jax.numpy as jnp

        self.width, self.layers, self.dim = int(width), int(layers), int(dim)
        keys = jax.random.split(jax.random.PRNGKey(0), self.layers + 1)
        sizes = [self.dim] + [self.width] * self.layers
        self.weights = [
            jax.random.normal(keys[i], (sizes[i], sizes[i + 1]), jnp.float32) / np.sqrt(sizes[i])
            for i in range(self.layers)
        ]
        self.out = jax.random.normal(keys[-1], (self.width,), jnp.float32) / np.sqrt(self.width)

        def mlp(weights, out, x):
            h = x
            for w in weights:
                h = jnp.tanh(h @ w)
            return h @ out

        self._mlp = jax.jit(mlp)
        for n in self.BUCKETS:  # compile the few shapes now, not in the first calls
            x = jnp.zeros((n, self.dim), jnp.float32)
            self._mlp(self.weights, self.out, x).block_until_ready()

    def _run(self, x):  # (calls, dim) -> (calls,)
        n = len(x)
        bucket = next((b for b in self.BUCKETS if b >= n), n)
        padded = np.zeros((bucket, self.dim), np.float32)
        padded[:n] = x * 0.01
        return np.asarray(self._mlp(self.weights, self.out, padded))[:n]

    @dt_batched(max_size=64)
    def forward(self, x):  # (calls, dim)
        return self._run(x), x.sum(axis=1)

    @dt_batched(max_size=1)
    def forward_alone(self, x):  # (1, dim)
        return self._run(x), x.sum(axis=1)

    def backend(self) -> str:
        """JAX's backend on the worker (``"gpu"``, ``"cpu"``...) and its device."""
        import jax

        return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"

    def time_forward(self, n: int, repeat: int = 30) -> float:
        """Median seconds of this replica's work for a batch of ``n`` rows (padding, host
        to device, the MLP, back to the host), with no call around it."""
        x = np.arange(n * self.dim, dtype=np.float64).reshape(n, self.dim)
        self._run(x)
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self._run(x)
            samples.append(time.perf_counter() - t0)
        return float(np.median(samples))
