"""Run the dasktensor benchmarks and print one summary table.

Run: ``python benchmarks/run_all.py`` (optionally with names: ``python
benchmarks/run_all.py a p1``).  Each benchmark prints its own details first; the table
at the end has one row per metric: benchmark, metric, measured, target, met?.  Timings
on a small shared machine are noisy: read them with the load-average rows and the
raw-Dask floors printed beside them.

Each benchmark that completes writes its rows to its result file (``save_results`` in
``_common.py``: ``benchmarks/results/python3.X/<name>.json``, the file the documentation's
tables are made from), as it does when run alone with its default options; ``--no-save``
(or ``DASKTENSOR_BENCH_NO_SAVE=1``) writes nothing.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_average, print_rows, quiet, save_results, versions_line

BENCHMARKS = {
    "a": "bench_a_overhead",
    "b": "bench_b_branches",
    "c": "bench_c_cheap_heavy",
    "p1": "bench_p1_latency",
    "p2": "bench_p2_remote_calls",
    "p5": "bench_p5_sampling",
    "p6": "bench_p6_predictive",
    "p7": "bench_p7_zarr_memory",
    "p8": "bench_p8_pmap",
    "p9": "bench_p9_sharding",
    "p10": "bench_p10_chains",
    "p11": "bench_p11_loglik_zarr",
    "p12": "bench_p12_soak",
    "p14": "bench_p14_batching",
    "p15": "bench_p15_sample_batched",
    "p16": "bench_p16_chains_sharded",
    "p18": "bench_p18_adaptive",
    "p19": "bench_p19_monitor_cost",
    "p20": "bench_p20_umbridge",
    "p22": "bench_p22_serve_umbridge",
    "p24": "bench_p24_pipeline",
    "p27": "bench_p27_throughput",
    "p28": "bench_p28_worker_malloc",
    "gpu": "bench_gpu",
}


def main(names: list[str] | None = None, save: bool = False) -> list[Row]:
    """Run the benchmarks ``names`` (all by default) with their default options; with
    ``save``, write each one's rows to its result file as soon as it completes."""
    import importlib

    quiet()
    rows: list[Row] = []
    command = " ".join(["python", "benchmarks/run_all.py", *(names or [])])
    for key in names or list(BENCHMARKS):
        module = importlib.import_module(BENCHMARKS[key])
        print(f"\n{'=' * 30} {BENCHMARKS[key]} {'=' * 30}", flush=True)
        t0 = time.perf_counter()
        load_before = load_average()
        try:
            done = module.main()
        except Exception:  # report and go on with the other benchmarks
            traceback.print_exc()
            rows.append(Row(module.NAME, "FAILED (see traceback)", float("nan"), 0))
        else:
            rows += done
            if save:  # a failed benchmark keeps its earlier file
                save_results(module.NAME, done, [], command=command, load_before=load_before)
        print(f"[{module.NAME}] ran in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{versions_line()}")
    print_rows(rows, title="ALL BENCHMARKS")
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-save"]
    main(args or None, save="--no-save" not in sys.argv[1:])
