"""Shared helpers of the dasktensor benchmarks.

The machine the benchmarks run on is small (2 cores) and shared, so:

* every measurement is a median over several samples, after warm-up calls;
* alternatives are measured side by side in the same run: in alternating blocks of
  back-to-back calls (``blocks``), as a sampler calls a function, or for slow calls
  interleaved sample by sample (``compare``), so that drifting background load affects
  them alike.  Interleaving single fast calls of two variants flatters the cluster: the
  default mode's 2M-row evaluation took 11-12.8 ms interleaved with sharded calls and
  7.3 ms back to back (PITFALLS);
* nothing asserts on timings: a benchmark returns rows (benchmark, metric, measured,
  target, met?) and prints them.

Benchmark modules import this file as ``_common`` (``import_common`` below puts this
directory on ``sys.path``), so they run as scripts (``python benchmarks/bench_x.py``) and
from ``run_all.py`` alike; worker processes are spawned and inherit ``sys.path``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))

# Environment of single-threaded worker processes (and of anything this process spawns).
SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
}


def quiet() -> None:
    """Silence the warnings that PyMC/ArviZ print at import; they clutter the tables."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*ravel_inputs.*")
    # PyTensor 2.38 from pip: its C Dot22 falls back to NumPy's BLAS (same for both modes)
    warnings.filterwarnings("ignore", message="PyTensor could not link to a BLAS")


# ----------------------------------------------------------------------------- timing


def _sample(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def median_time(
    fn: Callable[[], object], *, repeat: int = 15, number: int = 1, warmup: int = 2
) -> float:
    """Median seconds per call of ``fn()``: ``warmup`` calls, then ``repeat`` samples of
    ``number`` calls each."""
    for _ in range(warmup):
        fn()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        samples = [_sample(fn, number) for _ in range(repeat)]
    finally:
        if gc_was:
            gc.enable()
    return statistics.median(samples)


def compare(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeat: int = 15,
    number: int = 1,
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each function, sampled in interleaved rounds.

    Every round takes one sample (``number`` calls) of each function in turn, so slow
    phases of a noisy machine hit all of them alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeat):
            names = list(fns) if r % 2 == 0 else list(reversed(fns))  # alternate order
            for name in names:
                samples[name].append(_sample(fns[name], number))
    finally:
        if gc_was:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def blocks(
    fns: Mapping[str, Callable[[], object]],
    *,
    calls: int = 20,
    rounds: int = 7,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds per call of each function, timed as a sampler calls it: blocks of
    ``calls`` back-to-back calls of one function, the functions' blocks alternating (in
    reversed order every other round), ``rounds`` blocks each.  Each block's mean per call
    is one sample; the result is the median over blocks."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            names = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in names:
                samples[name].append(_sample(fns[name], calls))
    finally:
        if gc_was:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if abs(seconds) < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


# ----------------------------------------------------------------------------- BLAS


@contextlib.contextmanager
def limit_blas(n: int = 1) -> Iterator[None]:
    """Limit BLAS (and OpenMP) thread pools of this process to ``n`` threads."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n):
        yield


def blas_threads() -> list[int]:
    """Thread counts of the BLAS libraries loaded in this process."""
    from threadpoolctl import threadpool_info

    return sorted({d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"})


def _limit_blas_in_worker(n: int = 1) -> list[int]:
    """Run on a worker: limit its BLAS pools for good and report the thread counts."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n)  # not used as a context: stays in force in the worker
    return blas_threads()


# ----------------------------------------------------------------------------- clusters


@contextlib.contextmanager
def local_cluster(
    n_workers: int, threads_per_worker: int = 1, env: Mapping[str, str] | None = None, **kwargs
):
    """A ``LocalCluster`` on 127.0.0.1 with single-threaded BLAS in its workers.

    ``env``: more environment variables for the worker processes (added to, or
    overriding, the single-threaded BLAS ones).  Yields a ``Client`` (not set as the
    default client); cluster and client are always closed on exit.
    """
    extra_env = dict(env or {})
    import dask
    from distributed import Client, LocalCluster

    env = dict(SINGLE_THREAD_ENV)
    # the same PyTensor 2.38 BLAS warning as in quiet(), once per worker otherwise
    env["PYTHONWARNINGS"] = "ignore:PyTensor could not link to a BLAS"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p)
    env.update(extra_env)
    kwargs.setdefault("processes", True)
    kwargs.setdefault("dashboard_address", None)  # no dashboard...
    # ...but the scheduler still serves its HTTP routes (health, metrics), by default on
    # port 8787, which another cluster on this shared machine may hold: use any free port
    kwargs.setdefault("scheduler_kwargs", {"dashboard": False, "dashboard_address": "127.0.0.1:0"})
    kwargs.setdefault("silence_logs", logging.ERROR)
    # pre-spawn: set before the worker interpreter starts, so BLAS reads it at load time
    with dask.config.set({"distributed.nanny.pre-spawn-environ": env}):
        cluster = LocalCluster(
            host="127.0.0.1",
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            env=env,
            **kwargs,
        )
    try:
        client = Client(cluster, set_as_default=False)
        try:
            client.wait_for_workers(n_workers, timeout=60)
            client.run(_limit_blas_in_worker, 1)
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def worker_blas_threads(client) -> dict[str, list[int]]:
    return client.run(blas_threads)


# ----------------------------------------------------------------------------- reporting


@dataclass
class Row:
    """One line of the summary table."""

    benchmark: str
    metric: str
    measured: float
    target: float | None = None
    higher_is_better: bool = False
    unit: str = ""

    @property
    def met(self) -> str:
        if self.target is None:
            return "-"
        ok = (
            self.measured >= self.target if self.higher_is_better else self.measured <= self.target
        )
        return "yes" if ok else "NO"

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "(info)"
        return f"{'>=' if self.higher_is_better else '<='} {self.target:g}{self.unit}"

    @property
    def measured_text(self) -> str:
        if self.unit == "s":
            return fmt_time(self.measured)
        if float(self.measured).is_integer() and abs(self.measured) < 1e6:
            return f"{int(self.measured)}{self.unit}"
        return f"{self.measured:.3f}{self.unit}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """Print a plain aligned text table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
        for i, h in enumerate(headers)
    ]
    if title:
        print(f"\n{title}")
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def print_ratio_table(
    times: Mapping[str, float], baseline: str, title: str = "", ratio_name: str = "ratio"
) -> None:
    """Median times of several variants and each one's ratio to ``baseline``."""
    base = times[baseline]
    rows = [(name, fmt_time(t), f"{t / base:.3f}") for name, t in times.items()]
    print_table(["variant", "median", f"{ratio_name} (/ {baseline})"], rows, title)


def print_rows(rows: Sequence[Row], title: str = "") -> None:
    print_table(
        ["benchmark", "metric", "measured", "target", "met?"],
        [(r.benchmark, r.metric, r.measured_text, r.target_text, r.met) for r in rows],
        title,
    )


def load_average() -> float:
    """The machine's 1-minute load average (other processes compete for the 2 cores)."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Unix
        return float("nan")


def load_row(benchmark: str) -> Row:
    """An information row with the current load average, to read the timings against."""
    return Row(benchmark, f"load avg 1 min ({os.cpu_count()} cores)", round(load_average(), 2))


def versions_line() -> str:
    import dask
    import numpy
    import pytensor

    try:
        from importlib.metadata import version

        pymc = version("pymc")
    except Exception:  # pragma: no cover
        pymc = "?"
    return (
        f"load avg {load_average():.2f} on {os.cpu_count()} cores; "
        f"python {sys.version.split()[0]}, pytensor {pytensor.__version__}, pymc {pymc}, "
        f"dask {dask.__version__}, numpy {numpy.__version__}, "
        f"linker {type(__import__('pytensor').compile.mode.get_mode('FAST_RUN').linker).__name__}"
    )


# ----------------------------------------------------------------------------- results

#: where ``save_results`` writes: one folder per supported line (``python3.12``, ...)
RESULTS = os.path.join(HERE, "results")
#: the 1-minute load average when this module was imported (the benchmark's start)
_LOAD_AT_START = load_average()


def line_name() -> str:
    """The supported line this interpreter belongs to, by its Python: ``python3.12``."""
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    import platform

    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def machine(load_before: float | None = None) -> dict[str, object]:
    """The machine a benchmark ran on: CPU model, logical cores, memory, OS and kernel,
    and the 1-minute load average before the benchmark and now (after it)."""
    import platform

    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "load_avg_1min_before": round(_LOAD_AT_START if load_before is None else load_before, 2),
        "load_avg_1min_after": round(load_average(), 2),
    }


def versions() -> dict[str, str]:
    """Versions of Python and the packages the figures depend on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for package in ("dasktensor", "pymc", "pytensor", "dask", "distributed", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:  # pragma: no cover
            found[package] = "not installed"
    return found


def _options_slug(argv: Sequence[str]) -> str:
    """File-name part of a run's non-default options: ``--rows 1000`` -> ``rows-1000``."""
    text = "-".join(a.lstrip("-") for a in argv)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def result_path(name: str, argv: Sequence[str] = (), line: str | None = None) -> str:
    """The file of benchmark ``name``'s results on ``line`` (this interpreter's by
    default): ``results/python3.12/p1-latency.json`` for a run with the default options,
    ``results/python3.12/p1-latency--rows-1000.json`` for ``--rows 1000``, so that a run
    with other options never replaces the default run's file, which the docs show."""
    stem = name + (f"--{_options_slug(argv)}" if argv else "")
    return os.path.join(RESULTS, line or line_name(), stem + ".json")


def save_results(
    name: str,
    rows: Sequence[Row],
    argv: Sequence[str] | None = None,
    *,
    command: str | None = None,
    load_before: float | None = None,
) -> str | None:
    """Write a benchmark's rows, the command, the machine and the versions to its result
    file (:func:`result_path`) and return the file's path.

    ``argv``: the options the benchmark ran with (default: this process's, less
    ``--no-save``); a run with options is saved apart from the default run.  Nothing is
    written when the environment variable ``DASKTENSOR_BENCH_NO_SAVE`` is ``1``.
    """
    import datetime
    import json

    if os.environ.get("DASKTENSOR_BENCH_NO_SAVE", "") == "1":
        return None
    if argv is None:
        argv = [a for a in sys.argv[1:] if a != "--no-save"]
    argv = list(argv)
    if command is None:
        script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(HERE))
        command = " ".join(["python", script, *sys.argv[1:]])
    record = {
        "benchmark": name,
        "command": command,
        "options": argv,
        "default_options": not argv,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "line": line_name(),
        "machine": machine(load_before),
        "versions": versions(),
        "rows": [
            {
                "benchmark": r.benchmark,
                "metric": r.metric,
                "measured": r.measured if r.measured == r.measured else None,  # NaN: null
                "unit": r.unit,
                "target": r.target,
                "higher_is_better": r.higher_is_better,
                "met": r.met,
                "measured_text": r.measured_text,
                "target_text": r.target_text,
            }
            for r in rows
        ],
    }
    path = result_path(name, argv)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"[{name}] results saved to {os.path.relpath(path, os.path.dirname(HERE))}", flush=True)
    return path
