"""The ``dasktensor info`` command: a cluster's scheduler, dashboard, workers and versions.

:func:`cluster_report` is what it prints: the workers as a table, and the versions of the
packages a task depends on (dasktensor, dask, distributed, PyTensor, PyMC, NumPy, Python)
in this process, on the scheduler and on every worker, with the differences that matter
(a worker's packages must match this process's; the scheduler runs no PyTensor code, so
only dask, distributed and Python must match there).  :func:`table` lays out the tables
of the command line.  Its arguments are declared with the others in
:func:`dasktensor.cli.main`.
"""

from __future__ import annotations

import sys
import warnings

import dask
from dask.utils import format_bytes

from dasktensor.cluster import calls_link, configured_address, connect, info, scheduler_workers

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


def run(args) -> int:
    """The ``info`` command: connect, print :func:`cluster_report`; the exit code."""
    address = args.scheduler or (None if args.embedded else configured_address())
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
    from distributed.versions import VersionMismatchWarning

    # --embedded: dt.connect() without an address, whatever address the config holds
    no_address = {"dasktensor.scheduler-address": None, "scheduler-address": None}
    try:
        with warnings.catch_warnings(), dask.config.set(no_address if args.embedded else {}):
            # distributed's own table of mismatched versions: the report below is fuller
            warnings.simplefilter("ignore", VersionMismatchWarning)
            client = connect(
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
    info = client.scheduler_info(n_workers=0)
    workers = scheduler_workers(client)
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
        f"Calls page: {calls_link(client) or 'none'}",
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
        lines += table(rows)
    else:
        lines.append("  (no workers: start some with `dask worker ADDRESS`)")
    lines += _gpu_lines(client)

    versions = client.get_versions(check=False, packages=["dasktensor", "pytensor", "pymc"])
    lines.append("Versions:")
    version_rows, mismatches = _version_table(versions, list(workers))
    lines += version_rows
    if mismatches:
        lines.append("VERSION MISMATCH (tasks may fail or give wrong results):")
        lines += [f"  {m}" for m in mismatches]
    else:
        lines.append(
            f"Versions match (the scheduler needs only {', '.join(SCHEDULER_PACKAGES)} to match)."
        )
    return "\n".join(lines)


def _gpu_lines(client) -> list[str]:
    """The GPUs each worker sees (``dt.info``): a line saying how many see one, then a
    row per worker when any sees a device or was started with ``CUDA_VISIBLE_DEVICES``:
    what it holds (models, placed blocks) and its devices."""
    seen = info(client).workers
    with_gpus = [w for w in seen if w.devices]
    told = [w for w in seen if w.devices or w.env.get("CUDA_VISIBLE_DEVICES") is not None]
    if not with_gpus:
        head = "GPUs:       none seen by the workers (nvidia-smi, CUDA_VISIBLE_DEVICES)"
    else:
        total = sum(len(w.devices) for w in with_gpus)
        head = f"GPUs:       {total} device(s), seen by {len(with_gpus)} worker(s)"
    if not told:
        return [head]
    rows = [(r[0], r[-2], r[-1]) for r in (w.row() for w in told)]
    return [head, *table([("name", "holds (calls)", "GPUs"), *rows])]


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
    return table(rows), mismatches


def table(rows) -> list[str]:
    """Rows of strings (the first a header) as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
