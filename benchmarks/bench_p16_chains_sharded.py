"""P16: four chains at once on one sharded likelihood, against the default mode serving them.

The 2,000,000-row linear regression of P9, on a ``LocalCluster`` of 2 worker processes x 1
thread (BLAS 1 thread everywhere).  Four chains, as samplers hold them: four copies of
PyMC's ``logp_dlogp_function(ravel_inputs=True)``, each compiled on its own, each called
back to back from a thread of its own with its own parameter vector.

* **sharded**: the copies in the DASK mode.  They share one set of 2 shards (one per
  worker), and the chains' calls that wait for a shard run there together
  (``ShardServer.run_together``): one wake-up of the shard, each block of rows read once
  for all of them, each chain's values bit for bit those of its call alone.
* **default**: the default mode serving the four chains one after another, in one process
  (what one core does).

Timed in alternating blocks (all chains' evaluations of one variant, then the other),
with the machine's ceiling measured in the same run: the shards' own work for four
evaluations, both workers at once.  Target: default / sharded >= 1.8 (the compute bound
with 2 workers is 2x).  Each chain's result is checked against its call alone.

Run: ``python benchmarks/bench_p16_chains_sharded.py``
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
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


def main(calls: int = 10, rounds: int = 5) -> list[Row]:
    quiet()
    import numpy as np

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows: list[Row] = [load_row(NAME)]
    with limit_blas(1), local_cluster(n_workers=2, threads_per_worker=1) as client:
        model = linreg()
        ref = model.logp_dlogp_function(ravel_inputs=True)._pytensor_function
        mode = dt.dask_mode(scheduler=client)
        copies = [
            model.logp_dlogp_function(ravel_inputs=True, mode=mode)._pytensor_function
            for _ in range(CHAINS)
        ]
        size = ref.maker.fgraph.inputs[0].type.shape
        points = [np.random.default_rng(c).normal(scale=0.1, size=size) for c in range(CHAINS)]
        t0 = time.perf_counter()
        alone = [[np.array(o) for o in copies[c](points[c])] for c in range(CHAINS)]
        first = time.perf_counter() - t0
        ex = copies[0].maker.linker.sharded
        print(f"[{NAME}] {copies[0].maker.linker.plan}")
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

        def ceiling():  # four evaluations of each shard's own work, both workers at once
            start = time.time() + 0.2
            return max(client.run(_shard_block, keys, args, CHAINS * calls, start).values())

        timed: dict[str, list[float]] = {"default, chains one after another": []}
        timed[f"DASK sharded, {CHAINS} chains at once"] = []
        timed["ceiling (shards' own work)"] = []
        for _ in range(2):
            default(), sharded(), ceiling()
        for r in range(rounds):
            for name in list(timed) if r % 2 == 0 else list(reversed(timed)):
                if name.startswith("ceiling"):
                    timed[name].append(ceiling() / calls)
                    continue
                t0 = time.perf_counter()
                (default if name.startswith("default") else sharded)()
                timed[name].append((time.perf_counter() - t0) / calls)
        pool.shutdown()
        times = {k: statistics.median(v) for k, v in timed.items()}
        print_ratio_table(
            times, "default, chains one after another", title=f"per round of {CHAINS} evaluations"
        )

        def batches(dask_worker):
            records = dask_worker.plugins["dasktensor-models"].calls.since(0.0)["records"]
            return [r[5] for r in records if r[0] == "shard"]

        sizes = [s for found in client.run(batches).values() for s in found]
        t_ref, t_dask, t_ceil = times.values()
        rows += [
            Row(NAME, "shard sets for the 4 copies", len(sets), 1),
            Row(NAME, "default, 4 evaluations", t_ref, unit="s"),
            Row(NAME, "DASK sharded, 4 chains at once", t_dask, unit="s"),
            Row(NAME, "ceiling: the shards' own work", t_ceil, unit="s"),
            Row(NAME, "speed-up default/sharded", t_ref / t_dask, 1.8, True),
            Row(NAME, "ceiling default/shards' work", t_ref / t_ceil),
            Row(NAME, "mean calls per shard batch", statistics.mean(sizes)),
            Row(NAME, "results differing from the call alone", len(mismatches), 0),
            Row(NAME, "first call (4 copies' shards: one build)", first, unit="s"),
        ]
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    main()
