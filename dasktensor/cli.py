"""The ``dasktensor`` command line (``dasktensor --help``)."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path


def _demo(args) -> int:
    import warnings

    import numpy as np

    import dasktensor as dt
    from dasktensor import _demo as demo

    if args.scheduler:
        print(f"Connecting to the scheduler at {args.scheduler} ...")
        client = dt.connect(args.scheduler)
    else:
        print(f"Starting an embedded cluster: {args.workers} worker process(es) on {args.host}")
        client = dt.connect(
            n_workers=args.workers,
            threads_per_worker=1,
            host=args.host,
            scheduler_port=args.port,
            dashboard_address=args.dashboard_address,
        )
    models = []
    try:
        import pymc as pm

        print(f"Dashboard: {client.dashboard_link}")
        n_workers = len(client.scheduler_info()["workers"])
        t0 = time.perf_counter()
        models = demo.remote_sites(args.models, args.delay, seed=args.seed)
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
            with demo.build_model(demo.site_ops(models)):
                remote = pm.sample(**settings)
            t_remote = time.perf_counter() - t0
            print(f"  remote calls, concurrently on the cluster: {t_remote:8.2f} s")
            if args.no_serial:
                t_serial = None
            else:
                t0 = time.perf_counter()
                with demo.build_model(demo.local_site_ops(args.models, args.delay, args.seed)):
                    serial = pm.sample(**settings, compile_kwargs={"mode": demo.serial_mode()})
                t_serial = time.perf_counter() - t0
        if t_serial is not None:
            same = all(
                np.array_equal(remote.posterior[v].values, serial.posterior[v].values)
                for v in ("mu", "log_sigma")
            )
            print(f"  the same model, calls one after another:   {t_serial:8.2f} s")
            print(
                f"  speed-up: {t_serial / t_remote:.2f}x "
                f"(ideal {min(args.models, n_workers)}x); identical draws: {same}"
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
    """Posterior mean, sd and 94% interval of each variable (ArviZ's summary if present)."""
    import numpy as np

    lines = [f"{'':<10} {'mean':>8} {'sd':>8} {'hdi_3%':>8} {'hdi_97%':>8}"]
    for name, values in idata.posterior.data_vars.items():
        v = np.asarray(values).ravel()
        lo, hi = np.quantile(v, [0.03, 0.97])
        lines.append(f"{name:<10} {v.mean():8.3f} {v.std():8.3f} {lo:8.3f} {hi:8.3f}")
    return "Posterior (remote run):\n" + "\n".join(lines)


# ------------------------------------------------------------------------------- info

#: packages whose versions ``dasktensor info`` compares (``python`` is the interpreter)
VERSION_PACKAGES = ("dasktensor", "dask", "distributed", "pytensor", "pymc", "numpy", "python")
#: what the scheduler needs to share with the client; it runs no PyTensor code
SCHEDULER_PACKAGES = ("dask", "distributed", "python")

NO_ADDRESS = (
    "No scheduler to look at: give its address with `dasktensor info --scheduler "
    "tcp://HOST:8786`, or set DASK_SCHEDULER_ADDRESS (or `dasktensor.scheduler-address` in "
    "Dask's config). To start a cluster: `dask scheduler` on one machine and "
    "`dask worker tcp://HOST:8786` on each worker machine; `dasktensor info --embedded` "
    "starts an embedded cluster on this machine for a look (stopped on exit)."
)


def _info(args) -> int:
    import dasktensor as dt
    from dasktensor._cluster import _configured_address

    address = args.scheduler or (None if args.embedded else _configured_address())
    if address is None and not args.embedded:
        print(NO_ADDRESS, file=sys.stderr)
        return 2
    security = None
    tls_files = (args.tls_ca_file, args.tls_cert, args.tls_key)
    if any(tls_files):
        if not all(tls_files):
            print(
                "--tls-ca-file, --tls-cert and --tls-key go together (the cluster's CA "
                "certificate, this client's certificate and its private key)",
                file=sys.stderr,
            )
            return 2
        from distributed.security import Security

        security = Security(
            tls_ca_file=args.tls_ca_file,
            tls_client_cert=args.tls_cert,
            tls_client_key=args.tls_key,
            require_encryption=True,
        )
    if args.embedded and security is not None:
        print(
            "--tls-* options are for --scheduler: --embedded starts its own cluster",
            file=sys.stderr,
        )
        return 2
    import dask
    from distributed.versions import VersionMismatchWarning

    # --embedded: dt.connect() without an address, whatever address the config holds
    no_address = {"dasktensor.scheduler-address": None, "scheduler-address": None}
    try:
        with warnings.catch_warnings(), dask.config.set(no_address if args.embedded else {}):
            # distributed's own table of mismatched versions: the report below is fuller
            warnings.simplefilter("ignore", VersionMismatchWarning)
            client = dt.connect(
                address, security=security, timeout=args.timeout, set_as_default=False
            )
    except ConnectionError as e:
        print(f"dasktensor info: {e}", file=sys.stderr)
        return 1
    try:
        if address is None:
            print("Embedded cluster started by dt.connect() (stopped on exit):")
        print(cluster_report(client))
    finally:
        if address is None:
            client.shutdown()
        client.close()
    return 0


def cluster_report(client) -> str:
    """Describe the cluster of ``client``: scheduler, dashboard, workers and versions.

    What ``dasktensor info`` prints.  Versions of dasktensor, dask, distributed, PyTensor,
    PyMC, NumPy and Python are read (from package metadata, nothing is imported) in this
    process, on the scheduler and on every worker; differences are listed at the end.

    Parameters
    ----------
    client : distributed.Client
        A connected client.

    Returns
    -------
    str
        The report, several lines.
    """
    from dask.utils import format_bytes

    info = client.scheduler_info(n_workers=-1)
    workers = info["workers"]
    services = info.get("services", {})
    if "dashboard" in services:
        dashboard = client.dashboard_link
    else:
        dashboard = "none (the scheduler runs no dashboard)"
    threads = sum(w["nthreads"] for w in workers.values())
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    memory = format_bytes(sum(limits)) if all(limits) else "no limit on some"
    lines = [
        f"Scheduler:  {info['address']}",
        f"Dashboard:  {dashboard}",
        f"Workers:    {len(workers)} ({threads} thread(s), memory limit {memory})",
    ]
    rows = [("address", "name", "threads", "memory limit", "resources")]
    for address, w in sorted(workers.items()):
        limit = w.get("memory_limit")
        resources = ", ".join(f"{k}={v:g}" for k, v in sorted(w.get("resources", {}).items()))
        rows.append(
            (
                address,
                str(w.get("name", "")),
                str(w["nthreads"]),
                format_bytes(limit) if limit else "no limit",
                resources or "-",
            )
        )
    if workers:
        lines += _table(rows)
    else:
        lines.append("  (no workers: start some with `dask worker ADDRESS`)")

    versions = client.get_versions(check=False, packages=["dasktensor", "pytensor", "pymc"])
    lines.append("Versions:")
    table, mismatches = _version_table(versions, list(workers))
    lines += table
    if mismatches:
        lines.append("VERSION MISMATCH (tasks may fail or give wrong results):")
        lines += [f"  {m}" for m in mismatches]
    else:
        lines.append(
            f"Versions match (the scheduler needs only {', '.join(SCHEDULER_PACKAGES)} to match)."
        )
    return "\n".join(lines)


def _package_version(report, name: str) -> str:
    """A package's version in one process's ``get_versions`` report; "-": not installed."""
    if not isinstance(report, dict):
        return "?"  # the process did not answer
    v = report.get("packages", {}).get(name)
    if v is None:
        return "-"
    return ".".join(str(v).split(".")[:3]) if name == "python" else str(v)


def _version_table(versions, worker_addresses) -> tuple[list[str], list[str]]:
    """Rows of client / scheduler / workers versions, and the differences that matter."""
    client = versions["client"]
    scheduler = versions["scheduler"]
    workers = {a: versions["workers"].get(a) for a in worker_addresses}
    rows = [("package", "client", "scheduler", "workers")]
    mismatches = []
    for name in VERSION_PACKAGES:
        mine = _package_version(client, name)
        theirs = _package_version(scheduler, name)
        by_worker = {a: _package_version(r, name) for a, r in workers.items()}
        distinct = sorted(set(by_worker.values()))
        if len(distinct) == 1:
            on_workers = distinct[0]
        elif not distinct:
            on_workers = "(no workers)"
        else:
            counts = [f"{v} ({list(by_worker.values()).count(v)})" for v in distinct]
            on_workers = "mixed: " + ", ".join(counts)
        differs = [a for a, v in sorted(by_worker.items()) if v != mine]
        if name in SCHEDULER_PACKAGES and theirs != mine:
            mismatches.append(f"{name}: client {mine}, scheduler {theirs}")
        if differs:
            shown = ", ".join(f"{a} {by_worker[a]}" for a in differs[:3])
            more = f" and {len(differs) - 3} more" if len(differs) > 3 else ""
            mismatches.append(f"{name}: client {mine}, worker(s) {shown}{more}")
        flag = "  <-" if (differs or (name in SCHEDULER_PACKAGES and theirs != mine)) else ""
        rows.append((name, mine, theirs, on_workers + flag))
    return _table(rows), mismatches


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# ------------------------------------------------------------------------------ bench


def benchmarks_dir() -> Path:
    """Where ``dasktensor bench`` finds the benchmarks: ``benchmarks/`` of the source tree.

    The benchmarks are not part of the installed package: they sit beside the
    ``dasktensor`` package directory in a clone of the repository (installed with
    ``pip install -e``).

    Returns
    -------
    pathlib.Path
        The directory holding ``run_all.py``.

    Raises
    ------
    FileNotFoundError
        There is no ``benchmarks/run_all.py`` beside the package (installed from a wheel).
    """
    import dasktensor

    package = Path(dasktensor.__file__).resolve().parent
    where = package.parent / "benchmarks"
    if not (where / "run_all.py").is_file():
        raise FileNotFoundError(
            f"The benchmarks are not installed with dasktensor: `dasktensor bench` looks "
            f"for them in the source tree, beside the package ({where}), and found no "
            "run_all.py there (dasktensor was installed from a wheel, not from a clone). "
            'Clone the repository, `pip install -e ".[benchmarks]"` in it, and run '
            "`dasktensor bench` (or `python benchmarks/run_all.py`) there."
        )
    return where


def list_benchmarks(where: Path) -> dict[str, tuple[str, str]]:
    """The benchmarks ``run_all.py`` knows: key -> (module, one-line description).

    Read from the source files (``run_all.BENCHMARKS`` and each module's docstring)
    without importing them, so listing costs no import of the benchmarks' dependencies.

    Parameters
    ----------
    where : pathlib.Path
        The benchmarks directory (:func:`benchmarks_dir`).

    Returns
    -------
    dict
        ``{"a": ("bench_a_overhead", "Overhead of the DASK mode ..."), ...}``, in
        ``run_all.py``'s order.
    """
    import ast
    import re

    tree = ast.parse((where / "run_all.py").read_text())
    table = None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "BENCHMARKS" for t in targets):
            table = ast.literal_eval(node.value)
    if not isinstance(table, dict):
        raise ValueError(f"no BENCHMARKS dict in {where / 'run_all.py'}")
    found = {}
    for key, module in table.items():
        source = where / f"{module}.py"
        doc = ast.get_docstring(ast.parse(source.read_text())) if source.is_file() else None
        line = (doc or "(no description)").strip().splitlines()[0]
        # "(a) Overhead ..." / "P1: one remote ..." -> the key is shown beside it already
        line = re.sub(rf"^(\({re.escape(key)}\)|{re.escape(key)}:)\s*", "", line, flags=re.I)
        found[key] = (module, line)
    return found


def _bench(args) -> int:
    import subprocess

    try:
        where = benchmarks_dir()
        known = list_benchmarks(where)
    except (FileNotFoundError, ValueError, SyntaxError) as e:
        print(f"dasktensor bench: {e}", file=sys.stderr)
        return 1
    if args.list:
        print(f"Benchmarks in {where} (`dasktensor bench KEY ...`; none given: all):")
        rows = [(key, f"{module}.py", line) for key, (module, line) in known.items()]
        print("\n".join(_table(rows)))
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(
            f"dasktensor bench: unknown benchmark(s) {', '.join(unknown)}; "
            f"known: {', '.join(known)} (`dasktensor bench --list` describes them)",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, str(where / "run_all.py"), *args.names]
    print(
        f"Running {', '.join(args.names or known)} in a subprocess ({' '.join(command)})"
        + ("" if args.names else "; all of them take a long time"),
        flush=True,
    )
    process = subprocess.Popen(command)
    try:
        code = process.wait()
    except KeyboardInterrupt:  # the benchmarks got the Ctrl+C too: let them stop
        code = process.wait()
    if code < 0:  # ended by a signal: the shell's convention
        code = 128 - code
    if code:
        print(
            f"dasktensor bench: run_all.py exited with code {code} (the benchmarks need "
            'the benchmarks extra: pip install -e ".[benchmarks]")',
            file=sys.stderr,
        )
    return code


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
    demo.set_defaults(run=_demo)

    info = sub.add_parser(
        "info",
        help="show a cluster's scheduler, dashboard, workers and versions",
        description=(
            "Connect to a running Dask cluster and print its scheduler address, dashboard "
            "link, workers (address, name, threads, memory limit, resources) and the "
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
    info.set_defaults(run=_info)

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
    bench.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
