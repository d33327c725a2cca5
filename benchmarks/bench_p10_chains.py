"""P10: chains on one machine, ``pm.sample(cores=N)`` against ``dt.sample`` on N workers.

Most people first try ``dt.sample`` on the one machine they have, where it must not lose
to PyMC's own multiprocessing.  A logistic regression (``--rows`` x 20 features, default
20,000), ``--chains`` chains (4) x (300 tune + 300 draws), the same seed everywhere:

* ``pm.sample(chains=C, cores=N)``: PyMC's own processes on this host (forked on Linux);
* ``dt.sample(chains=C)`` on a ``LocalCluster`` of ``--workers`` N (2) worker processes x
  1 thread, started in the same process (its start is printed as "connect", and not
  counted in the ratio: a notebook connects once).

Each variant runs in a **fresh process with empty compile caches** (a temporary PyTensor
``base_compiledir`` and ``NUMBA_CACHE_DIR``, inherited by its workers and by PyMC's
processes) and samples twice there: the first run is **cold**, the second, the same model
sampled again in the same process (on the same cluster), **warm**.  The variants alternate
in blocks (pm, dt, dt, pm, ...) and the medians are compared.  Also printed: dt.sample's
wall-time breakdown (connect, PyMC's setup, step method pickled and sent, compiled on the
workers, tuning, draws, gathering, conversion), and whether its draws equal pm.sample's.
Last, the CPU per leapfrog step of one NUTS step method unpickled in a plain process and
on a worker (``where_steps_run``): what running on a worker costs a chain.
On PyTensor 3 a step method compiled in the sampling process and one unpickled in another
can differ in the last bits (Numba's fast-math; see ``tests/_sample_models.py``): equality
is then checked to round-off.

Goals (2-core machine, 4 chains on 2 workers): pm / dt >= 1.0 warm and >= 0.9 cold.
The CPU seconds each variant used (its processes, the cluster's workers) are printed too:
on a machine other jobs load, they show what a run costs where wall times wander.

``--quiet-dask`` starts dt.sample's cluster with Dask's administrative intervals
lengthened (``QUIET_DASK``: event-loop ticks, system and memory monitors, profiling off):
what Dask's own threads cost the run on a small machine, where they share its cores with
the chains.  PyMC's variant is unchanged.

``--fault`` adds the older P10 measurement: a worker SIGKILLed halfway through a run (the
faulty run's draws identical to the run without fault, its extra time about a segment
plus the worker's restart).

Run: ``python benchmarks/bench_p10_chains.py [--rounds N] [--chains C] [--workers N]
[--rows R] [--draws N] [--tune N] [--quiet-dask] [--fault]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    SINGLE_THREAD_ENV,
    Row,
    load_row,
    local_cluster,
    print_rows,
    quiet,
    versions_line,
)

NAME = "p10-chains"
CHAINS = 8
SEED = 20261202


def model(groups: int = 50, per_group: int = 200):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(SEED)
    effects = rng.normal(size=groups)
    y = effects[:, None] + rng.normal(size=(groups, per_group))
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfNormal("tau", 2)
        z = pm.Normal("z", 0, 1, shape=(groups, 1))
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", mu + tau * z, sigma, observed=y)
    return m


def same_draws(a, b) -> bool:
    import numpy as np

    pa, pb = _posterior(a), _posterior(b)
    return all(np.array_equal(pa[v].values, pb[v].values) for v in ("mu", "tau", "z", "sigma"))


def _posterior(result):
    return result["posterior"].to_dataset() if hasattr(result, "children") else result.posterior


COLD_AND_WARM = ("cold", "warm")


def regression(rows: int = 20_000, features: int = 20):
    """A logistic regression: ``rows`` observations of ``features`` predictors."""
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(SEED)
    X = rng.normal(size=(rows, features))
    beta = rng.normal(scale=0.5, size=features)
    y = rng.binomial(1, 1 / (1 + np.exp(-(X @ beta))))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 2)
        b = pm.Normal("b", 0, 1, shape=features)
        pm.Bernoulli("y", logit_p=b0 + pm.math.dot(X, b), observed=y)
    return m


#: ``--quiet-dask``: Dask's administrative intervals lengthened in dt.sample's cluster (the
#: defaults: tick 20 ms, system monitor 500 ms, memory monitor 100 ms, profiling on)
QUIET_DASK = {
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.worker.profile.enabled": False,
}


def child(variant: str, out: str, chains: int, workers: int, rows: int, draws: int,
          tune: int, quiet_dask: bool = False) -> None:  # fmt: skip
    """In a fresh process: sample twice (cold, then warm); write times, breakdowns, draws."""
    import json

    import numpy as np

    quiet()
    import pymc as pm

    import dasktensor as dt
    from dasktensor.sampling import last_breakdown

    run = dict(draws=draws, tune=tune, chains=chains, random_seed=SEED, progressbar=False,
               compute_convergence_checks=False)  # fmt: skip
    record: dict = {"variant": variant}
    m = regression(rows)
    with contextlib.ExitStack() as stack:
        client = None
        if variant == "dt" and quiet_dask:  # the nannies pass it on to their workers
            import dask

            stack.enter_context(dask.config.set(QUIET_DASK))
        if variant == "dt":
            t0 = time.perf_counter()
            client = stack.enter_context(local_cluster(n_workers=workers))
            record["connect"] = time.perf_counter() - t0
        for case in COLD_AND_WARM:
            cpu, caller = _cpu_seconds(client), _cpu_seconds()
            threads = _threads_split(client) if client is not None else None
            t0 = time.perf_counter()
            with m:
                if variant == "pm":
                    result = pm.sample(**run, cores=workers)
                else:
                    result = dt.sample(**run, client=client)
            record[case] = time.perf_counter() - t0
            record[f"{case}-cpu"] = _cpu_seconds(client) - cpu
            if client is not None:
                record[f"{case}-cpu-caller"] = _cpu_seconds() - caller
                after = _threads_split(client)
                record[f"{case}-threads"] = {k: after[k] - threads.get(k, 0.0) for k in after}
            if variant == "dt":
                b = last_breakdown()
                record[f"{case}-breakdown"] = {
                    "phases": b.phases, "compile": max(b.compile.values(), default=0.0),
                    "gathering": b.gathering, "segments": b.segments,
                    "utilisation": b.utilisation, "table": b.table(),
                }  # fmt: skip
        posterior = _posterior(result)
        np.savez(out + ".npz", **{v: posterior[v].values for v in ("b0", "b")})
    with open(out, "w") as f:
        json.dump(record, f)


def _cpu_seconds(client=None) -> float:
    """CPU seconds used so far by this process and its waited-for children (PyMC's
    chain processes), and by the cluster's workers: what a run costs whatever else
    loads the machine (the LocalCluster's scheduler runs in this process)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    if client is not None:
        total += sum(client.run(_process_cpu).values())
    return total


#: where dt.sample's CPU went, by thread (see _threads_split)
THREAD_KINDS = (
    ("sampling", "workers' task threads (segments: sampling, unpickling)"),
    ("worker-other", "workers' other threads (event loop, Dask's profiler and monitors)"),
    ("caller-loop", "caller's event loop (scheduler, nannies, client)"),
    ("caller-main", "caller's main thread (PyMC's setup, recording draws)"),
)


def _threads_split(client) -> dict[str, float]:
    """CPU seconds so far of the threads of the workers and of this process, summed by
    kind (``THREAD_KINDS``): a Dask worker's task threads are named
    ``<n>-Dask-Default-Threads-...``, the event loop of a ``LocalCluster`` started here
    (its scheduler, nannies and this client) "IO loop".  Threads that ended are not
    counted."""
    split = dict.fromkeys([k for k, _ in THREAD_KINDS], 0.0)
    for threads in client.run(_thread_cpu).values():
        for name, seconds in threads.items():
            split["sampling" if "Dask-Default-Threads" in name else "worker-other"] += seconds
    mine = _thread_cpu()
    split["caller-loop"] = mine.get("IO loop", 0.0)
    split["caller-main"] = mine.get("MainThread", 0.0)
    return split


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, by thread name."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    seconds: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "unnamed")
        seconds[name] = seconds.get(name, 0.0) + t.user_time + t.system_time
    return seconds


def _process_cpu() -> float:
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def _spawn(variant: str, args, scratch: str) -> dict:
    """Run ``child(variant)`` in a fresh interpreter with empty compile caches."""
    import json
    import subprocess
    import tempfile

    caches = tempfile.mkdtemp(prefix=f"p10-{variant}-", dir=scratch)
    out = os.path.join(caches, "result.json")
    env = dict(os.environ, **SINGLE_THREAD_ENV)
    env["PYTENSOR_FLAGS"] = ",".join(
        f
        for f in [os.environ.get("PYTENSOR_FLAGS", ""), f"base_compiledir={caches}/pytensor"]
        if f
    )
    env["NUMBA_CACHE_DIR"] = os.path.join(caches, "numba")
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--out", out]
    for option in ("chains", "workers", "rows", "draws", "tune"):
        command += [f"--{option}", str(getattr(args, option))]
    if getattr(args, "quiet_dask", False):
        command.append("--quiet-dask")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {variant} process failed:\n{done.stderr[-4000:]}")
    with open(out) as f:
        record = json.load(f)
    record["draws-file"] = out + ".npz"
    return record


#: NUTS steps timed per measurement of where a step method runs (after 20 unrecorded)
LEAPFROG_STEPS = 150


def _leapfrog_cost(payload: bytes, point: dict, on_worker: bool = False) -> float:
    """Unpickle a NUTS step method and make ``LEAPFROG_STEPS`` steps from ``point`` (20
    first, unrecorded): the CPU microseconds of this thread per leapfrog step.  On a
    worker the profiler pauses as around a segment of ``dt.sample``."""
    import pickle
    import resource

    from dasktensor.sampling._segments import profiler_paused

    step = pickle.loads(payload)

    def steps(n: int) -> tuple[float, int]:
        nonlocal point
        leaps, r0 = 0, resource.getrusage(resource.RUSAGE_THREAD)
        for _ in range(n):
            point, stats = step.step(point)
            leaps += int(stats[0]["tree_size"])
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, leaps

    steps(20)
    with profiler_paused() if on_worker else contextlib.nullcontext():
        cpu, leaps = steps(LEAPFROG_STEPS)
    return cpu / leaps * 1e6


def _leapfrog_in_process(queue, payload: bytes, point: dict) -> None:
    queue.put(_leapfrog_cost(payload, point))


def where_steps_run(rows: int, rounds: int = 3) -> list[Row]:
    """The same NUTS step method (the regression's, pickled as PyMC pickles it for its
    processes) unpickled in a spawned plain process and on a worker of a LocalCluster,
    in turn: CPU microseconds per leapfrog step, the same trajectory in both (the
    unpickled state is the same): what running on a worker costs a chain.  Both run
    with single-threaded BLAS: the CPU counted is the sampling thread's."""
    import multiprocessing as mp
    from unittest import mock

    import cloudpickle
    import pymc as pm

    m = regression(rows)
    with m:
        step = pm.NUTS()
        point = m.initial_point()
    payload = cloudpickle.dumps(step)
    ctx = mp.get_context("spawn")
    costs: dict[str, list[float]] = {"process": [], "worker": []}
    with local_cluster(n_workers=1) as client:
        for r in range(rounds):
            for where in ("process", "worker") if r % 2 == 0 else ("worker", "process"):
                if where == "worker":
                    future = client.submit(_leapfrog_cost, payload, point, True, pure=False)
                    costs[where].append(future.result())
                    continue
                queue = ctx.Queue()
                proc = ctx.Process(target=_leapfrog_in_process, args=(queue, payload, point))
                # single-threaded BLAS as on the workers (the thread's CPU is counted)
                with mock.patch.dict(os.environ, SINGLE_THREAD_ENV):
                    proc.start()
                costs[where].append(queue.get(timeout=600))
                proc.join()
    med = {k: statistics.median(v) for k, v in costs.items()}
    print(f"[{NAME}] one NUTS step method, CPU us per leapfrog step: plain process "
          f"{med['process']:.0f}, worker {med['worker']:.0f} ({rounds} rounds)")  # fmt: skip
    return [
        Row(NAME, "NUTS step, plain process: CPU us per leapfrog, median", round(med["process"])),
        Row(NAME, "NUTS step, worker: CPU us per leapfrog, median", round(med["worker"])),
        Row(NAME, "NUTS step: worker / plain process", round(med["worker"] / med["process"], 3)),
    ]


def compare(args) -> list[Row]:
    """Alternating blocks of fresh processes; medians of pm / dt, cold and warm."""
    import shutil
    import tempfile

    import numpy as np

    quiet()
    print(f"[{NAME}] {versions_line()}", flush=True)
    label = f"{args.chains} chains, {args.workers} workers, {args.rows} rows"
    scratch = tempfile.mkdtemp(prefix="p10-")
    records: dict[str, list[dict]] = {"pm": [], "dt": []}
    rows = [load_row(NAME)]
    try:
        for r in range(args.rounds):
            order = ("pm", "dt") if r % 2 == 0 else ("dt", "pm")
            for variant in order:
                record = _spawn(variant, args, scratch)
                records[variant].append(record)
                extra = f" (connect {record['connect']:.1f} s)" if variant == "dt" else ""
                print(f"[{NAME}] round {r}: {variant} cold {record['cold']:.1f} s "
                      f"({record['cold-cpu']:.0f} s CPU), warm {record['warm']:.1f} s "
                      f"({record['warm-cpu']:.0f} s CPU){extra}", flush=True)  # fmt: skip
            for case in COLD_AND_WARM:
                table = records["dt"][-1][f"{case}-breakdown"]["table"]
                print(table.replace("dt.sample:", f"[{NAME}] round {r} dt.sample {case}:"))
                split = records["dt"][-1][f"{case}-threads"]
                print(
                    f"[{NAME}] round {r} dt.sample {case}, CPU s by thread: "
                    + ", ".join(f"{label} {split[k]:.2f}" for k, label in THREAD_KINDS)
                )
        med = {(v, c): statistics.median(x[c] for x in records[v])
               for v in records for c in COLD_AND_WARM}  # fmt: skip
        ratios = {c: [p[c] / d[c] for p, d in zip(records["pm"], records["dt"])]
                  for c in COLD_AND_WARM}  # fmt: skip
        a = np.load(records["pm"][0]["draws-file"])
        b = np.load(records["dt"][0]["draws-file"])
        exact = all(np.array_equal(a[v], b[v]) for v in a.files)
        close = all(np.allclose(a[v], b[v], rtol=1e-6, atol=1e-8) for v in a.files)
        connect = statistics.median(x["connect"] for x in records["dt"])
        for case, goal in (("cold", 0.9), ("warm", 1.0)):
            rows += [
                Row(NAME, f"pm.sample(cores={args.workers}) {case} (s), median",
                    round(med["pm", case], 2)),
                Row(NAME, f"dt.sample, {args.workers} workers, {case} (s), median",
                    round(med["dt", case], 2)),
                Row(NAME, f"pm / dt {case}, median of {args.rounds} rounds ({label})",
                    round(statistics.median(ratios[case]), 3), goal, True),
            ]  # fmt: skip
        for case in COLD_AND_WARM:
            phases = {}
            for x in records["dt"]:
                for k, v in x[f"{case}-breakdown"]["phases"].items():
                    phases.setdefault(k, []).append(v)
            for k, v in phases.items():
                rows.append(
                    Row(NAME, f"dt {case}: {k} (s), median", round(statistics.median(v), 2))
                )
            rows.append(Row(NAME, f"dt {case}: step method usable on the workers (s), median",
                            round(statistics.median(x[f"{case}-breakdown"]["compile"]
                                                    for x in records["dt"]), 2)))  # fmt: skip
        for case in COLD_AND_WARM:
            rows += [
                Row(NAME, f"CPU seconds {case}, pm (its processes), median",
                    round(statistics.median(x[f"{case}-cpu"] for x in records["pm"]), 1)),
                Row(NAME, f"CPU seconds {case}, dt (caller, scheduler, workers), median",
                    round(statistics.median(x[f"{case}-cpu"] for x in records["dt"]), 1)),
                Row(NAME, f"CPU seconds {case}, dt's caller and scheduler alone, median",
                    round(statistics.median(x[f"{case}-cpu-caller"] for x in records["dt"]), 1)),
            ]  # fmt: skip
        for case in COLD_AND_WARM:
            rows += [
                Row(NAME, f"dt {case}: CPU s, {label}, median",
                    round(statistics.median(x[f"{case}-threads"][k] for x in records["dt"]), 2))
                for k, label in THREAD_KINDS
            ]  # fmt: skip
        rows += [
            Row(NAME, "connect: LocalCluster started (s), median, not in the ratio",
                round(connect, 2)),
            Row(NAME, "pm / dt cold, the cluster's start counted",
                round(med["pm", "cold"] / (med["dt", "cold"] + connect), 3)),
            Row(NAME, "draws identical to pm.sample's (1/0)", int(exact)),
            Row(NAME, "draws equal to pm.sample's to round-off (1/0)", int(close), 1, True),
        ]  # fmt: skip
        rows += where_steps_run(args.rows)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary ({args.rounds} rounds, {args.tune} + "
               f"{args.draws} draws, {label})")  # fmt: skip
    return rows


def main(rounds: int = 3, draws: int = 300, tune: int = 300, chains: int = 4, workers: int = 2,
         rows: int = 20_000, fault: bool = False) -> list[Row]:  # fmt: skip
    """The comparison (and with ``fault`` the run with a worker killed); for run_all."""
    args = argparse.Namespace(rounds=rounds, draws=draws, tune=tune, chains=chains,
                              workers=workers, rows=rows)  # fmt: skip
    out = compare(args)
    if fault:
        out += fault_run()
    return out


def fault_run(rounds: int = 1, draws: int = 500, tune: int = 500) -> list[Row]:
    """pm.sample(cores=2) and dt.sample of a hierarchical model, then dt.sample with a worker
    SIGKILLed halfway through."""
    import pymc as pm

    import dasktensor as dt
    from dasktensor import _config

    quiet()
    print(f"[{NAME}] {versions_line()}")
    run = dict(draws=draws, tune=tune, chains=CHAINS, random_seed=SEED, progressbar=False,
               compute_convergence_checks=False)  # fmt: skip
    times: dict[str, list[float]] = {"pm": [], "dt": []}
    rows = [load_row(NAME)]
    with local_cluster(n_workers=2) as client:
        m = model()
        results = {}
        for r in range(rounds):
            for name in ("pm", "dt"):
                t0 = time.perf_counter()
                with m:
                    if name == "pm":
                        results[name] = pm.sample(**run, cores=2)
                    else:
                        results[name] = dt.sample(**run, client=client)
                times[name].append(time.perf_counter() - t0)
                print(f"[{NAME}] round {r}: {name} {times[name][-1]:.1f} s", flush=True)
        t_pm, t_dt = statistics.median(times["pm"]), statistics.median(times["dt"])

        killed: list = []
        half = CHAINS * (draws + tune) // 2
        recorded = [0]

        def kill_halfway(trace, draw):
            recorded[0] += 1
            if killed or recorded[0] < half:
                return
            running = [pid for pid in client.run(_executing_segment).values() if pid]
            if running:  # a worker running a segment now (not one queued there)
                os.kill(running[0], signal.SIGKILL)
                killed.append(time.perf_counter())

        t0 = time.perf_counter()
        with m:
            faulty = dt.sample(**run, client=client, callback=kill_halfway)
        t_fault = time.perf_counter() - t0
        restart = _restart_time(client)
        segment = _config.seconds("sample.segment-seconds")
        when = f"{killed[0] - t0:.1f} s" if killed else "(no worker was busy)"
        print(f"[{NAME}] a worker killed at {when}: {t_fault:.1f} s")
        rows += [
            Row(NAME, "pm.sample(chains=8, cores=2) (s), median", round(t_pm, 2)),
            Row(NAME, "dt.sample(chains=8), 2 workers (s), median", round(t_dt, 2)),
            Row(NAME, "dt / pm wall time", t_dt / t_pm, 1.05),
            Row(NAME, "dt.sample with a worker SIGKILLed halfway (s)", round(t_fault, 2)),
            Row(
                NAME,
                "extra time of the fault (s)",
                round(t_fault - t_dt, 2),
                round(segment + restart, 2),
            ),  # fmt: skip
            Row(NAME, "segment length (s) + worker restart (s)", round(segment + restart, 2)),
            Row(NAME, "a worker was killed (1/0)", int(bool(killed)), 1, True),
            Row(
                NAME,
                "draws identical with and without the fault (1/0)",
                int(same_draws(faulty, results["dt"])),
                1,
                True,
            ),  # fmt: skip
            Row(
                NAME,
                "draws identical to pm.sample's, same seed (1/0)",
                int(same_draws(results["dt"], results["pm"])),
            ),  # fmt: skip
        ]
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary ({rounds} rounds, {tune} + {draws} draws)")
    return rows


def _executing_segment(dask_worker=None):
    """This worker's process id if it runs a chain's segment now, else None."""
    keys = [ts.key for ts in dask_worker.state.executing]
    return os.getpid() if any("chain_" in str(k) for k in keys) else None


def _restart_time(client) -> float:
    """Seconds from a worker's SIGKILL until its nanny's new worker has joined."""
    workers = client.run(os.getpid)
    address, pid = next(iter(workers.items()))
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while address in client.scheduler_info()["workers"] and time.perf_counter() - t0 < 30:
        time.sleep(0.01)
    client.wait_for_workers(len(workers), timeout=120)
    return time.perf_counter() - t0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--tune", type=int, default=300)
    parser.add_argument("--fault", action="store_true", help="also a worker killed mid-run")
    parser.add_argument("--quiet-dask", action="store_true", help="Dask's admin intervals longer")
    parser.add_argument("--child", choices=["pm", "dt"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out, args.chains, args.workers, args.rows, args.draws, args.tune,
              args.quiet_dask)  # fmt: skip
    else:
        rows = compare(args)
        if args.fault:
            rows += fault_run()
        if not args.no_save:
            from _common import save_results

            save_results(NAME, rows)
