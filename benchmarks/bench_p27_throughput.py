"""P27: calls/s through one replica, batched and one call at a time, from many callers.

A model served by one replica (one GPU) answers many callers: a sampler's chains, as
threads of one process or as processes.  What is its throughput, and how much of it
does ``@dt.batched`` buy when the model itself costs (nearly) nothing?

* **The channel's throughput**: ``_ops.RowSum``, a row sum, ``@batched(max_size=64)
  def rowsum(self, x): return x.sum(axis=1)`` on rows of 8, on the one worker of a
  ``LocalCluster``, against the same method with ``@batched(max_size=1)`` (every call
  alone).  Called by 1, 8 and 64 threads of this process and by 4 spawned processes x
  16 threads (each process connects its own ``distributed.Client``: the unpickled
  ``RemoteModel`` reconnects by the scheduler's address).  Beside them, one thread of a
  raw TCP echo (``_echo.py``) of the bytes of the same request, the floor of one call at
  a time.  Printed: calls/s, each against the echo's, and the batch sizes the replica
  saw (its call log, ``ModelHost.calls``: one record per batch; median and mean).
  Target: 64 threads get >= 4x the calls/s of one thread, batched (the batches must
  pay: one thread waits for each reply, 64 share the replica's batches).
* **The hand-off floor** of the same 64 threads, measured in every round beside the echo:
  each call handed to a thread of this process that sums the rows waiting and wakes
  their callers (``HandOff``), no sockets, no pickling, no worker.  It is the most
  calls/s any channel can give the threads of one CPython process (each call wakes its
  thread, which then waits for the GIL), so "hand-off floor / batched, 1 thread" is the
  most that 64 threads can gain over one on this machine.
* **GPU** (``--gpu``, or by itself when JAX sees a GPU): ``_ops.JaxMLP``, a JAX MLP
  surrogate (4 layers of 8,192 units on a GPU; batches padded to 1, 8 or 64 rows, the
  three shapes compiled when the replica is built) on a worker with ``resources={"GPU":
  1}``, 64 threads, ``forward`` (batched) against ``forward_alone`` (``max_size=1``).
  Target >= 10x on a GPU.  Beside it, the replica's own seconds for a batch of 64 and of
  1 (no call around them): the model's ceiling of calls/s.  Without a GPU it runs on
  JAX's CPU backend with 256 units, says so, and targets nothing.

Each configuration runs a fixed number of calls per thread (a block takes 1-2 s here);
the two variants alternate in blocks, reversed every other round, 3 rounds; calls/s
are medians over the blocks.  Every caller sends its own rows (distinct values) and
checks each result: the row sum exactly (integer-valued floats); the MLP's output
against the same row's ``forward_alone`` result, to round-off.

Run: ``python benchmarks/bench_p27_throughput.py`` (``--gpu`` for the GPU variant even
without a GPU; ``--width``, ``--layers``, ``--threads`` set its MLP and callers)
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, print_table, quiet, versions_line

NAME = "p27-throughput"
DIM = 8
ROUNDS = 3
#: calls per thread in a block, by configuration (a block takes ~1-2 s on 2 cores)
#: (at most 20,000 calls: the call log's length, read after each block)
CALLS = {"1 thread": 6_000, "8 threads": 1_000, "64 threads": 250, "4 procs x 16 threads": 250}
PROCS, PROC_THREADS = 4, 16
ECHO_CALLS = 20_000
VARIANTS = {"batched": "rowsum", "max_size=1": "rowsum_alone"}
# the GPU variant
GPU_VARIANTS = {"batched": "forward", "max_size=1": "forward_alone"}
GPU_CALLS = 40
GPU_NAMES = ("gpu", "cuda", "rocm")
JAX_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # not 75% of the GPU per process


def row(caller: int, k: int):
    """Caller ``caller``'s ``k``-th row: integer values (sums exact in any order), no two
    callers' rows alike (sum ``28 + 64 * caller + 8000 * k``)."""
    return np.arange(DIM, dtype=np.float64) + DIM * caller + 1000.0 * k


def rowsum_work(model, method: str):
    """``work(caller, k)`` calling the row sum; None if right, else what went wrong."""

    def work(i: int, k: int):
        x = row(i, k)
        got = model.call(method, x)
        return None if float(got) == float(x.sum()) else f"caller {i} call {k}: {got}"

    return work


class Callers:
    """``n`` threads, kept between blocks, that call at once: caller ``first + i`` on
    thread ``i``."""

    def __init__(self, n: int, first: int = 0):
        self.n, self.first = n, first
        self.pool = ThreadPoolExecutor(n)

    def run(self, work, calls: int) -> tuple[float, int, list]:
        """Wall seconds of every thread making ``calls`` calls ``work(caller, k)``, from
        when all are ready; the number of calls; the wrong results."""
        barrier = threading.Barrier(self.n + 1)

        def one(i):
            barrier.wait()  # each of the n threads takes one caller
            return [e for k in range(calls) if (e := work(i, k)) is not None]

        futures = [self.pool.submit(one, self.first + i) for i in range(self.n)]
        barrier.wait()
        t0 = time.perf_counter()
        wrong = [e for f in futures for e in f.result()]
        return time.perf_counter() - t0, self.n * calls, wrong

    def close(self) -> None:
        self.pool.shutdown()


def _child(conn, model, first: int, threads: int) -> None:
    """A caller process: ``threads`` threads calling ``model`` (pickled: it connects a
    client of its own to the scheduler) on the parent's ``(method, calls)``."""
    quiet()
    callers = Callers(threads, first)
    try:
        model.call("rowsum", row(first, 0))  # connect now, not in the first block
        conn.send("ready")
        while (job := conn.recv()) is not None:
            method, calls = job
            conn.send(callers.run(rowsum_work(model, method), calls))
    finally:
        callers.close()  # not model.close(): the parent's replica is not this copy's


class ProcessCallers:
    """``procs`` spawned processes of ``threads`` caller threads each (callers numbered
    after the in-process ones)."""

    def __init__(self, model, procs: int, threads: int, first: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for p in range(procs):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_child, args=(there, model, first + p * threads, threads), daemon=True
            )
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(120):
                raise TimeoutError("a caller process did not start within 120 s")
            assert conn.recv() == "ready"

    def run(self, method: str, calls: int) -> tuple[float, int, list]:
        t0 = time.perf_counter()
        for conn in self.conns:
            conn.send((method, calls))
        done = [conn.recv() for conn in self.conns]
        wall = time.perf_counter() - t0
        return wall, sum(d[1] for d in done), [e for d in done for e in d[2]]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


class HandOff:
    """The floor of any channel for threads of one process: the same callers (the same
    rows, the same check of each result), each call handed to a thread of this process
    that sums the rows waiting, in one go, and wakes their callers -- as the combiner's
    leader does, without the sockets, the pickling and the worker.  What is left is
    waking each caller and the GIL they share: the most calls/s that threads of one
    CPython process can get from a replica, however fast the channel."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queue: list = []
        self.ready = threading.Semaphore(0)
        self.closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def call(self, method: str, x):
        """``method`` is ignored: called as ``model.call`` is (``rowsum_work``)."""
        wake = threading.Lock()
        wake.acquire()
        box = [x, wake]
        with self.lock:
            self.queue.append(box)
        self.ready.release()
        wake.acquire()
        return box[0]

    def _serve(self) -> None:
        while not self.closed:
            self.ready.acquire()
            with self.lock:
                taken, self.queue = self.queue, []
            if taken:
                sums = np.stack([box[0] for box in taken]).sum(axis=1)
                for box, total in zip(taken, sums, strict=True):
                    box[0] = total
                    box[1].release()

    def close(self) -> None:
        self.closed = True
        self.ready.release()
        self.thread.join()


def _batch_sizes(name: str, method: str, since: float, dask_worker=None) -> list[int]:
    """On a worker: the sizes of the batches of ``name.method`` that ended after
    ``since`` (wall-clock seconds), from the call log of its models' host."""
    host = dask_worker.plugins.get("dasktensor-models")
    if host is None:
        return []
    records = host.calls.since(since)["records"]  # (model, method, start, stop, status, size)
    return [r[5] for r in records if r[0] == name and r[1] == method]


def batch_sizes(client, name: str, method: str, since: float) -> list[int]:
    return [s for sizes in client.run(_batch_sizes, name, method, since).values() for s in sizes]


def alternate(client, name, configs: dict, variants: dict, rounds: int, extra=None):
    """Blocks of each configuration and variant, the variants alternating (reversed every
    other round): ``configs`` maps a label to ``(run, calls)``, ``run(method, calls) ->
    (wall, calls, wrong)``; ``extra()``, if given, runs first in every round.  Calls/s
    and batch sizes by ``(config, variant)``, the wrong results, ``extra``'s results."""
    rates = {(c, v): [] for c in configs for v in variants}
    sizes = {(c, v): [] for c in configs for v in variants}
    wrong, extras, checked, logged = [], [], 0, 0
    for r in range(rounds):
        if extra is not None:
            extras.append(extra())
        for c, (run, calls) in configs.items():
            for v in list(variants) if r % 2 == 0 else list(reversed(variants)):
                since = time.time()
                wall, n, bad = run(variants[v], calls)
                rates[c, v].append(n / wall)
                seen = batch_sizes(client, name, variants[v], since)
                sizes[c, v] += seen
                logged += sum(seen)
                wrong += bad
                checked += n
    if logged != checked:  # the log keeps the last 20,000 records: blocks must be smaller
        print(f"[{NAME}] the call log saw {logged} of the {checked} calls")
    return rates, sizes, wrong, checked, extras


def _size_text(sizes: list[int]) -> tuple[str, str]:
    if not sizes:
        return "-", "-"
    return f"{statistics.median(sizes):g}", f"{statistics.mean(sizes):.1f}"


def request_bytes(key: str, method: str, x) -> bytes:
    """The bytes of a call's request (dasktensor's wire format; pickle if that changed)."""
    try:
        from dasktensor_worker import wire

        return b"".join(bytes(f) for f in wire.dumps((key, method, (x,))))
    except (ImportError, AttributeError, TypeError, ValueError):  # being reworked
        import pickle

        return pickle.dumps((key, method, (x,)), protocol=5)


# ----------------------------------------------------------------------------- CPU


def cpu_variant(rounds: int = ROUNDS) -> list[Row]:
    from _echo import echo_servers
    from _ops import RowSum

    import dasktensor as dt

    rows = []
    with local_cluster(n_workers=1) as client:
        model = dt.RemoteModel(RowSum, name="rowsum", replicas=1, scheduler=client)
        model.start()
        threads = {"1 thread": 1, "8 threads": 8, "64 threads": 64}
        pools = {c: Callers(n) for c, n in threads.items()}
        procs = ProcessCallers(model, PROCS, PROC_THREADS, first=64)
        payload = request_bytes(model._spec.key, "rowsum", row(0, 0))
        hand_off = HandOff()
        try:
            configs = {
                c: (lambda m, k, p=pools[c]: p.run(rowsum_work(model, m), k), CALLS[c])
                for c in threads
            }
            configs["4 procs x 16 threads"] = (procs.run, CALLS["4 procs x 16 threads"])
            with echo_servers() as (tcp_echo, _):
                for _ in range(200):
                    tcp_echo(payload)

                def floors() -> tuple[float, float]:
                    """A raw echo's calls/s (one thread) and the hand-off floor's (64)."""
                    t0 = time.perf_counter()
                    for _ in range(ECHO_CALLS):
                        tcp_echo(payload)
                    echo = ECHO_CALLS / (time.perf_counter() - t0)
                    wall, n, bad = pools["64 threads"].run(
                        rowsum_work(hand_off, "rowsum"), CALLS["64 threads"]
                    )
                    if bad:
                        raise AssertionError(f"the hand-off floor got {bad[:3]}")
                    return echo, n / wall

                # warm-up: every thread's connection open, every method's batcher made
                alternate(client, "rowsum", {c: (run, 3) for c, (run, _) in configs.items()},
                          VARIANTS, 1)  # fmt: skip
                t0 = time.perf_counter()
                rates, sizes, wrong, checked, extras = alternate(
                    client, "rowsum", configs, VARIANTS, rounds, extra=floors
                )
                took = time.perf_counter() - t0
        finally:
            hand_off.close()
            procs.close()
            for p in pools.values():
                p.close()
        model.close()

    if wrong:
        raise AssertionError(f"{len(wrong)} wrong results, e.g. {wrong[:3]}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    echo_rate = statistics.median(e for e, _ in extras)
    floor_rate = statistics.median(f for _, f in extras)
    table = [
        ("raw TCP echo", "1 thread", "-", f"{echo_rate:,.0f}", "1.000", "-", "-"),
        ("hand-off floor", "64 threads", CALLS["64 threads"], f"{floor_rate:,.0f}",
         f"{floor_rate / echo_rate:.3f}", "-", "-"),
    ]  # fmt: skip
    for (c, v), rate in med.items():
        per_thread = CALLS[c]
        table.append(
            (v, c, per_thread, f"{rate:,.0f}", f"{rate / echo_rate:.3f}", *_size_text(sizes[c, v]))
        )
    print_table(
        ["variant", "callers", "calls/thread", "calls/s", "/ echo", "batch median", "mean"],
        table,
        title=f"[{NAME}] one replica of a row sum, {rounds} rounds (medians; "
        f"{len(payload)}-byte request; {checked} results checked, all right; {took:.0f} s)",
    )
    rows.append(Row(NAME, "raw TCP echo, 1 thread (calls/s)", round(echo_rate)))
    rows.append(Row(NAME, "hand-off floor, 64 threads (calls/s)", round(floor_rate)))
    for (c, v), rate in med.items():
        rows.append(Row(NAME, f"{v}, {c} (calls/s)", round(rate)))
    for (c, v), rate in med.items():
        rows.append(Row(NAME, f"{v}, {c} / echo", rate / echo_rate))
    b, one = "batched", "max_size=1"
    for c in ("64 threads", "4 procs x 16 threads"):
        s = sizes[c, b]
        rows.append(Row(NAME, f"{b}, {c}: median batch", statistics.median(s) if s else 0))
        rows.append(Row(NAME, f"{b}, {c}: mean batch", statistics.mean(s) if s else 0))
    rows += [
        Row(
            NAME, "64 threads: batched / max_size=1", med["64 threads", b] / med["64 threads", one]
        ),
        Row(
            NAME,
            "4 procs x 16: batched / max_size=1",
            med["4 procs x 16 threads", b] / med["4 procs x 16 threads", one],
        ),
        Row(
            NAME,
            "batched: 64 threads / 1 thread",
            med["64 threads", b] / med["1 thread", b],
            4,
            True,
        ),
        Row(
            NAME,
            "hand-off floor, 64 threads / batched, 1 thread",
            floor_rate / med["1 thread", b],
        ),
        Row(NAME, "batched, 64 threads / hand-off floor", med["64 threads", b] / floor_rate),
        Row(
            NAME,
            "batched: 4 procs x 16 threads / 1 thread",
            med["4 procs x 16 threads", b] / med["1 thread", b],
        ),
        Row(NAME, "results checked (calls)", checked),
        Row(NAME, "wrong results", len(wrong), 0),
    ]
    return rows


# ----------------------------------------------------------------------------- GPU


def jax_backend() -> str | None:
    """JAX's default backend, asked in a new process (so that this one never holds a
    GPU); None without JAX."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("jax") is None:
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.default_backend())"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={**os.environ, **JAX_ENV},
        )
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.split()
    return lines[-1] if done.returncode == 0 and lines else None


def gpu_variant(
    width: int | None = None, layers: int = 4, threads: int = 64, rounds: int = ROUNDS
) -> list[Row]:
    """The JAX MLP on one replica (a GPU's if JAX sees one), ``threads`` callers,
    batched against ``max_size=1``."""
    from functools import partial

    from _ops import JaxMLP

    import dasktensor as dt

    on_gpu = jax_backend() in GPU_NAMES
    width = width or (8192 if on_gpu else 256)
    resources = {"GPU": 1} if on_gpu else None
    # (Dask's memory limit restarts a worker holding the CUDA libraries: PITFALLS)
    kwargs = {"resources": resources, "memory_limit": 0} if on_gpu else {}
    rows = []
    with local_cluster(n_workers=1, env=JAX_ENV, **kwargs) as client:
        model = dt.RemoteModel(
            partial(JaxMLP, width, layers),
            name="jax-mlp",
            replicas=1,
            resources=resources,
            scheduler=client,
        )
        t0 = time.perf_counter()
        model.start()
        built = time.perf_counter() - t0
        backend = model.call("backend")
        where = "GPU" if backend.split()[0] in GPU_NAMES else "CPU"
        print(
            f"[{NAME}] GPU variant: MLP {layers} x {width} (JAX) ran on {where}: backend "
            f"{backend}; replica built (3 shapes compiled) in {built:.1f} s"
            + ("" if where == "GPU" else " -- no GPU: JAX's CPU backend, nothing targeted")
        )
        t1, t64 = model.call("time_forward", 1), model.call("time_forward", 64)
        xs = [np.arange(DIM, dtype=np.float64) + DIM * i for i in range(threads)]
        refs = [model.call("forward_alone", x)[0] for x in xs]
        worst = np.zeros(threads)

        def mlp_work(method):
            def work(i, k):
                y, s = model.call(method, xs[i])
                worst[i] = max(worst[i], abs(float(y) - float(refs[i])))
                return None if float(s) == float(xs[i].sum()) else f"caller {i}: sum {s}"

            return work

        callers = Callers(threads)
        try:
            configs = {f"{threads} threads": (lambda m, k: callers.run(mlp_work(m), k), GPU_CALLS)}
            alternate(client, "jax-mlp", {c: (r, 3) for c, (r, _) in configs.items()},
                      GPU_VARIANTS, 1)  # fmt: skip
            rates, sizes, wrong, checked, _ = alternate(
                client, "jax-mlp", configs, GPU_VARIANTS, rounds
            )
        finally:
            callers.close()
        model.close()

    if wrong:
        raise AssertionError(f"{len(wrong)} wrong results, e.g. {wrong[:3]}")
    scale = max(float(np.max(np.abs(refs))), 1e-30)
    if worst.max() > 1e-2 * scale:
        raise AssertionError(f"MLP results differ by {worst.max():.2e} (scale {scale:.2e})")
    c = f"{threads} threads"
    med = {v: statistics.median(rates[c, v]) for v in GPU_VARIANTS}
    ratio = med["batched"] / med["max_size=1"]
    ceiling = {"batched": 64 / t64, "max_size=1": 1 / t1}
    size = {"batched": 64, "max_size=1": 1}
    print_table(
        ["variant", "calls/s", "batch median", "mean", "model alone", "ceiling calls/s"],
        [
            (
                v,
                f"{med[v]:,.0f}",
                *_size_text(sizes[c, v]),
                f"{(t64 if v == 'batched' else t1) * 1e3:.3f} ms / batch of {size[v]}",
                f"{ceiling[v]:,.0f}",
            )
            for v in GPU_VARIANTS
        ],
        title=f"[{NAME}] JAX MLP {layers} x {width} on {where}, one replica, {threads} threads x "
        f"{GPU_CALLS} calls, {rounds} rounds ({checked} results checked; largest difference "
        f"from max_size=1 alone {worst.max():.1e})",
    )
    tag = f"{where} MLP {layers}x{width}"
    rows += [
        Row(NAME, f"{tag} batched, {threads} threads (calls/s)", round(med["batched"])),
        Row(NAME, f"{tag} max_size=1, {threads} threads (calls/s)", round(med["max_size=1"])),
        Row(NAME, f"{tag} batched / max_size=1", ratio, 10 if where == "GPU" else None, True),
        Row(NAME, f"{tag} ceiling, batches of 64 (calls/s)", round(ceiling["batched"])),
        Row(NAME, f"{tag} ceiling, one at a time (calls/s)", round(ceiling["max_size=1"])),
        Row(NAME, f"{tag} ceiling ratio 64 / 1", ceiling["batched"] / ceiling["max_size=1"]),
        Row(NAME, f"{tag} batched, median batch", statistics.median(sizes[c, "batched"])),
        Row(NAME, f"{tag} largest difference / scale (x 1e-6)", float(worst.max()) / scale * 1e6),
        Row(NAME, f"{tag} wrong results", len(wrong), 0),
    ]
    return rows


# ----------------------------------------------------------------------------- main


def main(
    gpu: bool | None = None, width: int | None = None, layers: int = 4, threads: int = 64
) -> list[Row]:
    """The CPU part, then the GPU variant if ``gpu`` (None: if JAX sees a GPU)."""
    quiet()
    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    rows += cpu_variant()
    if gpu is None:
        backend = jax_backend()
        gpu = backend in GPU_NAMES
        if not gpu:
            print(f"[{NAME}] GPU variant skipped (JAX backend: {backend}; --gpu runs it)")
    if gpu:
        rows += gpu_variant(width, layers, threads)
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    import argparse

    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run the GPU variant (JAX MLP)")
    parser.add_argument("--width", type=int, help="MLP width (8192 on a GPU, 256 on CPU)")
    parser.add_argument("--layers", type=int, default=4, help="MLP layers (4)")
    parser.add_argument("--threads", type=int, default=64, help="GPU variant's callers (64)")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(True if args.gpu else None, args.width, args.layers, args.threads)
    if not args.no_save:
        save_results(NAME, rows)
