"""(b) Independent costly branches run in parallel on a 2-process cluster.

Four independent branches, each a chain of ``LINKS`` links ``h = tanh(W_i @ h)`` on
500x500 matrices, start from one input ``x`` and end in ``mean(h)``; the output is the
sum of the four means.  Each branch has its own weight matrix ``W_i``, a shared variable
with a static shape (so the planner's cost rule sees ``2 * 500**3 = 2.5e8`` flops per
product, above ``heavy-flops``).  The planner should fuse each branch into one cluster
task, plus one cheap stage on the caller that adds the four means.

Compared, side by side in the same run, with BLAS limited to one thread in the client and
in the workers:

* the default mode (one process, BLAS 1 thread);
* ``dt.function(scheduler=client)`` on a ``LocalCluster`` with 2 worker processes x 1
  thread (target speed-up default/DASK >= 1.7), on both execution paths: the branches
  called as resident stages through the remote-call channel
  (``dasktensor.execute.path: channel``) and submitted as Dask tasks (``tasks``);
* for information, ``dt.function(scheduler="threads")`` (Dask's threaded scheduler in
  this process, 2 threads; on PyTensor 3 the Numba stages hold the GIL);
* the floor of what this machine and Dask allow right now: the same four branches as
  plain NumPy functions, run one after another in this process vs submitted to the same
  cluster (one ``client.submit`` per branch with ``x`` and ``W_i`` shipped each call, as
  dasktensor ships them, + ``gather``).  dasktensor's share is the gap between the two
  speed-ups.

Run: ``python benchmarks/bench_b_branches.py``
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    blas_threads,
    compare,
    limit_blas,
    load_row,
    local_cluster,
    print_ratio_table,
    print_rows,
    quiet,
    versions_line,
    worker_blas_threads,
)

NAME = "b-branches"
N = 500
BRANCHES = 4
LINKS = 6


def build_graph(seed: int = 0):
    """Input ``x``, output ``sum_i mean(branch_i(x))``, and a test value of ``x``."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(seed)
    x = pt.matrix("x", shape=(N, N))
    means = []
    for i in range(BRANCHES):
        w = pytensor.shared(rng.normal(scale=N**-0.5, size=(N, N)), name=f"W{i}", shape=(N, N))
        h = x
        for _ in range(LINKS):
            h = pt.tanh(w @ h)
        means.append(h.mean())
    y = pt.add(*means)
    return x, y, rng.normal(size=(N, N))


def numpy_branch(w, x, links: int = LINKS) -> float:
    """One branch in plain NumPy (the raw-Dask floor's task)."""
    import numpy as np

    h = x
    for _ in range(links):
        h = np.tanh(w @ h)
    return float(h.mean())


def main(repeat: int = 11, warmup: int = 4) -> list[Row]:
    quiet()
    import dask
    import numpy as np
    import pytensor
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import graph_inputs

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")

    x, y, xv = build_graph()
    wv = [v.get_value() for v in graph_inputs([y]) if isinstance(v, SharedVariable)]
    assert len(wv) == BRANCHES
    rows: list[Row] = []
    with limit_blas(1):
        print(f"client BLAS threads: {blas_threads()}")
        f_default = pytensor.function([x], y)
        f_threads = dt.function([x], y, scheduler="threads")
        with local_cluster(n_workers=2, threads_per_worker=1) as client:
            print(f"worker BLAS threads: {worker_blas_threads(client)}")
            f_dask = dt.function([x], y, scheduler=client)
            plan = f_dask.plan
            print(plan)
            expected = f_default(xv)
            np.testing.assert_allclose(f_dask(xv), expected, rtol=1e-10)
            np.testing.assert_allclose(f_threads(xv), expected, rtol=1e-10)

            def raw_serial():
                return sum(numpy_branch(w, xv) for w in wv)

            def raw_dask():
                futures = [client.submit(numpy_branch, w, xv, pure=False) for w in wv]
                return sum(client.gather(futures))

            np.testing.assert_allclose(raw_dask(), expected, rtol=1e-8)

            def channel():
                with dask.config.set({"dasktensor.execute.path": "channel"}):
                    return f_dask(xv)

            def tasks():
                with dask.config.set({"dasktensor.execute.path": "tasks"}):
                    return f_dask(xv)

            np.testing.assert_allclose(channel(), expected, rtol=1e-10)
            times = compare(
                {
                    "default (1 process)": lambda: f_default(xv),
                    "DASK channel (2 procs x 1 thread)": channel,
                    "DASK tasks (2 procs x 1 thread)": tasks,
                    "DASK (threads, local)": lambda: f_threads(xv),
                    "raw NumPy, serial": raw_serial,
                    "raw NumPy, 4 x submit+gather": raw_dask,
                },
                repeat=repeat,
                warmup=warmup,
            )
    print_ratio_table(
        {k: v for k, v in times.items() if not k.startswith("raw")},
        "default (1 process)",
        title=f"median per call, {repeat} interleaved samples",
        ratio_name="time ratio",
    )
    print_ratio_table(
        {k: v for k, v in times.items() if k.startswith("raw")},
        "raw NumPy, serial",
        ratio_name="time ratio",
    )
    t0 = times["default (1 process)"]
    floor = times["raw NumPy, serial"] / times["raw NumPy, 4 x submit+gather"]
    n_cluster = sum(t.where == "cluster" for t in plan.tasks)
    rows += [
        Row(NAME, "plan tasks", len(plan.tasks)),
        Row(NAME, "plan cluster tasks", n_cluster, BRANCHES),
        Row(NAME, "default per call", t0, unit="s"),
        Row(NAME, "DASK channel per call", times["DASK channel (2 procs x 1 thread)"], unit="s"),
        Row(
            NAME,
            "speed-up default/DASK channel (2 procs)",
            t0 / times["DASK channel (2 procs x 1 thread)"],
            1.7,
            higher_is_better=True,
        ),
        Row(
            NAME,
            "speed-up default/DASK tasks (2 procs)",
            t0 / times["DASK tasks (2 procs x 1 thread)"],
            1.7,
            higher_is_better=True,
        ),
        Row(NAME, "speed-up default/DASK (threads)", t0 / times["DASK (threads, local)"]),
        Row(NAME, "raw floor speed-up numpy/submit", floor),
        Row(
            NAME,
            "DASK tasks speed-up / raw floor speed-up",
            t0 / times["DASK tasks (2 procs x 1 thread)"] / floor,
        ),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
