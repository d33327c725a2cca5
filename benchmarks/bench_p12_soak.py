"""P12 soak: 10^5 remote calls from 2 sampler processes x 4 threads to 4 models on 4 workers.

Four ``RemoteModel``s (``_ops.Normal`` without delay: a 10-dimensional standard normal's
logp and gradient), each replicated on the 4 worker processes of a ``LocalCluster``; two
*sampler* processes (spawned, as ``pm.sample(cores=2, mp_ctx="spawn")`` spawns its chains),
each with 4 threads, call them in turn (``model.call("logp_grad", x)``), checking every
answer: ``--warmup`` (10^5) calls, then ``--calls`` (10^5) measured ones.  After the
warm-up and at the end every process reports its resident memory (VmRSS) and its open
sockets: the samplers themselves and, through ``client.run``, the workers.  The warm-up
is long enough to fill what is bounded on purpose: the connection pools (a connection per
thread and worker at most) and each worker's call log for the dashboard (the last 20,000
calls, ~4 MiB; 25,000 calls reach each worker in the warm-up).

Targets: no error; RSS growth after warm-up <= 5 % in every process; the open sockets at
the end those after warm-up (connections are pooled, not leaked).

Run: ``python benchmarks/bench_p12_soak.py [--calls N]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, print_table, quiet, versions_line

NAME = "p12-soak"
WORKERS = 4
MODELS = 4
PROCESSES = 2
THREADS = 4


def vitals(dask_worker=None) -> tuple[int, int]:
    """This process's resident memory (bytes) and open sockets."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return rss, sockets


def sampler(models, warmup: int, calls: int, report, go, leave) -> None:
    """A sampler process: ``THREADS`` threads, ``calls`` calls in all; reports its
    vitals after warm-up (then waits for ``go``) and at the end (then waits for
    ``leave``: its connections stay open while the workers are measured), and its
    errors."""
    import numpy as np

    x = np.linspace(-1.0, 1.0, 10)
    want = -0.5 * float(x @ x)
    errors: list[str] = []
    each, first = calls // THREADS, warmup // THREADS
    warm = threading.Barrier(THREADS + 1)
    done_warming = threading.Event()

    def work(t: int) -> None:
        for i in range(first + each):
            if i == first:
                warm.wait()
                done_warming.wait()
            try:
                logp, grad = models[(t + i) % len(models)].call("logp_grad", x)
                if logp != want or not np.array_equal(grad, -x):
                    errors.append(f"wrong answer {logp}")
            except Exception as e:  # counted, reported
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    warm.wait()  # every thread has made its warm-up calls
    report.put(("warm", os.getpid(), vitals()))
    go.wait()  # every process is warm, and the workers were measured
    done_warming.set()
    for t in threads:
        t.join()
    report.put(("end", os.getpid(), vitals()))
    report.put(("errors", os.getpid(), errors[:5] + [f"... {len(errors)} in all"] * bool(errors)))
    leave.wait()


def main(calls: int = 100_000, warmup: int = 100_000) -> list[Row]:
    quiet()
    import functools

    from _ops import Normal

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    context = multiprocessing.get_context("spawn")
    with local_cluster(n_workers=WORKERS) as client:
        models = [
            dt.RemoteModel(
                functools.partial(Normal, 0.0), name=f"normal-{chr(97 + k)}", scheduler=client
            )
            for k in range(MODELS)
        ]
        for m in models:
            m.start()
        report, go, leave = context.Queue(), context.Event(), context.Event()
        procs = [
            context.Process(
                target=sampler,
                args=(models, warmup // PROCESSES, calls // PROCESSES, report, go, leave),
            )
            for _ in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        seen: dict = {}

        def collect(kind: str) -> None:
            while sum(k == kind for k, _ in seen) < PROCESSES:
                got, pid, value = report.get(timeout=1800)
                seen[(got, pid)] = value

        collect("warm")
        warm_workers = client.run(vitals)
        t0 = time.perf_counter()
        go.set()
        collect("end")
        took = time.perf_counter() - t0
        collect("errors")
        end_workers = client.run(vitals)
        leave.set()
        for p in procs:
            p.join()
        for m in models:
            m.close()

    errors = [e for (kind, _), v in seen.items() if kind == "errors" for e in v]
    lines, growth, sockets_changed = [], [], 0
    for (_kind, pid), (rss, socks) in sorted((k, v) for k, v in seen.items() if k[0] == "warm"):
        end_rss, end_socks = seen[("end", pid)]
        growth.append(end_rss / rss - 1)
        sockets_changed += end_socks != socks
        lines.append((f"sampler {pid}", f"{rss / 2**20:.1f}", f"{end_rss / 2**20:.1f}",
                      f"{100 * growth[-1]:+.2f} %", socks, end_socks))  # fmt: skip
    for address, (rss, socks) in sorted(warm_workers.items()):
        end_rss, end_socks = end_workers[address]
        growth.append(end_rss / rss - 1)
        sockets_changed += end_socks != socks
        lines.append((f"worker {address.rsplit(':', 1)[1]}", f"{rss / 2**20:.1f}",
                      f"{end_rss / 2**20:.1f}", f"{100 * growth[-1]:+.2f} %", socks,
                      end_socks))  # fmt: skip
    print_table(
        ["process", "RSS warm MiB", "RSS end MiB", "growth", "sockets warm", "sockets end"],
        lines,
        title=f"[{NAME}] {warmup:,} calls to warm up, then {calls:,} in {took:.1f} s "
        f"({calls / took:,.0f} calls/s)",
    )
    if errors:
        print(f"[{NAME}] errors: {errors}")
    rows = [
        Row(NAME, "errors", len(errors), 0),
        Row(NAME, "largest RSS growth after warm-up (%)", 100 * max(growth), 5),
        Row(NAME, "processes whose open sockets changed", sockets_changed, 0),
        Row(NAME, "calls per second after warm-up", calls / took),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls measured")
    parser.add_argument("--warmup", type=int, default=100_000, help="calls before")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(args.calls, args.warmup)
    if not args.no_save:
        save_results(NAME, rows)
