"""P1: one remote logp+gradient round trip, against a raw socket echo and pytensor-federated.

A 10-dimensional standard normal, ``logp, grad = -0.5 * x @ x, -x``, served on this
machine on loopback, all measured in the same run, as a sampler calls: blocks of 250
calls back to back, the variants' blocks in turn (medians and 99th percentiles of every
call):

* **raw echo** (the floor): the bytes of dasktensor's request, length-prefixed, echoed by
  another process that reads them into a NumPy array (``_echo.py``); the same echo with
  both ends busy-polling before they sleep (as dasktensor's channel does,
  ``dasktensor.remote.busy-poll``: its floor); and the same bytes through a pyzmq
  ``REQ``/``REP`` pair (the messaging library a data plane could use);
* **pytensor-federated** (the baseline of the earlier issue): its gRPC server in a
  subprocess, called through its ``LogpGradServiceClient`` on the streamed path;
* **dasktensor**: a ``RemoteModel`` built on the one worker process of a ``LocalCluster``
  and called on that worker (``model.call``), inside a compiled PyTensor function of the
  log-density and its gradient, and inside a PyMC model's compiled logp+dlogp function
  (``Model.logp_dlogp_function``: what a sampler calls).

Targets: dasktensor's call <= 3x the raw echo and <= 0.15x pytensor-federated's, for the
median and the p99.  Printed first: where a call's time goes, each stage of the caller's
and the worker's side timed on its own (pickling, the replica's choice, the call log and
the model, unpickling), and the rest, sockets and wake-ups.  Also timed: dasktensor's
first call (from a new ``RemoteModel`` to its first result: building the replica, opening
the connection; target <= 0.3 s), and the same with the client's connection to the
scheduler included.  The cluster's worker starts the way ``dt.connect()`` starts them
(importing dasktensor as it starts).  Also timed: the first call on a bare worker that has
never imported dasktensor, with a model that needs NumPy only (:class:`BareNormal`); the
worker imports ``dasktensor_worker`` for it, not dasktensor nor PyTensor (~1 s on the 2.38
line), which the summary checks.

Needs ``pip install -e ".[benchmarks]"`` (pytensor-federated).
Run: ``python benchmarks/bench_p1_latency.py``
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    fmt_time,
    load_row,
    local_cluster,
    print_rows,
    print_table,
    quiet,
    versions_line,
)
from _echo import echo_servers, polling_echo

NAME = "p1-latency"
DIM = 10


class BareNormal:
    """``_ops.Normal`` without its module: ``_ops`` imports PyTensor, this module does not,
    so a bare worker unpickling this model imports no PyTensor either."""

    def logp_grad(self, x):
        return -0.5 * float(x @ x), -x


def _imported_pytensor() -> bool:
    return "pytensor" in sys.modules


def per_call(fns: dict, calls: int, warmup: int = 50, block: int = 250) -> dict:
    """Seconds of every call of each function, called as a sampler calls it: in blocks
    of ``block`` calls back to back, the functions' blocks in turn (the order reversed
    every other round), so that a slow phase of the machine hits all of them alike.
    (Interleaving single calls of several functions makes each call wait for a process
    that went to sleep meanwhile: PITFALLS.)"""
    import gc

    import numpy as np

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {k: np.empty(calls) for k in fns}
    names = list(fns)
    gc.disable()
    try:
        for r, start in enumerate(range(0, calls, block)):
            for name in names if r % 2 == 0 else reversed(names):
                fn, times = fns[name], samples[name]
                for i in range(start, min(start + block, calls)):
                    t0 = time.perf_counter()
                    fn()
                    times[i] = time.perf_counter() - t0
    finally:
        gc.enable()
    return samples


def _worker_stages(key: str, request: list, number: int = 2000, dask_worker=None) -> dict:
    """On the worker: seconds of each stage of answering one request, the call server's
    own functions timed in a loop (no socket)."""
    from dasktensor_worker import wire
    from dasktensor_worker.plugin import host_of

    host = host_of(dask_worker)
    _, method, args = wire.loads([bytearray(f) for f in request])
    reply = host.answer(key, method, args)
    stages = {
        "worker: unpickle the request": lambda: wire.loads([bytearray(f) for f in request]),
        "worker: run the call (log, model, reply tuple)": lambda: host.answer(key, method, args),
        "worker: pickle the reply": lambda: wire.dumps(reply),
    }
    return {k: _timed(fn, number) for k, fn in stages.items()}


def _timed(fn, number: int) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def caller_stages(model, x, number: int = 2000) -> dict:
    """In this process: seconds of the caller's stages of one call, its own functions
    timed in a loop (no socket)."""
    from dasktensor.remote._replicas import done, replica_set
    from dasktensor_worker import wire

    spec = model._spec
    request = (spec.key, "logp_grad", (x,))
    reply_frames = [bytearray(f) for f in wire.dumps(("OK", (-0.5, -x)))]

    def pick_and_done():
        replicas = replica_set(spec)
        done(replicas.pick())

    return {
        "caller: pickle the request": _timed(lambda: wire.dumps(request), number),
        "caller: pick a replica, count it done": _timed(pick_and_done, number),
        "caller: unpickle the reply": _timed(
            lambda: wire.loads([bytearray(f) for f in reply_frames]), number
        ),
    }


def main(calls: int = 3000) -> list[Row]:
    quiet()
    import numpy as np
    import pytensor
    import pytensor.tensor as pt
    from _federated import federated_client
    from _ops import Normal
    from distributed import Client

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    x = np.random.default_rng(0).normal(size=DIM)
    xs = pt.dvector("x")
    with local_cluster(n_workers=1) as client:  # a worker that never imported dasktensor
        t0 = time.perf_counter()
        dt.RemoteModel(BareNormal, name="normal", scheduler=client).call("logp_grad", x)
        first_cold = time.perf_counter() - t0
        cold_pytensor = any(client.run(_imported_pytensor).values())
    from distributed.security import Security

    with (
        local_cluster(n_workers=1, preload=["dasktensor"]) as client,
        local_cluster(n_workers=1, protocol="tls://", security=Security.temporary()) as tls,
        federated_client(DIM) as (fed, fed_first, ver),
    ):
        tls_model = dt.RemoteModel(Normal, name="normal", scheduler=tls)
        np.testing.assert_allclose(tls_model.call("logp_grad", x)[1], -x)
        address = client.scheduler.address

        # dasktensor's first call: a new model on a connected client (nothing opened yet)
        t0 = time.perf_counter()
        model = dt.RemoteModel(Normal, name="normal", scheduler=client)
        lp, grad = model.call("logp_grad", x)
        first = time.perf_counter() - t0
        np.testing.assert_allclose(grad, -x)
        # ...and with the connection to the scheduler included
        t0 = time.perf_counter()
        with Client(address, set_as_default=False) as fresh:
            other = dt.RemoteModel(Normal, name="normal", scheduler=fresh)
            other.call("logp_grad", x)
            first_connect = time.perf_counter() - t0
            other.close()

        ours_op = model.logp_grad_op("logp_grad", [pt.dvector])
        logp = ours_op(xs)[0]
        f_ours = pytensor.function([xs], [logp, pytensor.grad(logp, xs)])

        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import pytensor_federated as pf

        fed_op = pf.LogpGradOp(fed)
        logp_f = fed_op(xs)[0]
        f_fed = pytensor.function([xs], [logp_f, pytensor.grad(logp_f, xs)])
        for g, w in zip(f_ours(x), f_fed(x)):
            np.testing.assert_allclose(g, w)

        import pymc as pm

        with pm.Model() as pm_model:
            point = pm.Flat("x", shape=DIM)
            pm.Potential("normal", ours_op(point)[0])
        f_pymc = pm_model.logp_dlogp_function(ravel_inputs=True)
        f_pymc.set_extra_values({})
        np.testing.assert_allclose(f_pymc(x)[1], -x)

        from dasktensor_worker import wire

        request = wire.dumps((model._spec.key, "logp_grad", (x,)))
        payload = b"".join(bytes(f) for f in request)
        stages = caller_stages(model, x)
        stages.update(
            next(
                iter(
                    client.run(
                        _worker_stages, model._spec.key, [bytes(f) for f in request]
                    ).values()
                )
            )
        )
        with echo_servers() as (tcp_echo, zmq_echo), polling_echo() as poll_echo:
            variants = {
                "raw echo (TCP, NumPy)": lambda: tcp_echo(payload),
                "raw echo, both ends polling": lambda: poll_echo(payload),
                "dasktensor model.call": lambda: model.call("logp_grad", x),
                "dasktensor model.call, TLS cluster": lambda: tls_model.call("logp_grad", x),
                "pytensor-federated client(x)": lambda: fed(x),
                "dasktensor compiled": lambda: f_ours(x),
                "pytensor-federated compiled": lambda: f_fed(x),
                "dasktensor PyMC logp_dlogp": lambda: f_pymc(x),
            }
            if zmq_echo is not None:
                variants["pyzmq REQ/REP echo"] = lambda: zmq_echo(payload)
            samples = per_call(variants, calls)
        model.close()
        tls_model.close()

    med = {k: float(np.median(v)) for k, v in samples.items()}
    p99 = {k: float(np.percentile(v, 99)) for k, v in samples.items()}
    echo, fed_call = "raw echo (TCP, NumPy)", "pytensor-federated client(x)"
    polled = "raw echo, both ends polling"
    ours = "dasktensor model.call"
    python = sum(stages.values())
    breakdown = [(k, fmt_time(v), f"{v / med[ours]:.0%}") for k, v in stages.items()]
    breakdown += [
        ("(the stages above, in all)", fmt_time(python), f"{python / med[ours]:.0%}"),
        (
            "the rest: sockets, wake-ups, framing (call - stages)",
            fmt_time(med[ours] - python),
            f"{(med[ours] - python) / med[ours]:.0%}",
        ),
        ("raw echo, both ends polling (its floor)", fmt_time(med[polled]), ""),
    ]
    print_table(
        ["stage of one call", "seconds", "share of the call"],
        breakdown,
        title=f"[{NAME}] where a call's time goes (each stage's own functions timed in a "
        "loop; the call's median from the blocks below)",
    )
    print_table(
        ["variant", "median", "p99", "median / echo", "median / federated"],
        [
            (
                k,
                fmt_time(med[k]),
                fmt_time(p99[k]),
                f"{med[k] / med[echo]:.2f}",
                f"{med[k] / med[fed_call]:.3f}",
            )
            for k in samples
        ],
        title=f"[{NAME}] {calls} calls of each, in alternating blocks of 250 back to back "
        f"(pytensor-federated {ver}, {len(payload)}-byte request)",
    )
    rows = [
        Row(NAME, "call / raw echo (median)", med[ours] / med[echo], 3.0),
        Row(NAME, "call / raw echo (p99)", p99[ours] / p99[echo], 3.0),
        Row(NAME, "call / polling echo (median)", med[ours] / med[polled]),
        Row(NAME, "call / polling echo (p99)", p99[ours] / p99[polled]),
        Row(NAME, "call / federated (median)", med[ours] / med[fed_call], 0.15),
        Row(NAME, "call / federated (p99)", p99[ours] / p99[fed_call], 0.15),
        Row(
            NAME,
            "compiled: dasktensor / federated (median)",
            med["dasktensor compiled"] / med["pytensor-federated compiled"],
            0.15,
        ),
        Row(
            NAME,
            "PyMC logp_dlogp / raw echo (median)",
            med["dasktensor PyMC logp_dlogp"] / med[echo],
        ),
        Row(NAME, "TLS call / plain call (median)", med[f"{ours}, TLS cluster"] / med[ours]),
        Row(NAME, "dasktensor call", med[ours], unit="s"),
        Row(NAME, "dasktensor call, TLS cluster", med[f"{ours}, TLS cluster"], unit="s"),
        Row(NAME, "dasktensor call p99", p99[ours], unit="s"),
        Row(NAME, "dasktensor PyMC logp_dlogp", med["dasktensor PyMC logp_dlogp"], unit="s"),
        Row(NAME, "raw echo", med[echo], unit="s"),
        Row(NAME, "raw echo, both ends polling", med[polled], unit="s"),
        Row(NAME, "federated call", med[fed_call], unit="s"),
        Row(NAME, "dasktensor first call", first, 0.3, unit="s"),
        Row(NAME, "dasktensor connect + first call", first_connect, 0.3, unit="s"),
        Row(NAME, "dasktensor first call, cold worker", first_cold, unit="s"),
        Row(NAME, "cold worker imported PyTensor (1: yes)", int(cold_pytensor), 0),
        Row(NAME, "federated connect + first call", fed_first, unit="s"),
        load_row(NAME),
    ]
    # where a call's time goes (the table printed first), each stage its own row
    rows += [Row(NAME, f"stage: {k}", v, unit="s") for k, v in stages.items()]
    rows.append(
        Row(NAME, "stage: the rest (sockets, wake-ups, framing)", med[ours] - python, unit="s")
    )
    if zmq_echo is not None:
        rows.insert(
            6, Row(NAME, "pyzmq echo / raw echo (median)", med["pyzmq REQ/REP echo"] / med[echo])
        )
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
