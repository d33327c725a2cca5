"""P9: automatic sharding of sums over data rows, on a 2-process cluster.

Two PyMC models whose log-density and gradient are sums over many observed rows:

* **linreg**: a linear regression with 2,000,000 rows (``X``: 2M x 3, ``y``);
* **hier-logit**: a hierarchical logistic regression with 1,000,000 rows, 3 covariates
  and 20 groups (``logit_p = a[group] + X @ beta``, a non-centred ``a``).

Each model's ``logp_dlogp_function(ravel_inputs=True)`` (what ``pm.sample`` compiles) is
compiled twice: in the default mode, and in the DASK mode on a ``LocalCluster`` of 2 worker
processes x 1 thread (BLAS 1 thread everywhere).  The DASK mode finds that the outputs are
sums over the rows and splits them into one shard per worker: each worker keeps its half
of the rows in a resident stage and computes its partial sums; the caller sends the
parameters only, adds the partial values and runs the rest.

Timed as a sampler calls the function: blocks of back-to-back evaluations, the variants'
blocks alternating (the cluster idle during the default mode's block), with the
machine's ceiling measured in the same run: each half of the rows evaluated on its own
worker by the shard itself, both workers at once, no messages.  Reported: time per
evaluation, the speed-up default/sharded, the ceiling default/shards' work, and the
share of the ceiling the sharded path reaches (target >= 0.9); bytes sent per
evaluation; the first call (building the shards: data sent once, partial graph compiled
on the workers).  (An earlier version interleaved single calls of the two variants, which
slowed the default mode's calls -- 11-12.8 ms instead of 7.3 ms for linreg -- and
overstated the speed-up as 1.66-1.93x.)

Then (``--no-sample`` skips it) ``pm.sample`` of the linear regression, 1 chain,
``--tune``/``--draws`` 300 each, in both modes with the same seed: wall-clock time and
the largest difference between the draws (sharding changes the order of additions, so
draws agree to round-off rather than bit for bit).

Run: ``python benchmarks/bench_p9_sharding.py [--no-sample] [--draws N] [--tune N] [--workers N]
[--rows N]`` (the 8-worker case of a 16-core machine: ``--workers 8 --rows 20000000``)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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
    worker_blas_threads,
)

NAME = "p9-sharding"
SEED = 20261201


def linreg(n: int = 2_000_000):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(SEED)
    X = rng.normal(size=(n, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3 + rng.normal(size=n)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        alpha = pm.Normal("alpha", 0, 1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", X @ beta + alpha, sigma, observed=y)
    return model


def hier_logit(n: int = 1_000_000, groups: int = 20):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(SEED + 1)
    X = rng.normal(size=(n, 3))
    group = rng.integers(0, groups, size=n)
    a_true = rng.normal(scale=0.5, size=groups)
    p = 1 / (1 + np.exp(-(a_true[group] + X @ np.array([0.5, -1.0, 0.25]))))
    y = (rng.uniform(size=n) < p).astype("int64")
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=3)
        mu_a = pm.Normal("mu_a", 0, 1)
        sigma_a = pm.HalfNormal("sigma_a", 1)
        z = pm.Normal("z", 0, 1, shape=groups)
        a = mu_a + sigma_a * z
        pm.Bernoulli("y", logit_p=a[group] + X @ beta, observed=y)
    return model


def _held(keys, dask_worker=None) -> int:
    """On a worker: bytes of data held by the shard stages among ``keys``."""
    host = dask_worker.plugins.get("dasktensor-models")
    replicas = getattr(host, "replicas", {})
    return sum(r.model.held for k, r in replicas.items() if k in keys)


def _shard_block(keys, args, calls, start, dask_worker=None) -> float:
    """On a worker: seconds of ``calls`` back-to-back evaluations of its shard's partial
    values, started at ``start`` (``time.time()``) so that both workers run at once."""
    host = dask_worker.plugins.get("dasktensor-models")
    [server] = [r.model for k, r in host.replicas.items() if k in keys]
    server.run(*args)
    time.sleep(max(0.0, start - time.time()))
    t0 = time.perf_counter()
    for _ in range(calls):
        server.run(*args)
    return time.perf_counter() - t0


def _send_once(client, stages) -> float:
    """Seconds to pickle and send every shard's rows once, straight to its worker, all at
    once (what a first evaluation cannot do with less)."""
    from concurrent.futures import ThreadPoolExecutor

    def send(i):
        rows, worker = stages.models[i]._spec.factory.rows, stages.built[i]
        return client.scatter(rows, workers=[worker], direct=True, hash=False)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(stages.models)) as pool:
        futures = [f for sent in pool.map(send, range(len(stages.models))) for f in sent]
    took = time.perf_counter() - t0
    client.cancel(futures)
    return took


def _shard_records(since, dask_worker=None) -> list:
    """On a worker: ``(start, stop)`` of its shard calls that ended after ``since``."""
    records = dask_worker.plugins["dasktensor-models"].calls.since(since)["records"]
    return [(r[2], r[3]) for r in records if r[0] == "shard"]


#: the stages of a sharded evaluation, in order (see :func:`breakdown`)
STAGES = (
    ("caller, before the sends", "the thunk, finding the shards, the parameters"),
    ("to the shards", "pickle, send, the worker's thread wakes, unpickle (mean over shards)"),
    ("shard's own work", "the partial graph over the shard's rows (mean over shards)"),
    ("waiting for the slowest shard", "the last shard's end after the mean shard's end"),
    ("replies", "the last reply's way back, read by the caller"),
    ("caller, after the replies", "reduce the partial values, run the combine graph"),
)


def breakdown(label, f, client, q, calls: int) -> dict[str, float]:
    """Where the time of one sharded evaluation goes, from ``calls`` back-to-back
    evaluations: the caller's timestamps (``ShardedExecutor.trace``) and the workers' call
    logs (each shard call's start and stop), on one machine's clock.  Medians per
    evaluation, in seconds, keyed as :data:`STAGES`."""
    import statistics

    ex = f.maker.linker.sharded
    ex.trace = trace = []
    t0 = time.time()
    for _ in range(calls):
        f(q)
    ex.trace = None
    runs = sorted(r for found in client.run(_shard_records, t0).values() for r in found)
    parts: dict[str, list[float]] = {name: [] for name, _ in STAGES}
    for called, sent, answered, done in trace:
        mine = [(a, b) for a, b in runs if sent <= a <= answered]
        if not mine:  # (a record lost to the log's length: skip the evaluation)
            continue
        ends = [b for _, b in mine]
        mean_end = statistics.mean(ends)
        values = (
            sent - called,
            statistics.mean(a for a, _ in mine) - sent,
            statistics.mean(b - a for a, b in mine),
            max(ends) - mean_end,
            answered - max(ends),
            done - answered,
        )
        for (name, _), v in zip(STAGES, values):
            parts[name].append(v)
    medians = {name: statistics.median(v) for name, v in parts.items()}
    total = statistics.median(d - c for c, _, _, d in trace)
    print(
        f"\n{label}: one sharded evaluation, median of {len(trace)} back to back "
        f"({total * 1e3:.2f} ms)"
    )
    for name, why in STAGES:
        print(f"  {name:<31} {medians[name] * 1e3:7.3f} ms   {why}")
    return medians


def evaluations(label, make, client, calls, rounds) -> list[Row]:
    """Per-evaluation rows of one model: default vs DASK sharded vs the machine's ceiling,
    in alternating blocks of back-to-back evaluations (as a sampler calls them)."""
    import statistics

    import numpy as np

    import dasktensor as dt

    model = make()
    ref = model.logp_dlogp_function(ravel_inputs=True)._pytensor_function
    vgf = model.logp_dlogp_function(ravel_inputs=True, mode=dt.dask_mode(scheduler=client))
    f = vgf._pytensor_function
    linker = f.maker.linker
    q = np.random.default_rng(1).normal(scale=0.1, size=f.maker.fgraph.inputs[0].type.shape)
    t0 = time.perf_counter()
    got = f(q)
    first = time.perf_counter() - t0
    if linker.sharded is None or not linker.sharded.stages():
        print(
            f"\n[{NAME}] {label}: not sharded (fewer rows than the settings ask):\n{linker.plan}"
        )
        return [Row(NAME, f"{label}: shards", 0)]
    made = linker.sharded.stages()[0].timings
    sent_once = _send_once(client, linker.sharded.stages()[0])
    print(f"\n[{NAME}] {label}: {linker.plan}")
    print(
        f"{label}: first call {first:.2f} s: hashing the data {made['hash']:.2f} s, building "
        f"the shards (rows sent, compiled with the first call's values) {made['build']:.2f} s, "
        f"the rest {first - made['hash'] - made['build']:.2f} s; sending the shards' rows once "
        f"(client.scatter, straight to their workers) {sent_once:.2f} s"
    )
    for g, w in zip(got, ref(q)):
        np.testing.assert_allclose(g, w, rtol=1e-10)
    stats = dict(linker.sharded.stats)
    keys = [m.key for s in linker.sharded.stages() for m in s.models]
    args = [q, *linker.sharded.split.plan.guesses()]

    def default():
        for _ in range(calls):
            ref(q)

    def sharded():
        for _ in range(calls):
            f(q)

    def ceiling():  # each half of the rows on its own worker, both at once, no messages
        return max(client.run(_shard_block, keys, args, calls, time.time() + 0.2).values())

    timed: dict[str, list[float]] = {"default (1 process)": [], "DASK sharded (2 procs)": []}
    timed["ceiling (shards' own work)"] = []
    for _ in range(2):  # warm-up
        default(), sharded(), ceiling()
    for r in range(rounds):
        for name in list(timed) if r % 2 == 0 else list(reversed(timed)):
            if name.startswith("ceiling"):
                timed[name].append(ceiling() / calls)
                continue
            t0 = time.perf_counter()
            (default if name.startswith("default") else sharded)()
            timed[name].append((time.perf_counter() - t0) / calls)
    times = {k: statistics.median(v) for k, v in timed.items()}
    print_ratio_table(times, "default (1 process)", title=f"{label}: median per evaluation")
    print(
        f"{label}: blocks of {calls} back-to-back evaluations, {rounds} per variant in "
        "alternating order; the ceiling: each shard's own work, both workers at once"
    )
    parts = breakdown(label, f, client, q, max(calls, 50))
    done = linker.sharded.stats
    per_eval = (done["bytes_sent"] - stats["bytes_sent"]) / (done["calls"] - stats["calls"])
    held = client.run(_held, keys)
    t_ref, t_dask, t_ceil = (times[k] for k in timed)
    return [
        Row(NAME, f"{label}: shards", len(keys)),
        Row(NAME, f"{label}: default per eval", t_ref, unit="s"),
        Row(NAME, f"{label}: DASK sharded per eval", t_dask, unit="s"),
        Row(NAME, f"{label}: ceiling per eval (the shards' own work)", t_ceil, unit="s"),
        Row(NAME, f"{label}: speed-up default/sharded", t_ref / t_dask),
        Row(NAME, f"{label}: ceiling default/shards' work", t_ref / t_ceil),
        Row(
            NAME, f"{label}: share of the ceiling (ceiling / sharded)", t_ceil / t_dask, 0.9, True
        ),
        Row(NAME, f"{label}: sharded minus the shards' work", t_dask - t_ceil, unit="s"),
        *(Row(NAME, f"{label}: breakdown: {name}", v, unit="s") for name, v in parts.items()),
        Row(NAME, f"{label}: bytes sent per eval", per_eval, 1024, unit=" B"),
        Row(NAME, f"{label}: data held by the shards (MB)", round(sum(held.values()) / 1e6, 1)),
        Row(NAME, f"{label}: first call (build shards)", first, unit="s"),
        Row(NAME, f"{label}: first call: hashing the data", made["hash"], unit="s"),
        Row(NAME, f"{label}: first call: building the shards", made["build"], unit="s"),
        Row(NAME, f"{label}: sending the shards' rows once", sent_once, unit="s"),
    ]


def sampling(client, draws: int, tune: int, rows: int = 2_000_000) -> list[Row]:
    """pm.sample of the linear regression, default mode vs DASK sharded."""
    import numpy as np
    import pymc as pm

    import dasktensor as dt

    def run(mode):
        model = linreg(rows)
        kwargs = {} if mode is None else {"compile_kwargs": {"mode": mode}}
        t0 = time.perf_counter()
        with model:
            idata = pm.sample(
                draws=draws,
                tune=tune,
                chains=1,
                cores=1,
                random_seed=SEED,
                progressbar=False,
                compute_convergence_checks=False,
                nuts_sampler="pymc",
                **kwargs,
            )
        elapsed = time.perf_counter() - t0
        post = idata.posterior
        return elapsed, {v: np.asarray(post[v].values) for v in ("beta", "alpha", "sigma")}

    t_ref, ref = run(None)
    t_dask, got = run(dt.dask_mode(scheduler=client))
    diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    same = all(np.array_equal(got[k], ref[k]) for k in ref)
    print(f"[{NAME}] pm.sample {tune}+{draws}: default {t_ref:.1f} s, DASK {t_dask:.1f} s")
    return [
        Row(NAME, "linreg pm.sample: default (s)", round(t_ref, 1)),
        Row(NAME, "linreg pm.sample: DASK sharded (s)", round(t_dask, 1)),
        Row(NAME, "linreg pm.sample: speed-up", t_ref / t_dask),
        Row(NAME, "linreg pm.sample: draws identical (1/0)", int(same)),
        Row(NAME, "linreg pm.sample: draws max abs diff (x 1e-9)", diff * 1e9),
    ]


def main(
    sample: bool = True,
    draws: int = 300,
    tune: int = 300,
    calls: int = 20,
    rounds: int = 7,
    workers: int = 2,
    rows: int = 2_000_000,
) -> list[Row]:
    quiet()
    print(f"[{NAME}] {versions_line()}")
    out: list[Row] = [load_row(NAME)]
    with limit_blas(1):
        print(f"client BLAS threads: {blas_threads()}")
        with local_cluster(n_workers=workers, threads_per_worker=1) as client:
            print(f"worker BLAS threads: {worker_blas_threads(client)}; {workers} workers")
            out += evaluations(
                f"linreg {rows / 1e6:g}M", lambda: linreg(rows), client, calls, rounds
            )
            out += evaluations(
                f"hier-logit {rows / 2e6:g}M", lambda: hier_logit(rows // 2), client, calls, rounds
            )
            if sample:
                out += sampling(client, draws, tune, rows)
    out.append(load_row(NAME))
    print_rows(out, title=f"[{NAME}] summary")
    return out


if __name__ == "__main__":
    from _common import save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sample", action="store_true", help="skip pm.sample")
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--tune", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument(
        "--rows", type=int, default=2_000_000, help="rows of linreg (2,000,000; hier-logit: half)"
    )
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    rows = main(
        sample=not args.no_sample,
        draws=args.draws,
        tune=args.tune,
        workers=args.workers,
        rows=args.rows,
    )
    if not args.no_save:
        save_results(NAME, rows)
