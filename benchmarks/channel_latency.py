"""Latency of the ways a caller can reach a model on a worker (informs the remote-call channel).

One worker process; a 10-float log-density and its gradient; medians of repeated calls:

* ``client.submit(f, x).result()`` -- a task per call (the client batches its messages);
* a handler that a ``WorkerPlugin`` adds to ``worker.handlers``, called through a
  ``distributed.core.ConnectionPool`` on the client's event loop (``client.sync``);
* the same handler from a dedicated event loop.

Run: ``python benchmarks/channel_latency.py``
"""

from __future__ import annotations

import asyncio
import time

import numpy as np


def logp_and_grad(x):
    return -0.5 * float(x @ x), -x


def main(calls: int = 200) -> dict[str, float]:
    from distributed import Client, LocalCluster, WorkerPlugin
    from distributed.core import ConnectionPool

    class Handler(WorkerPlugin):
        name = "dasktensor-channel-probe"

        def setup(self, worker):
            async def call(x=None):
                lp, g = logp_and_grad(x)
                return {"logp": lp, "grad": g}

            worker.handlers["dasktensor_channel_probe"] = call

    x = np.random.default_rng(0).normal(size=10)
    results = {}
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address=None,
            # the scheduler's HTTP server would otherwise take port 8787
            scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(Handler())
        address = next(iter(client.scheduler_info()["workers"]))

        times = []
        for _ in range(calls // 4):
            t0 = time.perf_counter()
            client.submit(logp_and_grad, x, pure=False).result()
            times.append(time.perf_counter() - t0)
        results["submit().result()"] = float(np.median(times))

        pools = {}

        async def make_pool():
            pools["pool"] = await ConnectionPool(limit=4)

        async def one_call():
            return await pools["pool"](address).dasktensor_channel_probe(x=x)

        client.sync(make_pool)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            client.sync(one_call)
            times.append(time.perf_counter() - t0)
        results["handler via client loop"] = float(np.median(times))
        client.sync(pools["pool"].close)

        async def own_loop():
            pool = await ConnectionPool(limit=4)
            out = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await pool(address).dasktensor_channel_probe(x=x)
                out.append(time.perf_counter() - t0)
            await pool.close()
            return out

        results["handler via own loop"] = float(np.median(asyncio.run(own_loop())))

    base = results["submit().result()"]
    print(f"{'channel':<26} {'median':>10} {'vs submit':>10}")
    for name, seconds in results.items():
        print(f"{name:<26} {seconds * 1e3:>8.2f} ms {seconds / base:>10.3f}")
    return results


if __name__ == "__main__":
    main()
