"""GPU workers started by ``dt.connect(gpus=...)``: a placed network and a batched surrogate.

* **Placed network**: a graph whose ``dt.annotate(resources={"GPU": 1}, mode="JAX")``
  block is a network of ``layers`` dense layers of ``width``² (tanh, float64), fed a
  ``(rows, width)`` input and summed.  Three ways, timed in alternating blocks of
  back-to-back calls (``_common.blocks``): the whole graph in this process with the
  default mode; the block compiled with JAX on the GPU worker (one worker per device,
  started by ``dt.connect(n_workers=1, gpus=...)``); the same block compiled with JAX on
  the CPU worker beside it (``workers=[cpu]``).  The values of the three are compared.
* **Batched surrogate**: ``_ops.JaxMLP`` as a remote model asking for ``{"GPU": 1}``,
  64 caller threads, ``forward`` (batched, up to 64 calls a batch) against
  ``forward_alone`` (``max_size=1``), alternating blocks (P27's harness).

Without a GPU (found with ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``) the benchmark
still starts a "GPU worker", for a device ``0`` named in ``CUDA_VISIBLE_DEVICES``, and
JAX runs on its CPU backend there: it says so, uses small sizes and targets nothing.
Nothing asserts on timings.

Run: ``python benchmarks/bench_gpu.py`` (``--width``, ``--layers``, ``--rows``,
``--threads`` to change the sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, blocks, fmt_time, print_rows, print_table, quiet, versions_line

NAME = "gpu"
GPU_NAMES = ("gpu", "cuda", "rocm")


def _jax_here() -> str:
    """On a worker: JAX's backend and first device."""
    import jax

    return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"


def _gpu_client():
    """``dt.connect(n_workers=1, gpus="all")``, or, with no GPU found, the same cluster
    with a GPU worker for device ``0`` named in ``CUDA_VISIBLE_DEVICES`` (JAX then runs
    on its CPU backend there); whether a real device was found."""
    import dasktensor as dt
    from dasktensor.cluster import find_devices

    devices, how = find_devices()
    real = bool(devices)
    if not real:
        print(
            f"[{NAME}] no GPU found ({how}): the GPU worker gets CUDA_VISIBLE_DEVICES=0 "
            "and JAX runs on its CPU backend -- figures of the code path, not of a GPU"
        )
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        client = dt.connect(n_workers=1, gpus="all" if real else [0], dashboard_address=False)
    finally:
        if not real:
            del os.environ["CUDA_VISIBLE_DEVICES"]
    return client, real


def _workers(client) -> tuple[str, str]:
    """The addresses of the GPU worker and the CPU worker."""
    from dasktensor.cluster import scheduler_workers

    workers = scheduler_workers(client)
    gpu = next(a for a, w in workers.items() if w.get("resources", {}).get("GPU"))
    cpu = next(a for a, w in workers.items() if not w.get("resources", {}).get("GPU"))
    return gpu, cpu


def placed_network(client, where: str, width: int, layers: int, rows: int) -> list[Row]:
    import pytensor
    import pytensor.tensor as pt

    import dasktensor as dt

    gpu, cpu = _workers(client)
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(width, width)) / np.sqrt(width) for _ in range(layers)]

    def graph(**placement):
        x = pt.dmatrix("x")
        h = x * 0.5
        if placement:
            with dt.annotate(name="network", **placement):
                for w in weights:
                    h = pt.tanh(h @ w)
        else:
            for w in weights:
                h = pt.tanh(h @ w)
        return x, (h**2).sum()

    x0, out0 = graph()
    default = pytensor.function([x0], out0)
    x1, out1 = graph(resources={"GPU": 1}, mode="JAX")
    on_gpu = dt.function([x1], out1, scheduler=client)
    x2, out2 = graph(mode="JAX", workers=[cpu])
    on_cpu = dt.function([x2], out2, scheduler=client)
    xv = rng.normal(size=(rows, width))
    want = float(default(xv))
    for label, f in (("GPU worker", on_gpu), ("CPU worker", on_cpu)):
        got = float(f(xv))
        if abs(got - want) > 1e-9 * max(abs(want), 1.0):
            raise AssertionError(f"{label}: {got} != default mode {want}")
    ran_on = client.run(_jax_here, workers=[gpu])[gpu]
    t = blocks(
        {"default": lambda: default(xv), "gpu": lambda: on_gpu(xv), "cpu": lambda: on_cpu(xv)},
        calls=5,
        rounds=5,
        warmup=2,
    )
    print_table(
        ["variant", "per call", "vs default"],
        [
            ("whole graph, this process, default mode", fmt_time(t["default"]), "1.00x"),
            (
                f"block with JAX on the GPU worker ({ran_on})",
                fmt_time(t["gpu"]),
                f"{t['default'] / t['gpu']:.2f}x",
            ),
            (
                "block with JAX on the CPU worker",
                fmt_time(t["cpu"]),
                f"{t['default'] / t['cpu']:.2f}x",
            ),
        ],
        title=f"[{NAME}] {layers} layers of {width}² (float64), input {rows} x {width}, "
        f"on {where}; values equal to the default mode's",
    )
    gpu_target = 2.0 if where == "GPU" else None
    return [
        Row(NAME, f"{where}: default mode, whole graph (ms)", t["default"] * 1e3),
        Row(NAME, f"{where}: JAX block on the GPU worker (ms)", t["gpu"] * 1e3),
        Row(NAME, f"{where}: JAX block on a CPU worker (ms)", t["cpu"] * 1e3),
        Row(
            NAME, f"{where}: GPU worker vs default (x)", t["default"] / t["gpu"], gpu_target, True
        ),
        Row(NAME, f"{where}: GPU worker vs JAX on CPU worker (x)", t["cpu"] / t["gpu"]),
    ]


def batched_surrogate(client, where: str, width: int, threads: int, rounds: int) -> list[Row]:
    from functools import partial

    from _ops import JaxMLP
    from bench_p27_throughput import DIM, GPU_CALLS, GPU_VARIANTS, Callers, alternate

    import dasktensor as dt

    model = dt.RemoteModel(partial(JaxMLP, width, 4), name="jax-mlp", replicas=1,
                           resources={"GPU": 1}, scheduler=client)  # fmt: skip
    rows: list[Row] = []
    try:
        model.start()
        xs = [np.arange(DIM, dtype=np.float64) + DIM * i for i in range(threads)]
        refs = [float(model.call("forward_alone", x)[0]) for x in xs]
        worst = np.zeros(threads)

        def work_of(method):
            def work(i, k):
                y, s = model.call(method, xs[i])
                worst[i] = max(worst[i], abs(float(y) - refs[i]))
                return None if float(s) == float(xs[i].sum()) else f"caller {i}: sum {s}"

            return work

        callers = Callers(threads)
        try:
            configs = {f"{threads} threads": (lambda m, k: callers.run(work_of(m), k), GPU_CALLS)}
            rates, sizes, wrong, checked, _ = alternate(client, "jax-mlp", configs,
                                                        GPU_VARIANTS, rounds)  # fmt: skip
        finally:
            callers.close()
    finally:
        model.close()
    if wrong:
        raise AssertionError(f"{len(wrong)} wrong results, e.g. {wrong[:3]}")
    c = f"{threads} threads"
    med = {v: statistics.median(rates[c, v]) for v in GPU_VARIANTS}
    batch = statistics.median(sizes[c, "batched"]) if sizes[c, "batched"] else float("nan")
    print_table(
        ["variant", "calls/s", "median batch"],
        [
            (v, f"{med[v]:,.0f}", f"{statistics.median(sizes[c, v]) if sizes[c, v] else 0:g}")
            for v in GPU_VARIANTS
        ],
        title=f"[{NAME}] JAX MLP 4 x {width} on the GPU worker ({where}), {threads} callers, "
        f"{checked} results checked (largest difference {worst.max():.1e})",
    )
    ratio = med["batched"] / med["max_size=1"]
    rows += [
        Row(
            NAME, f"{where}: surrogate batched, {threads} callers (calls/s)", round(med["batched"])
        ),
        Row(NAME, f"{where}: surrogate max_size=1 (calls/s)", round(med["max_size=1"])),
        Row(
            NAME, f"{where}: batched / max_size=1 (x)", ratio, 10 if where == "GPU" else None, True
        ),
        Row(NAME, f"{where}: median batch", batch),
    ]
    return rows


def main(width: int | None = None, layers: int = 4, rows: int | None = None,
         threads: int = 64, rounds: int = 3) -> list[Row]:  # fmt: skip
    import importlib.util

    quiet()
    if importlib.util.find_spec("jax") is None:
        print(f"[{NAME}] skipped: JAX is not installed (pip install -e '.[jax]')")
        return []
    client, real = _gpu_client()
    out: list[Row] = []
    try:
        gpu, _ = _workers(client)
        backend = client.run(_jax_here, workers=[gpu])[gpu]
        where = "GPU" if backend.split()[0] in GPU_NAMES else "CPU"
        if real and where != "GPU":
            print(f"[{NAME}] a GPU was found but JAX on its worker runs on {backend}: "
                  "is jax[cuda] installed?")  # fmt: skip
        print(f"[{NAME}] JAX on the GPU worker: {backend}"
              + ("" if where == "GPU" else " -- JAX's CPU backend, nothing targeted"))  # fmt: skip
        width_n = width or (2048 if where == "GPU" else 256)
        rows_n = rows or (2048 if where == "GPU" else 256)
        t0 = time.perf_counter()
        out += placed_network(client, where, width_n, layers, rows_n)
        out += batched_surrogate(client, where, width or (8192 if where == "GPU" else 256),
                                 threads, rounds)  # fmt: skip
        print(f"[{NAME}] ran in {time.perf_counter() - t0:.0f} s")
    finally:
        client.shutdown()
        client.close()
    return out


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    a = parser.parse_args()
    rows = main(a.width, a.layers, a.rows, a.threads, a.rounds)
    print_rows(rows, title=versions_line())
    if not a.no_save:
        save_results(NAME, rows)
