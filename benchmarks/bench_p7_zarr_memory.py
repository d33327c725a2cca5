"""P7: a posterior predictive several times bigger than the workers' memory, written to Zarr.

A ``LocalCluster`` of 2 worker processes (1 thread each) with ``memory_limit=500MiB`` each
computes ``dt.sample_posterior_predictive`` of ``y ~ Normal(a + b * x, 1)`` (4 chains x
1,000 draws x 150,000 observations, float64: 4.8 GB, ~9x one worker's limit and ~4.5x both
together), lazily, with default chunks, and writes it with
``Dataset.to_zarr(path, compute=False)`` computed on the cluster's client: every chunk is
drawn and stored by a worker, nothing is gathered.  The posterior is random draws of a and
b (only its values matter), as in ``tests/test_predictive.py``.  Only the
``posterior_predictive`` group is written: ArviZ 0.23's ``InferenceData.to_zarr`` (PyMC 5)
refuses Zarr 3, so the group's Dataset is written on both lines alike.

Reported: output size / memory limit, wall time of the write, the peak RSS of every
process (the client process sampled by a thread with psutil every 20 ms, and its
``ru_maxrss``; each worker sampled the same way by a thread started in it, beside the
maximum of ``dask_worker.monitor``'s memory history and the worker's ``ru_maxrss``), the
workers' RSS before any task and after importing PyTensor, whether a worker was restarted,
and spot checks: draws read back from the store equal the same chunks recomputed in this
process (same seed and chunks), and their residuals around a + b * x are standard normal.
The store is written in a temporary directory, deleted afterwards.

Targets: every worker's peak RSS below its memory limit, no worker restarted, spot checks
pass.

Run: ``python benchmarks/bench_p7_zarr_memory.py [--obs N] [--chunks N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
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

NAME = "p7-zarr-memory"
WORKERS = 2
MEMORY_LIMIT = "500MiB"
CHAINS = 4
DRAWS = 1000
N_OBS = 150_000
MiB = 2**20


class PeakRSS:
    """Samples the RSS of this process in a daemon thread; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self._process = psutil.Process()
        self.interval = interval
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return self.peak


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def max_rss() -> int:
    """This process's peak RSS over its life, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_after_pytensor() -> int:
    import pytensor  # noqa: F401

    return rss()


def heavy_modules() -> list[str]:
    """Which of the big libraries this process has imported."""
    names = ("pytensor", "pymc", "numba", "arviz", "xarray", "zarr", "jax")
    return [m for m in names if m in sys.modules]


def start_sampler(dask_worker=None) -> int:
    dask_worker._p7_peak = PeakRSS()
    return os.getpid()


def stop_sampler(dask_worker=None) -> dict:
    history = dask_worker.monitor.range_query(0)["memory"]
    return {
        "pid": os.getpid(),
        "sampled": dask_worker._p7_peak.stop(),
        "monitor": max(history) if history else 0,
        "ru_maxrss": max_rss(),
    }


def main(n_obs: int = N_OBS, chunks: int | str = "auto") -> list[Row]:
    quiet()
    import logging
    import tempfile
    import warnings

    import numpy as np
    import pymc as pm
    import xarray as xr
    from dask.utils import parse_bytes

    import dasktensor as dt

    warnings.filterwarnings("ignore", module="pymc")
    warnings.filterwarnings("ignore", message="Consolidated metadata")  # Zarr 3 about v2 habits
    logging.getLogger("pymc").setLevel(logging.WARNING)  # "Sampling: [y]" at every call
    print(f"[{NAME}] {versions_line()}")
    limit = parse_bytes(MEMORY_LIMIT)
    rng = np.random.default_rng(7)
    x = np.linspace(0.0, 1.0, n_obs)
    with pm.Model() as model:
        a = pm.Normal("a")
        b = pm.Normal("b")
        pm.Normal("y", a + b * x, 1.0, observed=np.zeros(n_obs))
    posterior = xr.Dataset(
        {
            "a": (("chain", "draw"), rng.normal(size=(CHAINS, DRAWS))),
            "b": (("chain", "draw"), rng.normal(size=(CHAINS, DRAWS))),
        },
        coords={"chain": np.arange(CHAINS), "draw": np.arange(DRAWS)},
    )
    if pm.__version__.startswith("5"):
        import arviz as az

        idata = az.InferenceData(posterior=posterior)
    else:
        idata = xr.DataTree.from_dict({"posterior": posterior})

    def group_of(result):
        group = result["posterior_predictive"]
        return group.to_dataset() if hasattr(result, "children") else group

    with (
        local_cluster(n_workers=WORKERS, memory_limit=MEMORY_LIMIT) as client,
        tempfile.TemporaryDirectory(prefix="dasktensor-p7-") as tmp,
    ):
        rss_start = client.run(rss)
        rss_pytensor = client.run(rss_after_pytensor)
        pids_before = client.run(os.getpid)
        result = dt.sample_posterior_predictive(idata, model=model, random_seed=3, chunks=chunks)
        ds = group_of(result)
        y = ds["y"]
        n_chunks = int(np.prod([len(c) for c in y.chunks]))
        chunk_bytes = max(y.data.blocks[0, 0].nbytes, 1)
        print(
            f"[{NAME}] output y {y.shape} {y.dtype}: {y.nbytes / MiB:.0f} MiB in {n_chunks} "
            f"chunks of <= {chunk_bytes / MiB:.1f} MiB; workers: {WORKERS} x {MEMORY_LIMIT}"
        )
        store = os.path.join(tmp, "pp.zarr")
        client.run(start_sampler)
        client_peak = PeakRSS()
        t0 = time.perf_counter()
        ds.to_zarr(store, compute=False).compute(scheduler=client)
        wall = time.perf_counter() - t0
        client_sampled = client_peak.stop()
        workers = client.run(stop_sampler)
        pids_after = client.run(os.getpid)
        worker_modules = sorted(set().union(*client.run(heavy_modules).values()))
        store_bytes = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs
        )

        # spot checks: chunks recomputed here (same seed and chunks) equal the store
        written = xr.open_zarr(store)["y"]
        again = group_of(
            dt.sample_posterior_predictive(idata, model=model, random_seed=3, chunks=chunks)
        )["y"]
        checks = []
        for c, d in [(0, 0), (1, 333), (2, 777), (3, DRAWS - 1)]:
            got = written[c, d].values
            same = np.array_equal(got, again[c, d].values)
            av, bv = posterior["a"][c, d].item(), posterior["b"][c, d].item()
            z = got - (av + bv * x)
            normal = abs(z.mean()) < 5 / np.sqrt(n_obs) and abs(z.std() - 1.0) < 0.01
            checks.append((f"y[{c}, {d}]", same, f"{z.mean():+.4f}", f"{z.std():.4f}", normal))
        assert written.shape == y.shape

    restarted = sorted(set(pids_before.values()) ^ set(pids_after.values()))
    mib = "{:.0f} MiB".format
    table = [
        ("client (+ scheduler, nannies)", "-", "-", mib(client_sampled / MiB), "-"),
    ]
    table[0] += (mib(max_rss() / MiB),)
    for addr, w in sorted(workers.items()):
        table.append(
            (
                f"worker {w['pid']}",
                mib(rss_start.get(addr, 0) / MiB),
                mib(rss_pytensor.get(addr, 0) / MiB),
                mib(w["sampled"] / MiB),
                mib(w["monitor"] / MiB),
                mib(w["ru_maxrss"] / MiB),
            )
        )
    headers = ["process", "RSS at start", "+ import pytensor", "peak sampled", "monitor max"]
    headers.append("ru_maxrss (life)")
    print_table(headers, table, title=f"[{NAME}] memory (limit {MEMORY_LIMIT} per worker)")
    print(f"[{NAME}] modules imported on the workers: {worker_modules}")
    print_table(
        ["draw", "store == recomputed", "residual mean", "residual sd", "standard normal?"],
        checks,
        title=f"[{NAME}] spot checks",
    )
    print(
        f"[{NAME}] wrote {y.nbytes / MiB:.0f} MiB ({store_bytes / MiB:.0f} MiB on disk) in "
        f"{fmt_time(wall)}: {y.nbytes / wall / MiB:.0f} MiB/s"
    )
    worker_peak = max(max(w["sampled"], w["monitor"]) for w in workers.values())
    rows = [
        Row(NAME, "output / one worker's memory limit", round(y.nbytes / limit, 2), 4.0, True),
        Row(NAME, "output / all workers' memory limits", round(y.nbytes / (WORKERS * limit), 2)),
        Row(NAME, "wall time of to_zarr", wall, unit="s"),
        Row(NAME, "write throughput (MiB/s)", round(y.nbytes / wall / MiB, 1)),
        Row(NAME, "max worker peak RSS / limit", round(worker_peak / limit, 3), 1.0),
        Row(NAME, "client process peak RSS (MiB)", round(client_sampled / MiB)),
        Row(
            NAME, "worker RSS after import pytensor (MiB)", round(max(rss_pytensor.values()) / MiB)
        ),
        Row(NAME, "workers restarted", len(restarted) // 2, 0),
        Row(NAME, "spot checks failed", sum(not (s and n) for _, s, _, _, n in checks), 0),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--obs", type=int, default=N_OBS, help="observations per draw")
    parser.add_argument("--chunks", default="auto", help="draws per chunk, or 'auto'")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(n_obs=args.obs, chunks=args.chunks if args.chunks == "auto" else int(args.chunks))
    if not args.no_save:
        save_results(NAME, rows)
