"""Baseline latency of pytensor-federated's streamed remote logp+gradient call.

A pytensor-federated server (``ArraysToArraysService`` in a ``grpclib`` server) wraps
``logp, grad = -0.5 * x @ x, -x`` for a ``dim``-dimensional standard normal and runs in a
subprocess on 127.0.0.1 (a free port).  The client is a ``LogpGradServiceClient``, called
the way ``LogpGradOp.perform`` calls it: ``client(x)`` sends the inputs through the
client's bidirectional gRPC stream (``use_stream=True``, the default) and waits for the
answer.  Measured:

* ``first_call_s`` -- the first call including the client's set-up (channel, HTTP/2
  connection, opening the stream);
* ``median_s``, ``p90_s`` -- of ``calls`` single calls after warm-up, each a full round
  trip as a sampler makes them (``time.perf_counter``).

This is the baseline the dasktensor side of the latency benchmark is compared with.

Needs ``pytensor-federated`` (``pip install -e ".[benchmarks]"``).
Run: ``python benchmarks/_federated.py``
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np

HOST = "127.0.0.1"
WARMUP_CALLS = 100
READY_TIMEOUT_S = 60.0
# The server runs single-threaded, like a sampler's model process would.
_SERVER_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _import_federated():
    try:
        with warnings.catch_warnings():
            # 1.0.2 (the Python 3.11 line) imports a function PyTensor 2.38 has moved
            warnings.simplefilter("ignore", FutureWarning)
            import pytensor_federated
    except ImportError as exc:
        raise ImportError(
            "This benchmark needs pytensor-federated; install it with "
            '`pip install -e ".[benchmarks]"` (or `pip install pytensor-federated`).'
        ) from exc
    return pytensor_federated


def _logp_grad(x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Log-density of a standard normal (up to a constant) and its gradient."""
    return np.asarray(-0.5 * x @ x), [-x]


def _serve(port: int) -> None:
    """Run a pytensor-federated server for ``_logp_grad`` until the process is stopped."""
    import asyncio

    from grpclib.server import Server

    pf = _import_federated()

    async def run() -> None:
        service = pf.ArraysToArraysService(pf.wrap_logp_grad_func(_logp_grad))
        server = Server([service])
        await server.start(HOST, port)
        await server.wait_closed()

    asyncio.run(run())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _wait_until_listening(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"The federated server exited with code {proc.returncode}.")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"The federated server did not listen on {HOST}:{port} in time.")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def federated_client(dim: int = 10):
    """A pytensor-federated server for the ``dim``-dimensional normal, and a client of it.

    Yields ``(client, first_call_s, version)``: ``client(x) -> (logp, [grad])`` makes one
    streamed round trip; ``first_call_s`` timed the client's set-up and first call.  The
    server subprocess is stopped by its PID on exit.
    """
    pf = _import_federated()
    x = np.random.default_rng(0).normal(size=dim)
    expected = _logp_grad(x)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", str(port)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, **_SERVER_ENV},
    )
    try:
        _wait_until_listening(proc, port)
        t0 = time.perf_counter()
        client = pf.LogpGradServiceClient(HOST, port)
        logp, grads = client(x)
        first_call_s = time.perf_counter() - t0
        np.testing.assert_allclose(logp, expected[0])
        np.testing.assert_allclose(grads[0], expected[1][0])
        for _ in range(WARMUP_CALLS):
            client(x)
        yield client, first_call_s, pf.__version__
        # closes the stream and the channel (ArraysToArraysServiceClient.__del__) while
        # the server still runs
        del client
    finally:
        _stop(proc)


def federated_latency(calls: int = 2000, dim: int = 10) -> dict:
    """Time pytensor-federated's streamed logp+gradient call to a local server subprocess.

    Returns ``{"median_s", "p90_s", "first_call_s", "version"}`` (seconds per call and the
    pytensor-federated version).
    """
    x = np.random.default_rng(0).normal(size=dim)
    with federated_client(dim) as (client, first_call_s, version):
        times = np.empty(calls)
        for i in range(calls):
            t0 = time.perf_counter()
            client(x)
            times[i] = time.perf_counter() - t0
    return {
        "median_s": float(np.median(times)),
        "p90_s": float(np.percentile(times, 90)),
        "first_call_s": first_call_s,
        "version": version,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]))
    else:
        result = federated_latency()
        print(f"pytensor-federated {result['version']}, Python {sys.version.split()[0]}")
        for key in ("median_s", "p90_s", "first_call_s"):
            print(f"{key:>13}: {result[key] * 1e6:10.1f} us")
