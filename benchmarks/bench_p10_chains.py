"""P10: 8 NUTS chains on a 2-worker cluster with dt.sample, against pm.sample(cores=2).

A hierarchical model (50 groups x 200 observations, non-centred group means): 8 chains x
(500 tune + 500 draws), the same seed everywhere, in one run, rounds interleaved:

* ``pm.sample(chains=8, cores=2)``: PyMC's own multiprocess sampling on this host (2
  processes, where ``pm.sample`` is at home);
* ``dt.sample(chains=8)`` on a ``LocalCluster`` of 2 worker processes x 1 thread: the
  chains as Dask segments of ~``dasktensor.sample.segment-seconds`` each;
* ``dt.sample`` again, with one worker SIGKILLed halfway through the run (a callback at
  the draw where half of all draws are recorded); its nanny starts a new one.

Targets: dt / pm wall time <= 1.05 (parity on one host); the faulty run's extra time over
the run without fault <= one segment plus the worker's restart (both printed); the
faulty run's draws identical to the run without fault.  Also printed: whether dt's draws
equal pm.sample's (on PyTensor 3 a step method compiled in the sampling process and one
unpickled in another can differ in the last bits: see ``tests/_sample_models.py``).

Run: ``python benchmarks/bench_p10_chains.py [--rounds N] [--draws N] [--tune N]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, load_row, local_cluster, print_rows, quiet, versions_line

NAME = "p10-chains"
CHAINS = 8
SEED = 20261202


def model(groups: int = 50, per_group: int = 200):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(SEED)
    effects = rng.normal(size=groups)
    y = effects[:, None] + rng.normal(size=(groups, per_group))
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfNormal("tau", 2)
        z = pm.Normal("z", 0, 1, shape=(groups, 1))
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", mu + tau * z, sigma, observed=y)
    return m


def same_draws(a, b) -> bool:
    import numpy as np

    pa, pb = _posterior(a), _posterior(b)
    return all(np.array_equal(pa[v].values, pb[v].values) for v in ("mu", "tau", "z", "sigma"))


def _posterior(result):
    return result["posterior"].to_dataset() if hasattr(result, "children") else result.posterior


def main(rounds: int = 3, draws: int = 500, tune: int = 500) -> list[Row]:
    import pymc as pm

    import dasktensor as dt
    from dasktensor import _config

    quiet()
    print(f"[{NAME}] {versions_line()}")
    run = dict(draws=draws, tune=tune, chains=CHAINS, random_seed=SEED, progressbar=False,
               compute_convergence_checks=False)  # fmt: skip
    times: dict[str, list[float]] = {"pm": [], "dt": []}
    rows = [load_row(NAME)]
    with local_cluster(n_workers=2) as client:
        m = model()
        results = {}
        for r in range(rounds):
            for name in ("pm", "dt"):
                t0 = time.perf_counter()
                with m:
                    if name == "pm":
                        results[name] = pm.sample(**run, cores=2)
                    else:
                        results[name] = dt.sample(**run, client=client)
                times[name].append(time.perf_counter() - t0)
                print(f"[{NAME}] round {r}: {name} {times[name][-1]:.1f} s", flush=True)
        t_pm, t_dt = statistics.median(times["pm"]), statistics.median(times["dt"])

        killed: list = []
        half = CHAINS * (draws + tune) // 2
        recorded = [0]

        def kill_halfway(trace, draw):
            recorded[0] += 1
            if killed or recorded[0] < half:
                return
            running = [pid for pid in client.run(_executing_segment).values() if pid]
            if running:  # a worker running a segment now (not one queued there)
                os.kill(running[0], signal.SIGKILL)
                killed.append(time.perf_counter())

        t0 = time.perf_counter()
        with m:
            faulty = dt.sample(**run, client=client, callback=kill_halfway)
        t_fault = time.perf_counter() - t0
        restart = _restart_time(client)
        segment = _config.seconds("sample.segment-seconds")
        when = f"{killed[0] - t0:.1f} s" if killed else "(no worker was busy)"
        print(f"[{NAME}] a worker killed at {when}: {t_fault:.1f} s")
        rows += [
            Row(NAME, "pm.sample(chains=8, cores=2) (s), median", round(t_pm, 2)),
            Row(NAME, "dt.sample(chains=8), 2 workers (s), median", round(t_dt, 2)),
            Row(NAME, "dt / pm wall time", t_dt / t_pm, 1.05),
            Row(NAME, "dt.sample with a worker SIGKILLed halfway (s)", round(t_fault, 2)),
            Row(
                NAME,
                "extra time of the fault (s)",
                round(t_fault - t_dt, 2),
                round(segment + restart, 2),
            ),  # fmt: skip
            Row(NAME, "segment length (s) + worker restart (s)", round(segment + restart, 2)),
            Row(NAME, "a worker was killed (1/0)", int(bool(killed)), 1, True),
            Row(
                NAME,
                "draws identical with and without the fault (1/0)",
                int(same_draws(faulty, results["dt"])),
                1,
                True,
            ),  # fmt: skip
            Row(
                NAME,
                "draws identical to pm.sample's, same seed (1/0)",
                int(same_draws(results["dt"], results["pm"])),
            ),  # fmt: skip
        ]
    rows.append(load_row(NAME))
    print_rows(rows, title=f"[{NAME}] summary ({rounds} rounds, {tune} + {draws} draws)")
    return rows


def _executing_segment(dask_worker=None):
    """This worker's process id if it runs a chain's segment now, else None."""
    keys = [ts.key for ts in dask_worker.state.executing]
    return os.getpid() if any("chain_" in str(k) for k in keys) else None


def _restart_time(client) -> float:
    """Seconds from a worker's SIGKILL until its nanny's new worker has joined."""
    workers = client.run(os.getpid)
    address, pid = next(iter(workers.items()))
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while address in client.scheduler_info()["workers"] and time.perf_counter() - t0 < 30:
        time.sleep(0.01)
    client.wait_for_workers(len(workers), timeout=120)
    return time.perf_counter() - t0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--tune", type=int, default=500)
    args = parser.parse_args()
    main(rounds=args.rounds, draws=args.draws, tune=args.tune)
