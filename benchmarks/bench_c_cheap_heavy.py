"""(c) A thousand cheap nodes around four heavy ones: few tasks, wall time ~ one heavy call.

The graph, on vectors of 8 elements:

* a cheap prelude: ``CHAIN`` links ``h = cumsum(tanh(h) * c_k)`` from the input ``x``
  (``CumOp`` is not an ``Elemwise``, so PyTensor's fusion cannot collapse the chain);
* four heavy ``Sleep`` nodes (``benchmarks/_ops.py``: ``dasktensor_heavy = True``, each
  sleeps 50 ms), each fed by its own short cheap chain of the prelude;
* a short cheap chain after each heavy node, and a cheap chain independent of them;
* the output adds everything up.

About 1,100 nodes survive the rewrites (printed).  Expected plan: one cheap stage before
the heavy calls, four heavy tasks, one cheap stage after them (target <= 10 tasks), and
a wall time close to one 50 ms call (target wall / 50 ms <= 1.15) with 4 workers:

(i)  Dask's threaded scheduler in this process, ``dask.config.set(num_workers=4)``;
(ii) a ``LocalCluster`` with 4 worker processes x 1 thread, on both execution paths:
     the heavy nodes called as resident stages through the remote-call channel
     (``dasktensor.execute.path: channel``) and submitted as Dask tasks (``tasks``).

For comparison the same is measured for what Dask itself costs: 4 bare 50 ms sleeps on
the threaded scheduler, and 4 ``client.submit(sleep)`` + ``gather`` on the cluster.

Compilation dominates the runtime: PyTensor's rewrites of ~1,400 nodes take ~10 s per
``dt.function`` here, and the first run on an empty PyTensor cache compiles the two big
cheap stages (on the Numba line that took 1.5-3 minutes here; later runs read the
cache and the whole benchmark takes ~1 minute).

Run: ``python benchmarks/bench_c_cheap_heavy.py``
"""

from __future__ import annotations

import os
import sys

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

NAME = "c-cheap-heavy"
SLEEP = 0.05
HEAVY = 4
WORKERS = 4
SIZE = 8
PRELUDE, PER_HEAVY_BEFORE, PER_HEAVY_AFTER, SIDE = 400, 100, 100, 200  # nodes, roughly


def _chain(h, n_nodes: int):
    """``n_nodes`` cheap nodes: ``h = cumsum(tanh(h) * 0.5)`` repeated.

    Every link uses the same constant, so that all links compile to the same C code (on
    the C backend a different constant per link means one gcc run per link: minutes).
    """
    import pytensor.tensor as pt

    for _ in range(n_nodes // 2):
        h = pt.cumsum(pt.tanh(h) * 0.5)
    return h


def build_graph():
    """Input ``x`` (8 elements) and the scalar output described in the module docstring."""
    import pytensor.tensor as pt
    from _ops import Sleep

    x = pt.vector("x", shape=(SIZE,))
    pre = _chain(x, PRELUDE)
    total = _chain(x + 1.0, SIDE).sum()  # independent of the heavy nodes (and of `pre`)
    for j in range(HEAVY):
        s = Sleep(SLEEP)(_chain(pre * (j + 1), PER_HEAVY_BEFORE))
        total = total + _chain(s, PER_HEAVY_AFTER).sum()
    return x, total


def raw_threaded_floor():
    """4 bare sleeps on Dask's threaded scheduler (the config sets num_workers)."""
    import dask.threaded
    from _ops import sleep_seconds

    dsk = {f"sleep-{i}": (sleep_seconds, SLEEP) for i in range(HEAVY)}
    return dask.threaded.get(dsk, list(dsk))


def main(repeat: int = 21, warmup: int = 3) -> list[Row]:
    quiet()
    import time

    import dask
    import numpy as np
    from _ops import sleep_seconds

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    x, y = build_graph()
    xv = np.linspace(-1.0, 1.0, SIZE)

    t0 = time.perf_counter()
    f_threads = dt.function([x], y, scheduler="threads")
    with dask.config.set(num_workers=WORKERS):
        expected = f_threads(xv)
    print(f"compile + first call (threads): {time.perf_counter() - t0:.1f} s")
    plan = f_threads.plan
    n_nodes = len(plan.fgraph.apply_nodes)
    n_cheap = sum(len(t.nodes) for t in plan.tasks if t.kind == "stage")
    print(plan)
    assert n_nodes >= 1000, f"the rewrites left only {n_nodes} nodes"

    def threads_call():
        with dask.config.set(num_workers=WORKERS):
            return f_threads(xv)

    def threads_floor():
        with dask.config.set(num_workers=WORKERS):
            return raw_threaded_floor()

    with local_cluster(n_workers=WORKERS, threads_per_worker=1) as client:
        t0 = time.perf_counter()
        f_cluster = dt.function([x], y, scheduler=client)
        np.testing.assert_allclose(f_cluster(xv), expected, rtol=1e-12)
        print(f"compile + first call (cluster): {time.perf_counter() - t0:.1f} s")
        assert len(f_cluster.plan.tasks) == len(plan.tasks)

        def cluster_call(path):
            with dask.config.set({"dasktensor.execute.path": path}):
                return f_cluster(xv)

        np.testing.assert_allclose(cluster_call("channel"), expected, rtol=1e-12)

        def cluster_floor():
            futures = [client.submit(sleep_seconds, SLEEP, pure=False) for _ in range(HEAVY)]
            return client.gather(futures)

        times = compare(
            {
                "DASK threads (num_workers=4)": threads_call,
                "raw Dask threads: 4 x sleep": threads_floor,
                "DASK LocalCluster 4x1, channel": lambda: cluster_call("channel"),
                "DASK LocalCluster 4x1, tasks": lambda: cluster_call("tasks"),
                "raw distributed: 4 x submit+gather": cluster_floor,
            },
            repeat=repeat,
            warmup=warmup,
        )

    print_table(
        ["variant", "median wall", "wall / 50 ms"],
        [(k, fmt_time(v), f"{v / SLEEP:.3f}") for k, v in times.items()],
        title=f"median per call, {repeat} interleaved samples",
    )
    rows = [
        Row(NAME, "graph nodes (after rewrites)", n_nodes),
        Row(NAME, "cheap nodes in stages", n_cheap),
        Row(NAME, "plan tasks", len(plan.tasks), 10),
        Row(
            NAME, "wall/50ms DASK threads (4)", times["DASK threads (num_workers=4)"] / SLEEP, 1.15
        ),
        Row(NAME, "wall/50ms raw threads floor", times["raw Dask threads: 4 x sleep"] / SLEEP),
        Row(
            NAME,
            "wall/50ms DASK LocalCluster 4x1, channel",
            times["DASK LocalCluster 4x1, channel"] / SLEEP,
            1.15,
        ),
        Row(
            NAME,
            "wall/50ms DASK LocalCluster 4x1, tasks",
            times["DASK LocalCluster 4x1, tasks"] / SLEEP,
            1.15,
        ),
        Row(
            NAME,
            "wall/50ms raw distributed floor",
            times["raw distributed: 4 x submit+gather"] / SLEEP,
        ),
        Row(
            NAME,
            "DASK cluster tasks - raw floor (wall)",
            times["DASK LocalCluster 4x1, tasks"] - times["raw distributed: 4 x submit+gather"],
            unit="s",
        ),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
