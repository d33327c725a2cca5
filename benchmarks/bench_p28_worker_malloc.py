"""P28: a model's evaluation on a worker of ``dt.connect``, against one of Dask's default nanny.

Dask's nannies start workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which turns off
glibc's adaptive mmap threshold: each NumPy temporary above 128 KiB is then a fresh
mapping whose pages fault in on first write.  ``dt.connect``'s workers (and
``dasktensor worker``'s) leave the variable unset (``dasktensor.cluster.
malloc-trim-threshold``).  Two embedded clusters of one worker each run side by side:
one as ``dt.connect`` starts it, one with the setting at 65536 (Dask's choice).  On each
worker, in alternating blocks of back-to-back calls:

* a kernel with 1 MiB temporaries (a shard of 131,072 rows: ``exp(-(2x+1)) * x``, summed,
  8 blocks), as the sharded likelihoods run;
* ``logp_dlogp`` of P10's logistic regression (20,000 x 20), what NUTS calls per step.

Printed: the median per call on each and the ratio Dask's / dasktensor's, with the
minor page faults per call that explain it.

Run: ``python benchmarks/bench_p28_worker_malloc.py``
"""

from __future__ import annotations

import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_time, load_row, print_rows, print_table, quiet, versions_line

NAME = "p28-worker-malloc"
ROUNDS = 9


def _kernel():
    import numpy as np

    x = np.random.default_rng(0).random(131_072 * 8)

    def run():
        s = 0.0
        for i in range(8):
            b = x[i * 131_072 : (i + 1) * 131_072]
            s += (np.exp(-(b * 2.0 + 1.0)) * b).sum()
        return s

    return run


def _logp_dlogp():
    import numpy as np
    from bench_p10_chains import regression

    m = regression()
    f = m.logp_dlogp_function(ravel_inputs=True)
    f.set_extra_values({})
    point = np.zeros(sum(np.size(v) for v in m.initial_point().values()))
    return lambda: f(point)


def _variable():
    """On a worker: its MALLOC_TRIM_THRESHOLD_ (``os.environ.get`` passed to ``run`` would
    carry the caller's environment along)."""
    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


_MADE: dict = {}


def _block(case: str, calls: int) -> tuple[float, float]:
    """On a worker: seconds and minor page faults per call of ``calls`` back-to-back
    calls of ``case`` (made once per worker)."""
    import resource
    import time

    if case not in _MADE:
        _MADE[case] = {"kernel": _kernel, "logp_dlogp": _logp_dlogp}[case]()
        for _ in range(5):
            _MADE[case]()
    fn = _MADE[case]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - t0) / calls
    return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls


def main() -> list[Row]:
    quiet()
    logging.getLogger("distributed").setLevel(logging.ERROR)  # the clusters' closing lines
    import dask

    import dasktensor as dt

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    clients = {}
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    common = dict(n_workers=1, dashboard_address=False, set_as_default=False, env=env,
                  silence_logs=logging.ERROR)  # fmt: skip
    clients["dasktensor"] = dt.connect(**common)
    with dask.config.set({"dasktensor.cluster.malloc-trim-threshold": 65536}):
        clients["Dask's 65536"] = dt.connect(**common)
    try:
        for name, c in clients.items():
            print(
                f"  {name}: MALLOC_TRIM_THRESHOLD_ =",
                list(c.run(_variable).values())[0],
            )
        for case, calls in (("kernel", 100), ("logp_dlogp", 200)):
            samples: dict = {k: [] for k in clients}
            faults: dict = {k: [] for k in clients}
            for r in range(ROUNDS):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for k in order:
                    [(s, f)] = clients[k].run(_block, case, calls).values()
                    samples[k].append(s)
                    faults[k].append(f)
            med = {k: statistics.median(v) for k, v in samples.items()}
            flt = {k: statistics.median(v) for k, v in faults.items()}
            print_table(
                ["worker", "median per call", "page faults per call"],
                [(k, fmt_time(med[k]), f"{flt[k]:.0f}") for k in clients],
                f"{case}: blocks of {calls} back-to-back calls, {ROUNDS} per worker, alternating",
            )
            rows += [
                Row(NAME, f"{case}: dt.connect's worker", med["dasktensor"], unit="s"),
                Row(NAME, f"{case}: worker with Dask's 65536", med["Dask's 65536"], unit="s"),
                Row(
                    NAME,
                    f"{case}: ratio Dask's / dt.connect's",
                    round(med["Dask's 65536"] / med["dasktensor"], 2),
                ),  # fmt: skip
                Row(
                    NAME, f"{case}: page faults per call, dt.connect's", round(flt["dasktensor"])
                ),  # fmt: skip
                Row(
                    NAME, f"{case}: page faults per call, Dask's 65536", round(flt["Dask's 65536"])
                ),  # fmt: skip
            ]
    finally:
        for c in clients.values():
            c.shutdown()
            c.close()
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
