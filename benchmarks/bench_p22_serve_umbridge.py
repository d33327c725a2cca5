"""P22 and P23: a Dask cluster as a UM-Bridge server, and NUTS through a simulator's vjp.

* **P22**: ``dt.serve_umbridge`` with a replica of a 50 ms model on each of 4 worker
  processes; 4 UM-Bridge clients (``umbridge.HTTPModel``, a thread each) call it back to
  back.  Throughput (requests/s) against one plain ``umbridge.serve_models`` server of the
  same model (its defaults: one request at a time, as for a model that is not
  thread-safe or holds the GIL): target >= 3.5.  The clients are processes of their own
  (a pool), as UQ codes calling a server are.  The ceiling, measured in the same run:
  the same 4 client processes sleeping 50 ms back to back (80 requests/s at best).
  The variants' blocks alternate (``_common.blocks``); medians over blocks.
* **P23**: NUTS on the worked ODE example (``docs/examples/lotka_volterra.py``,
  Lotka-Volterra), 2 chains x (300 tune + 300 draws), through a remote model with a vjp
  on the cluster against the same model written in PyTensor, same seed.  Target: equal
  to round-off.  Reported: the largest relative difference of the log-density and of its
  gradient over the draws' points; the first draw where the chains part by more than
  1e-6 (relative); the difference of the posterior means in Monte Carlo standard errors.

Run: ``python benchmarks/bench_p22_serve_umbridge.py``
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, blocks, load_row, local_cluster, print_rows, quiet, versions_line
from bench_p20_umbridge import DELAY, servers

NAME = "p22-serve-umbridge"
HERE = os.path.dirname(os.path.abspath(__file__))
CLIENTS = 4
CALLS = 5  # requests per client per block


def _client_calls(url: str | None) -> None:
    """In a client process: ``CALLS`` requests back to back to ``url`` (None: sleep as
    long instead, for the ceiling).  ``umbridge.HTTPModel`` per process, made once."""
    import umbridge

    if url is None:
        for _ in range(CALLS):
            time.sleep(DELAY)
        return
    model = _MODELS.get(url) or _MODELS.setdefault(url, umbridge.HTTPModel(url, "forward"))
    for _ in range(CALLS):
        assert model([[0.3, -0.2]], {"delay": DELAY}) == [[0.6, -0.4]]


_MODELS: dict = {}


def p22(client) -> list[Row]:
    import multiprocessing

    from _umbridge_server import Forward

    import dasktensor as dt

    # the clients are processes of their own, as UQ codes calling a model server are
    # (threads of this process would share its GIL with the server's threads)
    pool = multiprocessing.get_context("spawn").Pool(CLIENTS)

    def block_of(url):
        return lambda: pool.map(_client_calls, [url] * CLIENTS, chunksize=1)

    model = dt.RemoteModel(Forward, name="forward", scheduler=client)
    assert len(model.start()) == 4
    with servers(1, max_workers=1) as (plain,), dt.serve_umbridge(model, port=0) as ours:
        per_block = blocks(
            {"plain serve_models": block_of(plain), "dt.serve_umbridge": block_of(ours.url),
             "ceiling": block_of(None)},
            calls=1, rounds=7, warmup=1,
        )  # fmt: skip
    model.close()
    pool.close()
    pool.join()
    rate = {k: CLIENTS * CALLS / v for k, v in per_block.items()}
    print(f"[{NAME}] P22 requests/s (medians over blocks of {CLIENTS} client processes x "
          f"{CALLS} requests): " + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))  # fmt: skip
    return [
        Row(NAME, "P22 4 clients, 4 replicas: throughput / plain serve_models",
            rate["dt.serve_umbridge"] / rate["plain serve_models"], 3.5, True),
        Row(NAME, "P22 dt.serve_umbridge throughput / ceiling (4 sleeping clients)",
            rate["dt.serve_umbridge"] / rate["ceiling"]),
        Row(NAME, "P22 dt.serve_umbridge requests/s", rate["dt.serve_umbridge"]),
    ]  # fmt: skip


def p23(client) -> list[Row]:
    import cloudpickle
    import numpy as np
    import pymc as pm
    import pytensor.tensor as pt

    import dasktensor as dt

    sys.path.insert(0, os.path.join(HERE, "..", "docs", "examples"))
    import lotka_volterra as lv

    cloudpickle.register_pickle_by_value(lv)  # the workers do not have docs/examples

    model = dt.RemoteModel(lv.LotkaVolterra, name="lotka-volterra", scheduler=client)
    solve = model.arrays_to_arrays_op("solve", [pt.dvector], [pt.dvector], vjp="solve_vjp")
    runs = {"draws": 300, "tune": 300, "chains": 2, "cores": 1, "random_seed": 1,
            "progressbar": False, "compute_convergence_checks": False,
            "discard_tuned_samples": False}  # fmt: skip
    models, draws, walls = {}, {}, {}
    for name, op in (("pytensor", None), ("remote vjp", solve)):
        with lv.pymc_model(op) as models[name]:
            t0 = time.perf_counter()
            draws[name] = pm.sample(**runs)
            walls[name] = time.perf_counter() - t0
    fns = {k: m.compile_fn([m.logp(), m.dlogp()]) for k, m in models.items()}
    ref = draws["pytensor"].posterior
    points = [{"theta_log__": np.log(ref["theta"].values[c, d]),
               "sigma_log__": np.log(ref["sigma"].values[c, d])}
              for c in range(2) for d in range(0, 300, 3)]  # fmt: skip
    logp_rel = grad_rel = 0.0
    for p in points:
        (a, ga), (b, gb) = fns["pytensor"](p), fns["remote vjp"](p)
        logp_rel = max(logp_rel, abs(a - b) / abs(a))
        grad_rel = max(grad_rel, float(np.max(np.abs(ga - gb)) / np.max(np.abs(ga))))
    model.close()

    def chain(idata):
        both = [idata.warmup_posterior["theta"].values, idata.posterior["theta"].values]
        return np.concatenate(both, axis=1)  # (chain, tune + draws, 4)

    a, b = chain(draws["pytensor"]), chain(draws["remote vjp"])
    rel = np.max(np.abs(a - b) / np.abs(a), axis=2)  # (chain, draw)
    parted = [int(np.argmax(r > 1e-6)) if (r > 1e-6).any() else r.size for r in rel]
    import arviz as az

    # a Dataset in, a Dataset out on both lines (ArviZ 0.x gives a Dataset for a DataArray)
    mcse = az.mcse(draws["pytensor"].posterior[["theta"]])["theta"].values
    gap = np.abs(
        draws["pytensor"].posterior["theta"].mean(("chain", "draw")).values
        - draws["remote vjp"].posterior["theta"].mean(("chain", "draw")).values
    )
    print(f"[{NAME}] P23 walls: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))
    print(f"[{NAME}] P23 largest relative differences over {len(points)} draws' points: "
          f"log-density {logp_rel:.2e}, gradient {grad_rel:.2e}")  # fmt: skip
    print(f"[{NAME}] P23 first draw (of 600, tuning included) parting by > 1e-6: {parted}; "
          f"posterior means apart by {np.round(gap / mcse, 2)} MCSE")  # fmt: skip
    return [
        Row(NAME, "P23 log-density, largest relative difference", logp_rel, 1e-12),
        Row(NAME, "P23 gradient, largest relative difference", grad_rel, 1e-10),
        Row(NAME, "P23 first draw parting by > 1e-6 (of 600), earliest chain", min(parted)),
        Row(NAME, "P23 posterior means apart, largest (MCSE)", float(np.max(gap / mcse))),
    ]


def main() -> list[Row]:
    quiet()
    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    with local_cluster(4) as client:
        rows += p22(client)
        rows += p23(client)
    rows.append(load_row(NAME))
    print_rows(rows, title=NAME)
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
