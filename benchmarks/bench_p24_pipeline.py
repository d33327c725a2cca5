"""P24-P26: pipelined pmaps -- chunks streaming through placed stages.

P24: 16 chunks of one element through two placed 50 ms stages, a ``HOST`` block then a
``GPU`` block, on a cluster of two worker processes (one offers ``{"HOST": 1}``, the other
``{"GPU": 1}``; a "GPU" is a resource name here, the stages sleep).  Timed in interleaved
rounds (``compare``), a new pmap call each sample:

* ``pipelined``: ``dt.pmap`` with the default ``dasktensor.pmap.inflight`` (4);
* ``one after another``: the same with ``inflight=1`` (each chunk's first stage waits
  for the previous chunk's second): placed but not pipelined;
* ``raw Dask``: the ceiling of this cluster for this work, measured in the same run: two
  ``client.submit`` calls per chunk (the second on the first's future), each sleeping
  50 ms, with the same resources -- Dask streaming the chain without dasktensor.

Target: pipelined wall / (17 x 50 ms) <= 1.25 (one after another: ~1.9 by construction).

P25: ``dt.sample_posterior_predictive`` of a PyMC model whose mean is a small neural
surrogate (three 64-wide tanh layers over 400 observations) in a
``dt.annotate(resources={"GPU": 1}, name="surrogate")`` block, on a cluster of a worker
without resources and one offering ``{"GPU": 1}``; 2 chains x 200 draws in chunks of 20
draws.  Reported: pipelined, one after another (``inflight=1``), and the same model
without the block (one task per chunk, on either worker: the placement is not honoured,
and both workers compute).

P26: peak memory of the CPU workers, 200 chunks through a 10 ms ``HOST`` stage that
makes 2 MB per chunk and a 50 ms ``GPU`` stage (5x slower) that reduces it, on two HOST
workers and one GPU worker: with ``inflight=4`` and with ``inflight=100000`` (no bound).
Sampled every 20 ms on the scheduler: the bytes each worker holds (Dask's managed
memory).  Target: bounded by inflight (about inflight x 2 MB per stage), not by the
number of chunks.

Run: ``python benchmarks/bench_p24_pipeline.py``
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    HERE,
    SINGLE_THREAD_ENV,
    Row,
    compare,
    fmt_time,
    load_row,
    print_rows,
    print_table,
    quiet,
    versions_line,
)

NAME = "p24-pipeline"
STAGE = 0.05
CHUNKS = 16


@contextlib.contextmanager
def cluster_of(workers: dict[str, dict]):
    """A SpecCluster of one-thread worker processes with these resources; yields a Client
    set as the default (what ``dt.pmap(..., compute=True)`` uses)."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    env = dict(SINGLE_THREAD_ENV)
    env["PYTHONWARNINGS"] = "ignore:Numba will use object mode"  # StageWork, on PyTensor 3
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p)
    spec = {
        name: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "host": "127.0.0.1",
                "resources": resources,
                "env": env,
                "silence_logs": logging.ERROR,
            },
        }
        for name, resources in workers.items()
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    with (
        SpecCluster(scheduler=scheduler, workers=spec, silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(len(workers), timeout=120)
        yield client


def two_stages(host: dict, gpu: dict, name: str, expand: int | None = None):
    """A pmap of a HOST block and a GPU block of StageWork, chunks of one element."""
    import pytensor.tensor as pt  # noqa: F401 - the blocks build PyTensor graphs
    from _ops import StageWork

    import dasktensor as dt

    def fn(v):
        with dt.annotate(resources={"HOST": 1}, name="host"):
            a = StageWork(**host, expand=expand)(v)
        with dt.annotate(resources={"GPU": 1}, name="gpu"):
            b = StageWork(**gpu, reduce=expand is not None)(a)
        return b

    return dt.pmap(fn, chunks=1, name=name)


def _sleep_then(x, seconds):
    time.sleep(seconds)
    return x + 1


def p24(rows: list[Row]) -> None:
    import dask
    import numpy as np

    with cluster_of({"host": {"HOST": 1}, "gpu": {"GPU": 1}}) as client:
        g = two_stages({"seconds": STAGE}, {"seconds": STAGE}, "p24")
        x = np.ones((CHUNKS, 4))

        def run(inflight):
            def call():
                with dask.config.set({"dasktensor.pmap.inflight": inflight}):
                    g(x, compute=True, progressbar=False)

            return call

        def raw():
            firsts = [
                client.submit(_sleep_then, x[i], STAGE, resources={"HOST": 1}, pure=False)
                for i in range(CHUNKS)
            ]
            seconds = [
                client.submit(_sleep_then, f, STAGE, resources={"GPU": 1}, pure=False)
                for f in firsts
            ]
            client.gather(seconds)

        got = np.asarray(g(x, compute=True, progressbar=False))
        np.testing.assert_allclose(got, x + 2)
        times = compare(
            {"pipelined": run(4), "one after another": run(1), "raw Dask": raw},
            repeat=9,
            warmup=2,
        )
    ideal = (CHUNKS + 1) * STAGE
    print_table(
        ["variant", "median wall", f"/ ({CHUNKS + 1} x 50 ms)", "/ raw Dask"],
        [
            (k, fmt_time(v), f"{v / ideal:.2f}", f"{v / times['raw Dask']:.2f}")
            for k, v in times.items()
        ],
        title=f"P24: {CHUNKS} chunks through two placed 50 ms stages (HOST worker, GPU worker)",
    )
    rows += [
        Row("P24", f"pipelined wall / ({CHUNKS + 1} x 50 ms)", times["pipelined"] / ideal, 1.25),
        Row("P24", "one after another / (17 x 50 ms)", times["one after another"] / ideal),
        Row("P24", "raw Dask chain / (17 x 50 ms)", times["raw Dask"] / ideal),
        Row("P24", "pipelined / raw Dask", times["pipelined"] / times["raw Dask"]),
    ]


def surrogate_model(annotated: bool):
    import numpy as np
    import pymc as pm
    import pytensor.tensor as pt

    import dasktensor as dt

    rng = np.random.default_rng(24)
    xs = np.linspace(-2.0, 2.0, 400)
    w1 = rng.normal(size=64) / 4
    ws = [rng.normal(size=(64, 64)) / 8 for _ in range(3)]
    w2 = rng.normal(size=64) / 8
    observed = np.tanh(xs) + rng.normal(scale=0.1, size=xs.size)
    with pm.Model() as model:
        a = pm.Normal("a", 1.0, 0.5)
        b = pm.Normal("b", 0.0, 0.5)
        sigma = pm.HalfNormal("sigma", 0.5)
        block = (
            dt.annotate(resources={"GPU": 1}, name="surrogate")
            if annotated
            else contextlib.nullcontext()
        )
        with block:
            h = pt.tanh(pt.outer(a * xs + b, pt.as_tensor(w1)))
            for w in ws:
                h = pt.tanh(h @ w)
            mu = h @ w2
        pm.Normal("y", mu, sigma, observed=observed)
    return model


def p25(rows: list[Row]) -> None:
    import dask
    import numpy as np
    import pymc as pm

    import dasktensor as dt

    plain = surrogate_model(False)
    placed = surrogate_model(True)
    with plain, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = pm.sample(
            draws=200, tune=200, chains=2, random_seed=25, progressbar=False,
            compute_convergence_checks=False,
        )  # fmt: skip
    with cluster_of({"cpu": {}, "gpu": {"GPU": 1}}):

        def run(model, inflight):
            def call():
                with dask.config.set({"dasktensor.pmap.inflight": inflight}):
                    result = dt.sample_posterior_predictive(
                        idata, model=model, random_seed=3, chunks=20, compute=True,
                        progressbar=False,
                    )  # fmt: skip
                return result

            return call

        got = run(placed, 4)()
        want = run(plain, 4)()
        y_got = np.asarray(got["posterior_predictive"]["y"])
        y_want = np.asarray(want["posterior_predictive"]["y"])
        same = float(np.max(np.abs(y_got - y_want)))
        times = compare(
            {
                "pipelined": run(placed, 4),
                "one after another": run(placed, 1),
                "without the block": run(plain, 4),
            },
            repeat=5,
            warmup=1,
        )
    print_table(
        ["variant", "median wall", "/ pipelined"],
        [(k, fmt_time(v), f"{v / times['pipelined']:.2f}") for k, v in times.items()],
        title="P25: posterior predictive, 'surrogate' block on the GPU worker, 20 chunks",
    )
    print(f"P25: largest difference of the draws, placed vs without the block: {same:.2e}")
    rows += [
        Row(
            "P25", "one after another / pipelined", times["one after another"] / times["pipelined"]
        ),
        Row(
            "P25", "without the block / pipelined", times["without the block"] / times["pipelined"]
        ),
        Row("P25", "draws placed vs without the block: max |diff|", same),
    ]


def _held(dask_scheduler) -> dict[str, int]:
    return {ws.name: ws.nbytes for ws in dask_scheduler.workers.values()}


def p26(rows: list[Row]) -> None:
    import dask
    import numpy as np

    n, expand = 200, 250_000  # 2 MB per chunk between the stages
    g = two_stages({"seconds": 0.01}, {"seconds": 0.05}, "p26", expand=expand)
    x = np.ones((n, 4))
    peaks = {}
    with cluster_of({"host-a": {"HOST": 1}, "host-b": {"HOST": 1}, "gpu": {"GPU": 1}}) as client:
        for inflight in (4, 100_000):
            g(x[:8], compute=True, progressbar=False)  # compiled on the workers first
            samples, done = [], threading.Event()

            def sample(samples=samples, done=done):
                while not done.is_set():
                    samples.append(client.run_on_scheduler(_held))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            t0 = time.perf_counter()
            try:
                with dask.config.set({"dasktensor.pmap.inflight": inflight}):
                    out = g(x, compute=True, progressbar=False)
            finally:
                done.set()
                sampler.join()
            wall = time.perf_counter() - t0
            np.testing.assert_allclose(out, 2.0)  # 1 + 1, spread then averaged
            cpu = max(sum(v for k, v in s.items() if k.startswith("host")) for s in samples)
            gpu = max(s.get("gpu", 0) for s in samples)
            peaks[inflight] = (cpu, gpu, wall)
    mb = 1 << 20
    print_table(
        ["inflight", "peak held by the CPU workers", "by the GPU worker", "wall"],
        [
            (k, f"{c / mb:.0f} MiB", f"{gp / mb:.0f} MiB", fmt_time(w))
            for k, (c, gp, w) in peaks.items()
        ],
        title=f"P26: {n} chunks, 2 MiB each between a 10 ms HOST stage and a 50 ms GPU stage",
    )  # fmt: skip
    rows += [
        Row("P26", "peak CPU-worker memory, inflight=4 (MiB)", peaks[4][0] / mb, 4 * 2 * 2),
        Row("P26", "peak CPU-worker memory, no bound (MiB)", peaks[100_000][0] / mb),
        Row("P26", "peak GPU-worker memory, inflight=4 (MiB)", peaks[4][1] / mb),
        Row("P26", "peak GPU-worker memory, no bound (MiB)", peaks[100_000][1] / mb),
    ]


def main() -> list[Row]:
    quiet()
    # StageWork runs its perform in Numba's object mode on PyTensor 3: said once per stage
    warnings.filterwarnings("ignore", message="Numba will use object mode")
    print(versions_line())
    rows: list[Row] = [load_row(NAME)]
    p24(rows)
    p25(rows)
    p26(rows)
    rows.append(load_row(NAME))
    print_rows(rows, title="P24-P26")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
