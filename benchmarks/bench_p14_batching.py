"""P14 and P17: many callers, one model replica: ``@dt.batched`` against the same work unbatched.

A model on one replica (one GPU, one sharded dataset) serves several chains.  Each caller
(a thread here, as samplers' chains are threads or processes) passes one parameter vector.

* **P14**, a model priced like a GPU: ``10 ms + 0.5 ms per row`` of a call (the time is
  slept: a GPU's time is mostly not the caller's CPU).  8 threads x 25 calls, one replica:
  the batched method (the calls that wait run as one batch) against the unbatched one
  (one row per call, 10.5 ms each, one after another at the replica).  Target >= 4x;
  the ideal, batches of 8 all the way, is 8 x 10.5 / (10 + 8 x 0.5) = 6x.  Beside it the
  same method with ``wait=0``: the callers of a batch come back one by one, and the first
  one back runs alone while the others queue (batches of 1 and 7 alternate), which the
  default ``wait="auto"`` avoids by waiting for them (at most a quarter of the last
  batch's time).
* **P17**, a CPU stand-in for a GPU surrogate: a NumPy MLP, 2 layers of 1,000 x 1,000
  (tanh), for 8 threads x 25 calls: batched (a matrix product per batch) against
  unbatched (a matrix-vector product per call).  Reported, not targeted (a CPU's
  matrix products gain less from batching than a GPU's).

Both variants run in alternating blocks (all 200 calls of one variant, then the other),
and each caller's results are checked: bit for bit for P14 (the same arithmetic per
row), to round-off for P17 (BLAS sums a matrix product in another order than a
matrix-vector product).

Run: ``python benchmarks/bench_p14_batching.py``
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, print_table, quiet, versions_line

NAME = "p14-batching"
THREADS, CALLS = 8, 25


def run_threads(call, threads: int = THREADS, calls: int = CALLS) -> tuple[float, list]:
    """Wall seconds of ``threads`` threads each making ``calls`` calls ``call(i, k)``;
    the results, by thread."""
    import numpy as np

    def one(i):
        return [call(np.array([0.01 * i, 0.001 * k])) for k in range(calls)]

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        out = list(pool.map(one, range(threads)))
    return time.perf_counter() - t0, out


def alternate(variants: dict, rounds: int) -> tuple[dict[str, list[float]], dict]:
    """Each variant's wall time per round, the variants alternating (reversed every other
    round); the results of the last round, by variant."""
    walls: dict[str, list[float]] = {k: [] for k in variants}
    results = {}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            wall, results[name] = run_threads(variants[name])
            walls[name].append(wall)
    return walls, results


def main(rounds: int = 3) -> list[Row]:
    quiet()
    import numpy as np
    from _ops import MLP, GpuPriced

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    with local_cluster(n_workers=2, threads_per_worker=1) as client:
        # P14 -----------------------------------------------------------------------
        model = dt.RemoteModel(GpuPriced, name="gpu-priced", replicas=1, scheduler=client)
        model.start()
        variants = {
            "unbatched": lambda x: model.call("logp_alone", x),
            "batched": lambda x: model.call("logp", x),
            "batched, wait=0": lambda x: model.call("logp_eager", x),
        }
        walls, results = alternate(variants, rounds)
        for name in ("batched", "batched, wait=0"):
            for a, b in zip(results["unbatched"], results[name]):
                assert all(np.array_equal(x, y) for x, y in zip(a, b)), "P14: results differ"
        med = {k: statistics.median(v) for k, v in walls.items()}
        ideal = THREADS * 0.0105 / (0.010 + THREADS * 0.0005)
        print_table(
            ["variant", "wall (median)", "per call", "rounds"],
            [
                (k, f"{med[k]:.3f} s", f"{med[k] / (THREADS * CALLS) * 1e3:.2f} ms", len(walls[k]))
                for k in med
            ],  # fmt: skip
            title=f"P14: {THREADS} threads x {CALLS} calls, one replica, 10 ms + 0.5 ms/row",
        )
        rows += [
            Row(NAME, "P14 unbatched wall", med["unbatched"], unit="s"),
            Row(NAME, "P14 batched wall", med["batched"], unit="s"),
            Row(NAME, "P14 speed-up", med["unbatched"] / med["batched"], 4, True),
            Row(NAME, "P14 batched, wait=0, wall", med["batched, wait=0"], unit="s"),
            Row(NAME, "P14 speed-up, wait=0", med["unbatched"] / med["batched, wait=0"]),
            Row(NAME, "P14 ideal speed-up (batches of 8)", round(ideal, 2)),
            Row(NAME, "P14 results identical (1/0)", 1),
        ]
        model.close()
        # P17 -----------------------------------------------------------------------
        mlp = dt.RemoteModel(MLP, name="mlp", replicas=1, scheduler=client)
        mlp.start()
        variants = {
            "unbatched": lambda x: mlp.call("forward_alone", x),
            "batched": lambda x: mlp.call("forward", x),
        }
        walls, results = alternate(variants, rounds)
        worst = max(
            float(np.max(np.abs(x - y)))
            for a, b in zip(results["unbatched"], results["batched"])
            for x, y in zip(a, b)
        )
        med = {k: statistics.median(v) for k, v in walls.items()}
        print(f"P17: MLP 2 x (1000 x 1000): unbatched {med['unbatched']:.3f} s, "
              f"batched {med['batched']:.3f} s, largest difference {worst:.1e}")  # fmt: skip
        rows += [
            Row(NAME, "P17 MLP unbatched wall", med["unbatched"], unit="s"),
            Row(NAME, "P17 MLP batched wall", med["batched"], unit="s"),
            Row(NAME, "P17 MLP speed-up batched/unbatched", med["unbatched"] / med["batched"]),
            Row(NAME, "P17 MLP largest difference (x 1e-12)", worst * 1e12),
        ]
        mlp.close()
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
