"""P8: ``dt.pmap`` of a CPU-bound graph on 2 worker processes vs one thread in one process.

The element graph: from a vector ``v`` (100,) and a shared matrix ``w`` (100, 100), a
100 x 100 matrix ``m = tanh(outer(v, v) / 100 + w)`` goes through ``STEPS`` rounds of
``m = tanh(m @ w)``; the element's result is ``m.sum(axis=0)``.  ``dt.pmap(fn, in_axes=(0,
None), chunks=...)`` maps it over ``N`` vectors: the inputs and outputs are small (800 bytes
per element each way) and the work is matrix products and tanh, so the run is CPU-bound.
``w`` is unbatched: one Dask key, sent to each worker once.

Timed warm (graph compiled on the workers and here first), in interleaved rounds
(``compare``), a new pmap call (new keys) each sample:

* the pmap computed on a ``LocalCluster`` of 2 worker processes, 1 thread each,
  single-threaded BLAS (``dask.compute(..., scheduler=client)``);
* the same pmap computed in this process with ``scheduler="sync"`` (one thread, BLAS
  limited to one thread): the baseline;
* as information, the threaded scheduler in this process (2 threads);
* as information, the ceiling of two processes for this work: the same chunks, split in
  two halves, each half run by one worker in one task (``scheduler="sync"`` there): no
  scheduling between chunks, the same processes and BLAS settings.  ``cluster /
  ceiling`` is what dasktensor's chunking and Dask's scheduling cost on top of what two
  cores give this workload (cache and memory bandwidth shared by the cores included);
* as information, what two processes give this very work: one worker runs all the chunks
  in one task alone, then both workers do so at the same time; ``2 x alone / at once`` is
  2.0 if running side by side slows neither (the pure-Python gauge below measures the
  same for a loop that touches no memory).

Target: sync / cluster >= 1.8.  ``N`` / chunks give ``CHUNKS`` = 32 equal chunks (16 per
worker, ~0.15 s each: if one worker runs slower, as on a shared machine, the other takes
more chunks, and the last chunk leaves little idle time).  Also printed: the chunks
``chunks="auto"`` would choose here (auto-chunking sizes chunks by bytes of data, not by
compute), and, to read the speed-up against, how many cores two worker processes get at
the moment (a pure-Python loop on one worker, then on both at once, before and after the
timing: 2.0 when both cores are free).

Run: ``python benchmarks/bench_p8_pmap.py [--n N] [--steps N] [--chunks N]``
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    compare,
    fmt_time,
    limit_blas,
    load_row,
    local_cluster,
    print_rows,
    print_table,
    quiet,
    versions_line,
)

NAME = "p8-pmap"
WORKERS = 2
SIZE = 100
N = 1600
STEPS = 20
CHUNKS = 32


def element(steps: int):
    """The graph of one element: ``fn(v, w)`` for ``dt.pmap``."""

    def fn(v, w):
        import pytensor.tensor as pt

        m = pt.tanh(pt.outer(v, v) / SIZE + w)
        for _ in range(steps):
            m = pt.tanh(m @ w)
        return m.sum(axis=0)

    return fn


_on_worker: dict = {}


def run_serially(v, w, steps: int, per_chunk: int):
    """Run on a worker: ``v``'s chunks one after another in this process, as one task
    (the pmap is built once per worker process, so its graph is compiled once)."""
    import dasktensor as dt

    key = (steps, per_chunk)
    if key not in _on_worker:
        _on_worker[key] = dt.pmap(element(steps), in_axes=(0, None), chunks=per_chunk)
    return _on_worker[key](v, w).compute(scheduler="sync")


def spin(n: int = 3_000_000) -> float:
    """A pure-Python loop; its duration in seconds (to gauge free cores)."""
    import time

    t0 = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - t0


def capacity(client, rounds: int = 3) -> float:
    """How many cores two worker processes get right now: 2 x (time of the loop on one
    worker) / (its time when both workers run it at once); 2.0 on two free cores."""
    import statistics

    one, two = [], []
    workers = list(client.scheduler_info()["workers"])
    for _ in range(rounds):
        one.append(statistics.median(client.run(spin, workers=workers[:1]).values()))
        two.append(statistics.median(client.run(spin).values()))
    return 2 * statistics.median(one) / statistics.median(two)


def main(
    n: int = N, steps: int = STEPS, chunks: int = CHUNKS, repeat: int = 7, warmup: int = 1
) -> list[Row]:
    quiet()
    import dask
    import numpy as np

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rng = np.random.default_rng(0)
    v = rng.normal(size=(n, SIZE))
    w = rng.normal(size=(SIZE, SIZE)) / np.sqrt(SIZE)
    per_chunk = -(-n // chunks)
    g = dt.pmap(element(steps), in_axes=(0, None), chunks=per_chunk, name="p8")
    auto = dt.pmap(element(steps), in_axes=(0, None))(v, w)
    print(
        f"[{NAME}] {n} elements x {steps} steps of {SIZE}x{SIZE} tanh(m @ w), chunks "
        f"{g(v, w).chunks[0]}; chunks='auto' would give {auto.chunks[0]}"
    )

    with local_cluster(n_workers=WORKERS, threads_per_worker=1) as client, limit_blas(1):

        def cluster():
            return dask.compute(g(v, w), scheduler=client)[0]

        def sync():
            return g(v, w).compute(scheduler="sync")

        def threads():
            return g(v, w).compute(scheduler="threads", num_workers=WORKERS)

        # imported, so that the task pickles it by reference (the module's cache then
        # lives on in each worker)
        from bench_p8_pmap import run_serially

        workers = list(client.scheduler_info()["workers"])
        halves = np.array_split(v, WORKERS)  # chunk boundaries: half the chunks each

        def halves_on_workers():
            futures = [
                client.submit(run_serially, h, w, steps, per_chunk, workers=[a], pure=False)
                for h, a in zip(halves, workers)
            ]
            return np.concatenate(client.gather(futures))

        def all_on_one_worker():
            return client.submit(
                run_serially, v, w, steps, per_chunk, workers=workers[:1], pure=False
            ).result()

        def all_on_each_worker_at_once():
            futures = [
                client.submit(run_serially, v, w, steps, per_chunk, workers=[a], pure=False)
                for a in workers
            ]
            return client.gather(futures)[0]

        cap_before = capacity(client)
        want = sync()
        np.testing.assert_allclose(cluster(), want, rtol=1e-10)  # compiles on the workers
        np.testing.assert_allclose(threads(), want, rtol=1e-10)
        np.testing.assert_allclose(halves_on_workers(), want, rtol=1e-10)
        np.testing.assert_allclose(all_on_one_worker(), want, rtol=1e-10)
        np.testing.assert_allclose(all_on_each_worker_at_once(), want, rtol=1e-10)
        times = compare(
            {
                f"cluster: {WORKERS} worker processes x 1 thread": cluster,
                "sync: 1 thread in this process": sync,
                f"threads: {WORKERS} threads in this process": threads,
                "ceiling: each worker runs half the chunks in one task": halves_on_workers,
                "one worker runs all the chunks in one task": all_on_one_worker,
                "both workers run all the chunks at once": all_on_each_worker_at_once,
            },
            repeat=repeat,
            warmup=warmup,
        )
        cap = (cap_before + capacity(client)) / 2
    t_cluster, t_sync, t_threads, t_ceiling, t_one, t_both = times.values()
    print_table(
        ["variant", "median", "speed-up (sync / variant)"],
        [(k, fmt_time(t), f"{t_sync / t:.3f}") for k, t in times.items()],
        title=f"[{NAME}] median of {repeat} interleaved rounds",
    )
    rows = [
        Row(NAME, f"speed-up {WORKERS} workers vs sync", t_sync / t_cluster, 1.8, True),
        Row(NAME, f"speed-up {WORKERS} threads vs sync", t_sync / t_threads),
        Row(NAME, "speed-up of the ceiling vs sync", t_sync / t_ceiling),
        Row(NAME, "cluster / ceiling", t_cluster / t_ceiling),
        Row(NAME, "one worker alone / sync (a worker's speed)", t_one / t_sync),
        Row(NAME, "cores two processes give this work (2 x alone / at once)", 2 * t_one / t_both),
        Row(NAME, "sync (1 thread)", t_sync, unit="s"),
        Row(NAME, f"cluster ({WORKERS} workers)", t_cluster, unit="s"),
        Row(NAME, "cores 2 processes get now (pure-Python loop)", round(cap, 2)),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=N, help="elements")
    parser.add_argument("--steps", type=int, default=STEPS, help="matrix products per element")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="number of chunks")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(n=args.n, steps=args.steps, chunks=args.chunks, repeat=args.repeat)
    if not args.no_save:
        save_results(NAME, rows)
