"""P5: pm.sample of a model with four independent 20 ms likelihood terms, on four workers.

The model of ``dasktensor demo`` (``dasktensor/_demo.py``): priors on ``mu`` and
``log_sigma`` and four *sites*, each a slow model with its own data whose ``logp_grad``
takes 20 ms.  Sampled twice with the same seed, in this one run:

* **remote**: each site is a ``RemoteModel`` replicated on the 4 worker processes of a
  ``LocalCluster``; ``pm.sample`` without a mode (dasktensor's rewrite makes the four
  calls of each evaluation at once);
* **serial**: the same sites computed in the sampling process, one after another.

Target: serial / remote sampling time >= 3.6, and identical draws.  Printed beside it, the
same ratio for one evaluation's four calls alone, without PyMC (the four remote calls made
at once, against the four sites called one after another in this process): what the
round trips to the workers leave of the ideal 4x on this machine.  One chain by default
(``--chains 2`` samples two chains in two processes, both runs alike).

Run: ``python benchmarks/bench_p5_sampling.py [--chains N] [--draws N] [--tune N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, print_table, quiet, versions_line

NAME = "p5-sampling"
DELAY = 0.02
SITES = 4
WORKERS = 4


def site_a_calls(client, remote_site, op) -> int:
    """Log-density evaluations of a run: calls of the first site (one per evaluation)."""
    site = getattr(op.fn, "__self__", None)
    if site is not None:  # computed in this process (in the sampler processes if chains > 1)
        return site.calls

    def calls(key, dask_worker=None):
        from dasktensor_worker.plugin import host_of

        host = host_of(dask_worker)
        return host.replicas[key].model.calls if host and key in host.replicas else 0

    return sum(client.run(calls, remote_site.key).values())


def calls_only(sites, local_ops) -> dict[str, float]:
    """One evaluation's four calls without PyMC: remote at once vs local one by one."""
    import numpy as np
    from _common import compare

    from dasktensor.cli import _demo
    from dasktensor.remote import RemoteMethod

    q = np.array([1.5, -0.2])
    remote = [op.fn for op in _demo.site_ops(sites)]
    return compare(
        {
            # what the merged node of the sampler's function does
            "remote": lambda: RemoteMethod.call_together([(r, (q,)) for r in remote]),
            "serial": lambda: [op.fn(q) for op in local_ops],
        },
        repeat=15,
        number=5,
    )


def main(chains: int = 1, draws: int = 150, tune: int = 150) -> list[Row]:
    quiet()
    import warnings

    import numpy as np
    import pymc as pm

    from dasktensor.cli import _demo

    print(f"[{NAME}] {versions_line()}")
    settings = dict(
        draws=draws,
        tune=tune,
        chains=chains,
        cores=chains,
        random_seed=7,
        progressbar=False,
        compute_convergence_checks=False,
    )
    runs, draws_of, evals = {}, {}, {}
    with local_cluster(n_workers=WORKERS, preload=["dasktensor"]) as client:
        sites = _demo.remote_sites(SITES, DELAY, scheduler=client)
        for m in sites:
            m.start()
        variants = {
            "remote (4 workers)": (_demo.site_ops(sites), {}),
            "serial (in process)": (
                _demo.local_site_ops(SITES, DELAY),
                {"compile_kwargs": {"mode": _demo.serial_mode()}},
            ),
        }
        for name, (ops, extra) in variants.items():
            with warnings.catch_warnings(), _demo.build_model(ops):
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                idata = pm.sample(**settings, **extra)
                runs[name] = time.perf_counter() - t0
            draws_of[name] = {v: idata.posterior[v].values for v in ("mu", "log_sigma")}
            evals[name] = site_a_calls(client, sites[0], ops[0])
            print(f"{name}: {runs[name]:.2f} s, {evals[name]} evaluations", flush=True)
        floor = calls_only(sites, variants["serial (in process)"][0])
        for m in sites:
            m.close()

    remote, serial = runs["remote (4 workers)"], runs["serial (in process)"]
    same = all(
        np.array_equal(draws_of["remote (4 workers)"][v], draws_of["serial (in process)"][v])
        for v in ("mu", "log_sigma")
    )
    # evaluations per chain (local sites count in this process only: chains == 1)
    per_eval = {k: runs[k] / max(evals[k] / chains, 1) for k in runs}
    print_table(
        ["variant", "sampling time", "per evaluation (per chain)"],
        [(k, f"{v:.2f} s", f"{per_eval[k] * 1e3:.1f} ms") for k, v in runs.items()],
        title=f"[{NAME}] {chains} chain(s) x ({tune} tune + {draws} draws), one run each",
    )
    rows = [
        Row(NAME, "speed-up serial/remote", serial / remote, 3.6, higher_is_better=True),
        Row(NAME, "identical draws", int(same), 1, higher_is_better=True),
        Row(NAME, "remote sampling time", remote, unit="s"),
        Row(NAME, "serial sampling time", serial, unit="s"),
        Row(NAME, "remote time per evaluation", per_eval["remote (4 workers)"], unit="s"),
        Row(NAME, "calls alone: serial/remote", floor["serial"] / floor["remote"]),
        Row(NAME, "calls alone: 4 remote at once", floor["remote"], unit="s"),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=1)
    parser.add_argument("--draws", type=int, default=150)
    parser.add_argument("--tune", type=int, default=150)
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(args.chains, args.draws, args.tune)
    if not args.no_save:
        save_results(NAME, rows)
