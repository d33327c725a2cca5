"""P18: adaptive scaling on remote-model calls: ``dt.Adaptive`` against Dask's own ``Adaptive``.

Calls through the channel skip the scheduler, so Dask's ``Adaptive`` sees no tasks and
keeps a cluster busy answering samplers at its minimum.  ``dt.Adaptive`` adds the
channel's demand (the most calls in flight over the last 5 s, per replica's
``concurrency``), as the scheduler's channel monitor measures it, to Dask's target.

Both run side by side in one run, each on a fresh ``LocalCluster`` of 1 worker process
(1 thread), Dask's own first:

* ``cluster.adapt(Adaptive=..., minimum=1, maximum=4)``, with Dask's default interval
  (1 s) and ``wait_count`` (3): what users get;
* a "50 ms model": a ``RemoteModel`` of :class:`_ops.SlowCall` (a replica on every
  worker, ``replicas`` unlimited, ``concurrency=1``) whose method sleeps 0.05 s and
  returns the answering worker's pid;
* 8 threads call it back to back for 25 s.  Every 0.5 s the scheduler's worker count is
  recorded; every call's completion time (and answering worker) too.

Reported: the time to >= 3 workers (target <= 15 s; Dask's own: never), the calls/s in
the first 2 s and in the last 5 s of the 25 and their ratio (target >= 2.5x; one worker
serves 20 calls/s, four serve 80), then, with the calls stopped, the seconds until one
worker is left (target <= 60 s, the wait capped at 90 s) and the calls that raised to
their callers (target 0), and a last call after the scale-down.  A per-second timeline
(workers, calls answered, workers answering) is printed for both.

Run: ``python benchmarks/bench_p18_adaptive.py``
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    HERE,
    SINGLE_THREAD_ENV,
    Row,
    load_row,
    local_cluster,
    print_rows,
    print_table,
    quiet,
    versions_line,
)

NAME = "p18-adaptive"
THREADS = 8
SECONDS = 25.0  # of calls
MODEL_SECONDS = 0.05
MINIMUM, MAXIMUM = 1, 4
SAMPLE = 0.5  # seconds between two looks at the worker count
DOWN_CAP = 90.0  # seconds waited for the cluster to come back to MINIMUM workers
FIRST, LAST = 2.0, 5.0  # the spans whose calls/s are compared


def _workers(cluster) -> int:
    """Workers the scheduler has (connected, not yet removed)."""
    return len(cluster.scheduler.workers)


def run(adaptive_cls, label: str) -> dict:
    """One variant on a fresh cluster of 1 worker: the calls, the worker counts, the
    scale-down after the calls stop."""
    import functools

    import dask
    import numpy as np
    from _ops import SlowCall

    import dasktensor as dt

    env = dict(SINGLE_THREAD_ENV, PYTHONWARNINGS="ignore:PyTensor could not link to a BLAS")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p)
    # workers started by adapt read the pre-spawn environment when they start: keep it set
    # for the cluster's whole life (local_cluster sets it while it starts the first one)
    with (
        dask.config.set({"distributed.nanny.pre-spawn-environ": env}),
        local_cluster(n_workers=1, threads_per_worker=1) as client,
    ):
        cluster = client.cluster
        model = dt.RemoteModel(
            functools.partial(SlowCall, MODEL_SECONDS), name="fifty-ms", scheduler=client
        )  # replicas on every worker (also those that join), concurrency 1
        model.start()
        x = np.zeros(2)
        for _ in range(3):
            model.call("work", x)

        answered: list[tuple[float, int]] = []  # (seconds since t0, pid)
        failures: list[tuple[float, str]] = []
        stop = threading.Event()

        def caller():
            while not stop.is_set():
                try:
                    pid = model.call("work", x)
                    answered.append((time.perf_counter() - t0, pid))
                except Exception as e:  # noqa: BLE001 (a call that raised to its caller)
                    failures.append((time.perf_counter() - t0, f"{type(e).__name__}: {e}"))
                    time.sleep(MODEL_SECONDS)

        adaptive = cluster.adapt(Adaptive=adaptive_cls, minimum=MINIMUM, maximum=MAXIMUM)
        threads = [threading.Thread(target=caller, name=f"caller-{i}") for i in range(THREADS)]
        t0_wall = time.time()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        counts: list[tuple[float, int]] = []  # (seconds since t0, workers)
        try:
            k = 0
            while (now := time.perf_counter() - t0) < SECONDS:
                counts.append((now, _workers(cluster)))
                k += 1
                time.sleep(max(0.0, k * SAMPLE - (time.perf_counter() - t0)))
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        stopped = time.perf_counter() - t0
        # the calls stopped: how long until the cluster is back to MINIMUM workers
        down = math.inf
        k = 0
        while True:
            now = time.perf_counter() - t0
            n = _workers(cluster)
            counts.append((now, n))
            if n <= MINIMUM:
                down = now - stopped
                break
            if now - stopped > DOWN_CAP:
                break
            k += 1
            time.sleep(max(0.0, stopped + k * SAMPLE - (time.perf_counter() - t0)))
        # one more call: the model still answers after the scale-down
        try:
            model.call("work", x)
            last_call = 1
        except Exception as e:  # noqa: BLE001 (counted, reported)
            failures.append((time.perf_counter() - t0, f"after scale-down: {e!r}"))
            last_call = 0
        log = [(t - t0_wall, dict(r)) for t, r in list(adaptive.log)]
        adaptive.stop()
        model.close()
        logs = [
            (level, msg)
            for level, msg in client.get_scheduler_logs(n=500)
            if level in ("WARNING", "ERROR", "CRITICAL")
        ]

    up = next((t for t, n in counts if n >= 3), math.inf)
    first = sum(1 for t, _ in answered if t < FIRST) / FIRST
    last = sum(1 for t, _ in answered if SECONDS - LAST <= t < SECONDS) / LAST
    return {
        "label": label,
        "counts": counts,
        "answered": answered,
        "failures": failures,
        "stopped": stopped,
        "up": up,
        "first": first,
        "last": last,
        "ratio": last / first if first else math.nan,
        "down": down,
        "last_call": last_call,
        "log": log,
        "scheduler_warnings": logs,
        "max_workers": max(n for _, n in counts),
    }


def print_timeline(result: dict) -> None:
    """Per second: the workers (most seen in it), calls answered, workers answering."""
    counts, answered = result["counts"], result["answered"]
    end = math.ceil(max(t for t, _ in counts))
    rows = []
    for s in range(end):
        workers = [n for t, n in counts if s <= t < s + 1]
        calls = [pid for t, pid in answered if s <= t < s + 1]
        phase = "calling" if s < result["stopped"] else "stopped"
        rows.append(
            (f"{s}-{s + 1}", phase, max(workers) if workers else "", len(calls), len(set(calls)))
        )
    print_table(
        ["second", "phase", "workers", "calls answered", "workers answering"],
        rows,
        title=f"[{NAME}] {result['label']}: timeline",
    )
    if result["log"]:
        changes = []
        for t, r in result["log"]:
            text = r.get("status", "?") + (f" {r['n']}" if "n" in r else "")
            if "workers" in r:
                text += f" ({len(r['workers'])} workers)"
            changes.append(f"{t:.1f}s {text}")
        print(f"adaptive log: {'; '.join(changes)}")
    else:
        print("adaptive log: (no change recommended)")
    per_pid = Counter(pid for _, pid in result["answered"])
    print(f"calls per worker process: {dict(per_pid)}")
    if result["failures"]:
        print(f"failed calls ({len(result['failures'])}), first ones:")
        for t, text in result["failures"][:5]:
            print(f"  {t:.1f}s {text}")
    for level, msg in result["scheduler_warnings"][:10]:
        print(f"scheduler log {level}: {msg[:300]}")
    sys.stdout.flush()


def main() -> list[Row]:
    quiet()
    from distributed.deploy import Adaptive as DaskAdaptive

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    results = []
    for cls, label in [(DaskAdaptive, "Dask's Adaptive"), (dt.Adaptive, "dt.Adaptive")]:
        t = time.perf_counter()
        result = run(cls, label)
        print(f"[{NAME}] {label}: {time.perf_counter() - t:.0f} s on its cluster")
        print_timeline(result)
        results.append(result)

    def text(seconds):
        return "never" if math.isinf(seconds) else f"{seconds:.1f} s"

    print_table(
        ["adaptive", "to >= 3 workers", "most workers", f"calls/s first {FIRST:g} s",
         f"calls/s last {LAST:g} s", "ratio", "back to 1 worker", "failed calls",
         "call after"],
        [
            (r["label"], text(r["up"]), r["max_workers"], f"{r['first']:.1f}",
             f"{r['last']:.1f}", f"{r['ratio']:.2f}", text(r["down"]), len(r["failures"]),
             "answered" if r["last_call"] else "FAILED")
            for r in results
        ],
        title=f"[{NAME}] {THREADS} threads x {SECONDS:g} s calling a {MODEL_SECONDS * 1e3:g} ms "
        f"model, adapt(minimum={MINIMUM}, maximum={MAXIMUM})",
    )  # fmt: skip
    dask_r, ours = results
    rows += [
        Row(NAME, "Dask's Adaptive: time to >= 3 workers (inf: never)", dask_r["up"], unit="s"),
        Row(NAME, "Dask's Adaptive: most workers", dask_r["max_workers"]),
        Row(NAME, "Dask's Adaptive: calls/s last 5 s / first 2 s", dask_r["ratio"]),
        Row(NAME, "Dask's Adaptive: failed calls", len(dask_r["failures"])),
        Row(NAME, "dt.Adaptive: time to >= 3 workers (inf: never)", ours["up"], 15, unit="s"),
        Row(NAME, "dt.Adaptive: most workers", ours["max_workers"]),
        Row(NAME, "dt.Adaptive: calls/s first 2 s", ours["first"]),
        Row(NAME, "dt.Adaptive: calls/s last 5 s", ours["last"]),
        Row(NAME, "dt.Adaptive: calls/s last 5 s / first 2 s", ours["ratio"], 2.5, True),
        Row(
            NAME, "dt.Adaptive: calls stopped -> 1 worker (inf: >90 s)", ours["down"], 60, unit="s"
        ),
        Row(NAME, "dt.Adaptive: failed calls", len(ours["failures"]), 0),
        Row(NAME, "dt.Adaptive: call after scale-down answered (1/0)", ours["last_call"], 1, True),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
