"""The ``dasktensor`` command line (``dasktensor --help``): its parser and ``demo``.

:func:`main` is the ``dasktensor`` command: the parser of every subcommand is here, each
runs a handler:

* ``demo`` (here): sample a PyMC model whose likelihood calls remote models on a Dask
  cluster (the model is :mod:`dasktensor.cli._demo`), against the same model run serially;
* ``info`` (:mod:`dasktensor.cli._info`): a cluster's scheduler, workers and versions;
* ``bench`` (:mod:`dasktensor.cli._bench`): the benchmarks of the source tree;
* ``worker`` (:mod:`dasktensor.cli._worker`): one worker per GPU of a host, for a running
  cluster.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

import dasktensor.cli._bench as _bench  # noqa: PLR0402 (the package imports this module: no cycle)
import dasktensor.cli._demo as _demo  # noqa: PLR0402
import dasktensor.cli._info as _info  # noqa: PLR0402
import dasktensor.cli._serve as _serve  # noqa: PLR0402
import dasktensor.cli._worker as _worker  # noqa: PLR0402
from dasktensor import _compat
from dasktensor.cluster import calls_link, connect, scheduler_workers


def _run_demo(args) -> int:
    """The ``demo`` command: sample the demo model remotely and serially; the exit code."""
    if args.scheduler:
        print(f"Connecting to the scheduler at {args.scheduler} ...")
        client = connect(args.scheduler)
    else:
        print(f"Starting an embedded cluster: {args.workers} worker process(es) on {args.host}")
        client = connect(
            n_workers=args.workers,
            threads_per_worker=1,
            host=args.host,
            scheduler_port=args.port,
            dashboard_address=args.dashboard_address,
        )
    models = []
    try:
        pm = _compat.import_pymc()

        print(f"Dashboard: {client.dashboard_link}")
        print(f"Remote calls (not in the task stream): {calls_link(client)}")
        n_workers = len(scheduler_workers(client))
        t0 = time.perf_counter()
        models = _demo.remote_sites(args.models, args.delay, seed=args.seed)
        for m in models:
            m.start()
        print(
            f"{args.models} remote models ({', '.join(m.name for m in models)}), each built "
            f"once on each of the {n_workers} workers: {time.perf_counter() - t0:.2f} s"
        )
        settings = dict(
            draws=args.draws,
            tune=args.tune,
            chains=args.chains,
            cores=args.cores,
            random_seed=args.seed,
            progressbar=False,
            compute_convergence_checks=False,
        )
        print(
            f"Sampling: {args.chains} chain(s) x ({args.tune} tune + {args.draws} draws), "
            f"{args.cores} process(es); every log-density evaluation makes {args.models} "
            f"model calls of {args.delay * 1e3:g} ms"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyMC's notes on short runs
            t0 = time.perf_counter()
            with _demo.build_model(_demo.site_ops(models)):
                remote = pm.sample(**settings)
            t_remote = time.perf_counter() - t0
            print(f"  remote calls, concurrently on the cluster: {t_remote:8.2f} s")
            if args.no_serial:
                t_serial = None
            else:
                t0 = time.perf_counter()
                with _demo.build_model(_demo.local_site_ops(args.models, args.delay, args.seed)):
                    serial = pm.sample(**settings, compile_kwargs={"mode": _demo.serial_mode()})
                t_serial = time.perf_counter() - t0
        if t_serial is not None:
            same = all(
                np.array_equal(remote.posterior[v].values, serial.posterior[v].values)
                for v in ("mu", "log_sigma")
            )
            print(f"  the same model, calls one after another:   {t_serial:8.2f} s")
            ideal, why = _demo.ideal_speedup(args.models, args.chains, args.cores, n_workers)
            print(
                f"  speed-up: {t_serial / t_remote:.2f}x (ideal {ideal:g}x: {why}); "
                f"identical draws: {same}"
            )
        print()
        print(_summary(remote))
        if args.keep_open:
            print(f"Cluster kept open; dashboard: {client.dashboard_link}; Ctrl+C stops it.")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    finally:
        for m in models:
            try:
                m.close()
            except Exception as e:  # the cluster may be gone already; say so, go on
                print(f"(could not release {m!r}: {e})", file=sys.stderr)
        if args.scheduler:
            client.close()
        else:
            client.shutdown()
    return 0


def _summary(idata) -> str:
    """Posterior mean, sd and 94% interval (3% and 97% quantiles) of each variable."""
    lines = [f"{'':<10} {'mean':>8} {'sd':>8} {'hdi_3%':>8} {'hdi_97%':>8}"]
    for name, values in idata.posterior.data_vars.items():
        v = np.asarray(values).ravel()
        lo, hi = np.quantile(v, [0.03, 0.97])
        lines.append(f"{name:<10} {v.mean():8.3f} {v.std():8.3f} {lo:8.3f} {hi:8.3f}")
    return "Posterior (remote run):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dasktensor`` command."""
    parser = argparse.ArgumentParser(prog="dasktensor", description="Run PyTensor graphs on Dask.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="sample a PyMC model whose likelihood calls remote models on a Dask cluster",
        description=(
            "Sample a PyMC model whose likelihood is several independent slow remote "
            "model calls, on an embedded LocalCluster (or --scheduler ADDR); print the "
            "dashboard link, the sampling time against the same model evaluated serially "
            "in this process, and the posterior summary."
        ),
    )
    demo.add_argument("--scheduler", metavar="ADDR", help="address of a running scheduler")
    demo.add_argument("--host", default="127.0.0.1", help="embedded scheduler host (127.0.0.1)")
    demo.add_argument("--port", type=int, default=0, help="embedded scheduler port (0: any)")
    demo.add_argument(
        "--dashboard-address", default="127.0.0.1:0", help="embedded dashboard (127.0.0.1:0)"
    )
    demo.add_argument("--workers", type=int, default=4, help="embedded worker processes (4)")
    demo.add_argument("--models", type=int, default=4, help="remote models in the likelihood (4)")
    demo.add_argument("--delay", type=float, default=0.02, help="seconds per model call (0.02)")
    demo.add_argument("--draws", type=int, default=100, help="draws per chain (100)")
    demo.add_argument("--tune", type=int, default=100, help="tuning steps per chain (100)")
    demo.add_argument("--chains", type=int, default=2, help="chains (2)")
    demo.add_argument("--cores", type=int, default=2, help="sampler processes (2)")
    demo.add_argument("--seed", type=int, default=1, help="random seed (1)")
    demo.add_argument(
        "--no-serial", action="store_true", help="skip the serial run it is compared with"
    )
    demo.add_argument(
        "--keep-open", action="store_true", help="keep the cluster up to browse the dashboard"
    )
    demo.set_defaults(run=_run_demo)

    info = sub.add_parser(
        "info",
        help="show a cluster's scheduler, dashboard, workers and versions",
        description=(
            "Connect to a running Dask cluster and print its scheduler address, dashboard "
            "link, workers (address, name, threads, memory limit, resources), the GPUs each "
            "worker sees (name, memory total and used) and the "
            "versions of dasktensor, dask, distributed, PyTensor, PyMC, NumPy and Python in "
            "this process, on the scheduler and on the workers, flagging mismatches. The "
            "scheduler is --scheduler ADDR, else `dasktensor.scheduler-address` in Dask's "
            "config, else DASK_SCHEDULER_ADDRESS; without any, it says how to start one "
            "(it never starts a cluster unless asked with --embedded). tls:// clusters take "
            "--tls-ca-file/--tls-cert/--tls-key, or the certificates in Dask's config "
            "(distributed.comm.tls.*). Exit code 1 when the scheduler cannot be reached, "
            "2 when there is no address."
        ),
    )
    where = info.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDR", help="address of a running scheduler")
    where.add_argument(
        "--embedded",
        action="store_true",
        help="start an embedded cluster with dt.connect() (dasktensor.cluster.* settings), "
        "show it, stop it",
    )
    info.add_argument(
        "--timeout",
        metavar="SECONDS",
        help="how long to wait for the scheduler (dasktensor.connect-timeout: 10s)",
    )
    info.add_argument("--tls-ca-file", metavar="PEM", help="tls://: the cluster's CA certificate")
    info.add_argument("--tls-cert", metavar="PEM", help="tls://: this client's certificate")
    info.add_argument("--tls-key", metavar="PEM", help="tls://: this client's private key")
    info.set_defaults(run=_info.run)

    bench = sub.add_parser(
        "bench",
        help="run the benchmarks of the source tree and print their results table",
        description=(
            "Run benchmarks/run_all.py of the source tree (beside the dasktensor package: "
            'a clone installed with `pip install -e ".[benchmarks]"`; a wheel has no '
            "benchmarks) in a subprocess with this interpreter, and print each benchmark's "
            "details and the table of all results (measured, target, met?). Without names "
            "it runs them all, which takes a long time on a small machine."
        ),
    )
    bench.add_argument(
        "names", nargs="*", metavar="NAME", help="benchmarks to run (keys from --list)"
    )
    bench.add_argument(
        "--list", action="store_true", help="list the benchmarks with one line each and exit"
    )
    bench.set_defaults(run=_bench.run)

    _serve.add_parser(sub)
    _worker.add_parser(sub)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
