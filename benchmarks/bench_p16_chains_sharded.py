"""P16: four chains at once on one sharded likelihood, against the default mode serving them.

The 2,000,000-row linear regression of P9, on a ``LocalCluster`` of 2 worker processes x 1
thread.  Four chains, as samplers hold them: four copies of PyMC's
``logp_dlogp_function(ravel_inputs=True)``, each called back to back from a thread of its
own with its own parameter vector.  The copies share one set of 2 shards (one per worker),
and the chains' calls that wait for a shard run there together
(``ShardServer.run_together``): one wake-up of the shard, each block of rows read once for
all of them, each chain's values bit for bit those of its call alone.  Against: the
default mode serving the four chains one after another, in one process.

Two cases:

* **pickled copies, BLAS as the machine sets it** (how a check written apart from the
  project ran it, and how a user would): the copies are ``pickle.loads(pickle.dumps(f))``
  of one function, made before any shard exists; their first calls (which build the
  shards once, for all four) are timed on their own; the caller's BLAS keeps its default
  thread count, so the default mode's matrix products may use every core.
* **compiled copies, BLAS 1 thread everywhere** (one core against the shards).

Each timed in alternating blocks (all chains' evaluations of one variant, then the
other), with the machine's ceiling measured in the same run: each shard's own work for
the four vectors, both workers at once, no messages -- once as four single calls, once as
one ``run_together`` of four (what the shards do when the chains' calls meet).  Target:
default / sharded >= 1.8 (the compute bound with 2 workers is 2x).  Each chain's result
is checked against its call alone.

Run: ``python benchmarks/bench_p16_chains_sharded.py [--workers N] [--rows N]``
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    blas_threads,
    limit_blas,
    load_row,
    local_cluster,
    print_ratio_table,
    print_rows,
    quiet,
    versions_line,
)
from bench_p9_sharding import _shard_block, linreg

NAME = "p16-chains-sharded"
CHAINS = 4


def _shard_block_together(keys, args, calls, start, dask_worker=None) -> float:
    """On a worker: seconds of ``calls`` back-to-back ``run_together`` of ``CHAINS``
    vectors (the chains' calls as they meet on a shard), started at ``start``."""
    host = dask_worker.plugins.get("dasktensor-models")
    [server] = [r.model for k, r in host.replicas.items() if k in keys]
    columns = [[a] * CHAINS for a in args]
    server.run_together(*columns)
    time.sleep(max(0.0, start - time.time()))
    t0 = time.perf_counter()
    for _ in range(calls):
        server.run_together(*columns)
    return time.perf_counter() - t0


def chains(label, client, ref, copies, points, calls: int, rounds: int) -> list[Row]:
    """Alternating blocks: the default mode serving ``CHAINS`` chains in turn, the copies
    in a thread each, and the shards' own work (the ceiling)."""
    import numpy as np

    began = time.time()
    alone = [[np.array(o) for o in copies[c](points[c])] for c in range(CHAINS)]
    ex = copies[0].maker.linker.sharded
    sets = {id(f.maker.linker.sharded.stages()[0]) for f in copies}
    keys = [m.key for s in ex.stages() for m in s.models]
    args = [points[0], *ex.split.plan.guesses()]
    mismatches: list[int] = []  # chains whose result differed from the call alone

    def default():
        for _ in range(calls):
            for c in range(CHAINS):
                ref(points[c])

    def chain(c):
        for _ in range(calls):
            got = copies[c](points[c])
            if not all(np.array_equal(g, w) for g, w in zip(got, alone[c])):
                mismatches.append(c)

    pool = ThreadPoolExecutor(CHAINS)

    def sharded():
        list(pool.map(chain, range(CHAINS)))

    def ceiling(block):  # the four vectors' work on each shard, both workers at once
        start = time.time() + 0.2
        n = CHAINS * calls if block is _shard_block else calls
        return max(client.run(block, keys, args, n, start).values())

    base = "default, chains one after another"
    timed: dict[str, list[float]] = {base: [], f"DASK sharded, {CHAINS} chains at once": []}
    ceil_alone, ceil_together = "ceiling: 4 single calls a shard", "ceiling: 4 together a shard"
    timed[ceil_alone], timed[ceil_together] = [], []
    for _ in range(2):
        default(), sharded(), ceiling(_shard_block), ceiling(_shard_block_together)
    for r in range(rounds):
        for name in list(timed) if r % 2 == 0 else list(reversed(timed)):
            if name.startswith("ceiling"):
                block = _shard_block if name == ceil_alone else _shard_block_together
                timed[name].append(ceiling(block) / calls)
                continue
            t0 = time.perf_counter()
            (default if name == base else sharded)()
            timed[name].append((time.perf_counter() - t0) / calls)
    pool.shutdown()
    times = {k: statistics.median(v) for k, v in timed.items()}
    print_ratio_table(times, base, title=f"{label}: per round of {CHAINS} evaluations")

    def batches(since, dask_worker=None):
        records = dask_worker.plugins["dasktensor-models"].calls.since(since)["records"]
        return [(r[2], r[3], r[5]) for r in records if r[0] == "shard"]

    found = list(client.run(batches, began).values())
    sizes = [s for runs in found for _, _, s in runs]
    # each shard's batches and the idle time before the next one (medians: the pauses
    # between timed blocks are few)
    took = [b - a for runs in found for a, b, _ in runs]
    idle = [runs[i + 1][0] - runs[i][1] for runs in found for i in range(len(runs) - 1)]
    t_ref, t_dask, t_alone, t_together = times.values()
    return [
        Row(NAME, f"{label}: shard sets for the {CHAINS} copies", len(sets), 1),
        Row(NAME, f"{label}: default, {CHAINS} evaluations", t_ref, unit="s"),
        Row(NAME, f"{label}: DASK sharded, {CHAINS} chains at once", t_dask, unit="s"),
        Row(NAME, f"{label}: speed-up default/sharded", t_ref / t_dask, 1.8, True),
        Row(NAME, f"{label}: ceiling, 4 single calls a shard", t_alone, unit="s"),
        Row(NAME, f"{label}: ceiling, 4 together a shard", t_together, unit="s"),
        Row(NAME, f"{label}: ceiling default/shards' work (together)", t_ref / t_together),
        Row(NAME, f"{label}: share of the ceiling (together)", t_together / t_dask, 0.9, True),
        Row(NAME, f"{label}: mean calls per shard batch", statistics.mean(sizes)),
        Row(NAME, f"{label}: a shard's batch, median", statistics.median(took), unit="s"),
        Row(
            NAME,
            f"{label}: a shard idle between batches, median",
            statistics.median(idle),
            unit="s",
        ),  # fmt: skip
        Row(NAME, f"{label}: results differing from the call alone", len(mismatches), 0),
    ]


def main(calls: int = 10, rounds: int = 5, workers: int = 2, rows: int = 2_000_000) -> list[Row]:
    quiet()
    import numpy as np

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    out: list[Row] = [load_row(NAME)]
    with local_cluster(n_workers=workers, threads_per_worker=1) as client:
        model = linreg(rows)
        mode = dt.dask_mode(scheduler=client)
        ref = model.logp_dlogp_function(ravel_inputs=True)._pytensor_function
        size = ref.maker.fgraph.inputs[0].type.shape
        points = [np.random.default_rng(c).normal(scale=0.1, size=size) for c in range(CHAINS)]

        # 1. pickled copies made before any shard exists, BLAS as the machine sets it
        print(f"[{NAME}] caller BLAS threads (the machine's default): {blas_threads()}")
        blob = pickle.dumps(model.logp_dlogp_function(ravel_inputs=True, mode=mode))
        copies = [pickle.loads(blob)._pytensor_function for _ in range(CHAINS)]
        del blob
        ref(points[0])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CHAINS) as pool:
            list(pool.map(lambda c: copies[c](points[c]), range(CHAINS)))
        first = time.perf_counter() - t0
        print(f"[{NAME}] {copies[0].maker.linker.plan}")
        out.append(
            Row(NAME, f"first calls of {CHAINS} pickled copies (shards built)", first, unit="s")
        )
        out += chains("pickled, BLAS default", client, ref, copies, points, calls, rounds)
        del copies

        # 2. copies compiled in this process, BLAS 1 thread in the caller too
        with limit_blas(1):
            copies = [
                model.logp_dlogp_function(ravel_inputs=True, mode=mode)._pytensor_function
                for _ in range(CHAINS)
            ]
            out += chains("compiled, BLAS 1 thread", client, ref, copies, points, calls, rounds)
    out.append(load_row(NAME))
    print_rows(out, title=f"[{NAME}] summary")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows (2,000,000)")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(workers=args.workers, rows=args.rows)
    if not args.no_save:
        from _common import save_results

        save_results(NAME, rows)
