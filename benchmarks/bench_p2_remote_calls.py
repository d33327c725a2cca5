"""P2: four independent 50 ms remote calls in one compiled function, on four workers.

Four ``RemoteModel``s (``benchmarks/_ops.py``: ``Normal(delay=0.05)``, a standard normal's
logp and gradient after 50 ms of simulated work), each replicated on the 4 worker
processes of a ``LocalCluster``; one PyTensor function sums the four log-densities and
returns the gradient.  Timed, in interleaved rounds:

* PyTensor's default mode (what ``pm.sample`` uses): dasktensor's rewrite merges the four
  independent calls into one node that makes them concurrently;
* the DASK mode (``dt.function``): each call is a task of its own, made from the caller;
* the same function with the calls made one after another (the rewrite excluded): the
  serial baseline;
* what Dask itself costs for the same work: 4 ``client.submit(sleep 50 ms)`` + ``gather``.

Target: wall / 50 ms <= 1.1 for the default mode (and the DASK mode).  Also the first
call: four new models made at once (``RemoteMethod.call_together``, what the merged node
does), their replicas built and connections opened; compilation excluded.

Run: ``python benchmarks/bench_p2_remote_calls.py``
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

NAME = "p2-remote-calls"
DELAY = 0.05
CALLS = 4
WORKERS = 4


def build(models):
    import pytensor
    import pytensor.tensor as pt

    x = pt.dvector("x")
    ops = [m.logp_grad_op("logp_grad", [pt.dvector]) for m in models]
    total = sum(op(x * (k + 1.0))[0] for k, op in enumerate(ops))
    return x, [total, pytensor.grad(total, x)]


def main(repeat: int = 21, warmup: int = 2) -> list[Row]:
    quiet()
    import functools

    import numpy as np
    import pytensor
    import pytensor.tensor as pt
    from _ops import Normal, sleep_seconds

    import dasktensor as dt
    from dasktensor.cli._demo import serial_mode
    from dasktensor.remote import RemoteMethod

    print(f"[{NAME}] {versions_line()}")
    xv = np.linspace(-1.0, 1.0, 10)
    with local_cluster(n_workers=WORKERS, preload=["dasktensor"]) as client:
        models = [
            dt.RemoteModel(functools.partial(Normal, DELAY), name="normal", scheduler=client)
            for _ in range(CALLS)
        ]
        x, outs = build(models)
        # the first call: the four models' replicas built, connections opened
        t0 = time.perf_counter()
        RemoteMethod.call_together(
            [(m.logp_grad_op("logp_grad", [pt.dvector]).fn, (xv,)) for m in models]
        )
        first = time.perf_counter() - t0
        f_default = pytensor.function([x], outs)
        want = f_default(xv)
        f_dask = dt.function([x], outs, scheduler=client)
        f_serial = pytensor.function([x], outs, mode=serial_mode())
        for f in (f_dask, f_serial):
            for g, w in zip(f(xv), want):
                np.testing.assert_allclose(g, w)

        def dask_floor():
            futures = [client.submit(sleep_seconds, DELAY, pure=False) for _ in range(CALLS)]
            return client.gather(futures)

        times = compare(
            {
                "default mode (merged calls)": lambda: f_default(xv),
                "DASK mode": lambda: f_dask(xv),
                "serial (calls one by one)": lambda: f_serial(xv),
                "raw Dask: 4 x submit+gather": dask_floor,
            },
            repeat=repeat,
            warmup=warmup,
        )
        for m in models:
            m.close()

    print_table(
        ["variant", "median wall", "wall / 50 ms"],
        [(k, fmt_time(v), f"{v / DELAY:.3f}") for k, v in times.items()],
        title=f"[{NAME}] median per call, {repeat} interleaved rounds",
    )
    rows = [
        Row(NAME, "wall/50ms default mode", times["default mode (merged calls)"] / DELAY, 1.1),
        Row(NAME, "wall/50ms DASK mode", times["DASK mode"] / DELAY, 1.1),
        Row(NAME, "wall/50ms serial", times["serial (calls one by one)"] / DELAY),
        Row(NAME, "wall/50ms raw Dask", times["raw Dask: 4 x submit+gather"] / DELAY),
        Row(NAME, "first call (replicas + connections)", first, unit="s"),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
