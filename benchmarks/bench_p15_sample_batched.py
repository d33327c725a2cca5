"""P15: ``dt.sample`` of 8 chains whose likelihood is one remote model, batched or not.

The model of P14 (``_ops.GpuPriced``: a normal likelihood over 1,000 rows priced like a GPU,
10 ms a call + 0.5 ms a row) on one replica, called by a PyMC model through
``RemoteModel.logp_grad_op``; ``dt.sample`` runs 8 chains at once on a ``LocalCluster`` of
4 worker processes x 2 threads (a thread per chain's segments; chains sharing a process
also share its GIL for NUTS's own Python work, which spreads their calls out: 2 x 4 gave
2.6x where 4 x 2 gave 2.8x, with 50 + 50 draws).  Each ``dt.sample`` run pays a few
seconds of its own (the step method installed and compiled on the workers), hence 100 +
100 draws by default.  Nothing changes in the
PyMC model or in ``dt.sample``'s arguments: the batched method (``logp_grad``) coalesces
the chains' calls that wait for the replica; the unbatched one (``logp_grad_alone``, the
same arithmetic for one row) serves them one after another.

Target: wall unbatched / batched >= 3, and identical draws (the same arithmetic per row
gives each chain the same log-density, bit for bit, whatever its batch).

Run: ``python benchmarks/bench_p15_sample_batched.py [--draws N] [--tune N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, quiet, versions_line

NAME = "p15-sample-batched"
CHAINS = 8


def run(client, model, method: str, draws: int, tune: int):
    """``dt.sample`` of the model calling ``method``; (wall seconds, draws by variable)."""
    import numpy as np
    import pymc as pm
    import pytensor.tensor as pt

    import dasktensor as dt

    op = model.logp_grad_op(method, [pt.dvector])
    with pm.Model():
        mu = pm.Normal("mu", 1.0, 5.0)
        log_sigma = pm.Normal("log_sigma", 0.0, 1.0)
        pm.Potential("likelihood", op(pt.stack([mu, log_sigma]))[0])
        t0 = time.perf_counter()
        idata = dt.sample(
            draws,
            tune=tune,
            chains=CHAINS,
            random_seed=20261203,
            progressbar=False,
            compute_convergence_checks=False,
            client=client,
        )
        wall = time.perf_counter() - t0
    return wall, {v: np.asarray(idata.posterior[v].values) for v in ("mu", "log_sigma")}


def batch_sizes(client, name: str) -> list[int]:
    def sizes(dask_worker):
        host = dask_worker.plugins.get("dasktensor-models")
        records = host.calls.since(0.0)["records"] if host is not None else []
        return [r[5] for r in records if r[0] == name and r[1] == "logp_grad"]

    return [s for found in client.run(sizes).values() for s in found]


def main(draws: int = 100, tune: int = 100, workers: int = 4, threads: int = 2) -> list[Row]:
    quiet()
    import numpy as np
    from _ops import GpuPriced

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    print(f"[{NAME}] {workers} worker process(es) x {threads} thread(s)")
    with local_cluster(n_workers=workers, threads_per_worker=threads) as client:
        model = dt.RemoteModel(GpuPriced, name="gpu-priced", replicas=1, scheduler=client)
        model.start()
        for method in ("logp_grad", "logp_grad_alone"):  # warm-up: compile caches filled
            run(client, model, method, 5, 5)
        # A-B-A: batched, unbatched, batched; the mean of the batched runs cancels a load
        # that drifts linearly, and the second checks that the draws do not depend on
        # what happened to run together
        t_batched, batched = run(client, model, "logp_grad", draws, tune)
        t_unbatched, unbatched = run(client, model, "logp_grad_alone", draws, tune)
        t_again, again = run(client, model, "logp_grad", draws, tune)
        sizes = batch_sizes(client, "gpu-priced")
        same = all(np.array_equal(batched[v], unbatched[v]) for v in batched)
        repeat = all(np.array_equal(batched[v], again[v]) for v in batched)
        print(
            f"[{NAME}] {CHAINS} chains x ({tune} + {draws}): batched {t_batched:.1f} s and "
            f"{t_again:.1f} s, unbatched {t_unbatched:.1f} s; mean batch "
            f"{np.mean(sizes):.2f} calls ({len(sizes)} batches)"
        )
        mean = (t_batched + t_again) / 2
        rows += [
            Row(NAME, "wall, unbatched (s)", round(t_unbatched, 1)),
            Row(NAME, "wall, batched (s; the mean of the runs before and after)", round(mean, 1)),
            Row(NAME, "speed-up unbatched / batched", t_unbatched / mean, 3, True),
            Row(NAME, "draws batched = unbatched (1/0)", int(same), 1, True),
            Row(NAME, "draws batched = batched again (1/0)", int(repeat), 1, True),
            Row(NAME, "mean calls per batch", round(float(np.mean(sizes)), 2)),
        ]
        model.close()
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--tune", type=int, default=100)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="threads per worker")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(draws=args.draws, tune=args.tune, workers=args.workers, threads=args.threads)
    if not args.no_save:
        save_results(NAME, rows)
