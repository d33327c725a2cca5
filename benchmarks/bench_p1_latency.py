"""P1: one remote logp+gradient round trip, dasktensor against pytensor-federated.

A 10-dimensional standard normal, ``logp, grad = -0.5 * x @ x, -x``, served two ways on
this machine, both on loopback and measured in the same run, in interleaved rounds:

* **pytensor-federated** (the baseline): its gRPC server in a subprocess, called through
  its ``LogpGradServiceClient`` on the streamed path (what its ``LogpGradOp`` does);
* **dasktensor**: a ``RemoteModel`` built on the one worker process of a ``LocalCluster``
  and called straight on that worker (``model.call``).

Each is timed as a raw call and inside a compiled PyTensor function of the log-density
and its gradient (the way a sampler calls it).  Target: dasktensor's latency <= 0.8x
pytensor-federated's.  Also timed: dasktensor's first call (from a new ``RemoteModel`` to
its first result: building the replica, opening the connection; target <= 0.3 s), and the
same with the client's connection to the scheduler included.  The cluster's worker starts
the way ``dt.connect()`` starts them (importing dasktensor as it starts).  Also timed: the
first call on a bare worker that has never imported dasktensor, with a model that needs
NumPy only (:class:`BareNormal`); the worker imports ``dasktensor_worker`` for it, not
dasktensor nor PyTensor (~1 s on the 2.38 line), which the summary checks.

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
    compare,
    fmt_time,
    load_row,
    local_cluster,
    print_rows,
    print_table,
    quiet,
    versions_line,
)

NAME = "p1-latency"
DIM = 10


class BareNormal:
    """``_ops.Normal`` without its module: ``_ops`` imports PyTensor, this module does not,
    so a bare worker unpickling this model imports no PyTensor either."""

    def logp_grad(self, x):
        return -0.5 * float(x @ x), -x


def _imported_pytensor() -> bool:
    return "pytensor" in sys.modules


def main(repeat: int = 15, number: int = 200) -> list[Row]:
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
    with (
        local_cluster(n_workers=1, preload=["dasktensor"]) as client,
        federated_client(DIM) as (fed, fed_first, ver),
    ):
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

        times = compare(
            {
                "pytensor-federated client(x)": lambda: fed(x),
                "dasktensor model.call": lambda: model.call("logp_grad", x),
                "pytensor-federated compiled": lambda: f_fed(x),
                "dasktensor compiled": lambda: f_ours(x),
            },
            repeat=repeat,
            number=number,
        )
        model.close()

    base, base_f = times["pytensor-federated client(x)"], times["pytensor-federated compiled"]
    print_table(
        ["variant", "median per call", "/ pytensor-federated"],
        [
            (k, fmt_time(v), f"{v / (base_f if 'compiled' in k else base):.3f}")
            for k, v in times.items()
        ],
        title=f"[{NAME}] {repeat} interleaved rounds of {number} calls (pytensor-federated {ver})",
    )
    rows = [
        Row(NAME, "raw call: dasktensor / federated", times["dasktensor model.call"] / base, 0.8),
        Row(NAME, "compiled: dasktensor / federated", times["dasktensor compiled"] / base_f, 0.8),
        Row(NAME, "dasktensor call", times["dasktensor model.call"], unit="s"),
        Row(NAME, "federated call", base, unit="s"),
        Row(NAME, "dasktensor first call", first, 0.3, unit="s"),
        Row(NAME, "dasktensor connect + first call", first_connect, 0.3, unit="s"),
        Row(NAME, "dasktensor first call, cold worker", first_cold, unit="s"),
        Row(NAME, "cold worker imported PyTensor (1: yes)", int(cold_pytensor), 0),
        Row(NAME, "federated connect + first call", fed_first, unit="s"),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    main()
