"""P11: a pointwise log-likelihood several times bigger than the workers' memory, to Zarr.

As P7 (``bench_p7_zarr_memory.py``, whose memory samplers this reuses), for
``dt.compute_log_likelihood``: a ``LocalCluster`` of 2 worker processes (1 thread each,
``memory_limit=1GiB`` each: the log-likelihood graph holds PyMC's parameter checks, so
the workers import PyMC, ~400 MiB with its dependencies, where P7's 500 MiB workers
pause) computes the log-likelihood of ``y ~ Normal(a + b * x, sigma)`` for 4 chains x
1,000 draws x 150,000 observations (float64: 4.8 GB, ~4.5x one worker's limit), lazily,
and writes the ``log_likelihood`` group with
``Dataset.to_zarr(path, compute=False)`` computed on the cluster: nothing is gathered.
What ``pm.compute_log_likelihood`` would hold in memory at once is the whole result.

Reported: output size / memory limit (target >= 4), wall time, the peak RSS of the client
and of every worker (target: below the limit), restarted workers, and spot checks: draws
read back from the store equal ``scipy.stats.norm.logpdf`` of the same parameters.

Run: ``python benchmarks/bench_p11_loglik_zarr.py [--obs N] [--chunks N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_time, load_row, local_cluster, print_rows, quiet, versions_line
from bench_p7_zarr_memory import (
    CHAINS,
    DRAWS,
    N_OBS,
    WORKERS,
    PeakRSS,
    max_rss,
    start_sampler,
    stop_sampler,
)

NAME = "p11-loglik-zarr"
MEMORY_LIMIT = "1GiB"
MiB = 2**20


def main(n_obs: int = N_OBS, chunks: int | str = "auto") -> list[Row]:
    quiet()
    import logging
    import tempfile
    import warnings

    import numpy as np
    import pymc as pm
    import xarray as xr
    from dask.utils import parse_bytes
    from scipy.stats import norm

    import dasktensor as dt

    warnings.filterwarnings("ignore", module="pymc")
    warnings.filterwarnings("ignore", message="Consolidated metadata")
    logging.getLogger("pymc").setLevel(logging.WARNING)
    print(f"[{NAME}] {versions_line()}")
    limit = parse_bytes(MEMORY_LIMIT)
    rng = np.random.default_rng(11)
    x = np.linspace(0.0, 1.0, n_obs)
    y = rng.normal(size=n_obs)
    with pm.Model() as model:
        a = pm.Normal("a")
        b = pm.Normal("b")
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", a + b * x, sigma, observed=y)
    shape = (CHAINS, DRAWS)
    posterior = xr.Dataset(
        {
            "a": (("chain", "draw"), rng.normal(size=shape)),
            "b": (("chain", "draw"), rng.normal(size=shape)),
            "sigma": (("chain", "draw"), rng.uniform(0.5, 2.0, size=shape)),
        },
        coords={"chain": np.arange(CHAINS), "draw": np.arange(DRAWS)},
    )
    if pm.__version__.startswith("5"):
        import arviz as az

        idata = az.InferenceData(posterior=posterior)
    else:
        idata = xr.DataTree.from_dict({"posterior": posterior})

    with (
        local_cluster(n_workers=WORKERS, memory_limit=MEMORY_LIMIT) as client,
        tempfile.TemporaryDirectory(prefix="dasktensor-p11-") as tmp,
    ):
        pids_before = client.run(os.getpid)
        ll = dt.compute_log_likelihood(idata, model=model, chunks=chunks,
                                       extend_inferencedata=False)  # fmt: skip
        out = ll["y"]
        print(f"[{NAME}] log_likelihood y {out.shape}: {out.nbytes / MiB:.0f} MiB in "
              f"{out.data.npartitions} chunks; workers: {WORKERS} x {MEMORY_LIMIT}")  # fmt: skip
        store = os.path.join(tmp, "loglik.zarr")
        client.run(start_sampler)
        client_peak = PeakRSS()
        t0 = time.perf_counter()
        ll.to_zarr(store, compute=False).compute(scheduler=client)
        wall = time.perf_counter() - t0
        client_sampled = client_peak.stop()
        workers = client.run(stop_sampler)
        pids_after = client.run(os.getpid)
        written = xr.open_zarr(store)["y"]
        failed = 0
        for c, d in [(0, 0), (1, 333), (2, 777), (3, DRAWS - 1)]:
            p = posterior.isel(chain=c, draw=d)
            want = norm.logpdf(y, float(p["a"]) + float(p["b"]) * x, float(p["sigma"]))
            failed += not np.allclose(written[c, d].values, want, rtol=1e-10)

    restarted = sorted(set(pids_before.values()) ^ set(pids_after.values()))
    worker_peak = max(max(w["sampled"], w["monitor"]) for w in workers.values())
    print(f"[{NAME}] wrote {out.nbytes / MiB:.0f} MiB in {fmt_time(wall)}; client peak RSS "
          f"{client_sampled / MiB:.0f} MiB (life {max_rss() / MiB:.0f} MiB)")  # fmt: skip
    rows = [
        Row(NAME, "output / one worker's memory limit", round(out.nbytes / limit, 2), 4.0, True),
        Row(NAME, "wall time of to_zarr", wall, unit="s"),
        Row(NAME, "write throughput (MiB/s)", round(out.nbytes / wall / MiB, 1)),
        Row(NAME, "max worker peak RSS / limit", round(worker_peak / limit, 3), 1.0),
        Row(NAME, "client process peak RSS (MiB)", round(client_sampled / MiB)),
        Row(NAME, "workers restarted", len(restarted) // 2, 0),
        Row(NAME, "spot checks failed", failed, 0),
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
