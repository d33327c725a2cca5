"""Adaptive scaling that sees the channel's calls: ``dt.Adaptive``.

Dask's ``Adaptive`` asks the scheduler for a target number of workers from the tasks it
schedules; calls through the channel (remote models, resident stages, shards) are not
tasks, so a cluster serving eight busy samplers looks idle to it.  :class:`Adaptive`
adds the channel's demand, as the scheduler's channel monitor
(``dasktensor_worker.monitor.ChannelMonitor``) measures it, to Dask's own target.
Scale-down goes through Dask's ``workers_to_close``, which asks the scheduler's plugins
which workers may go: the monitor keeps the workers with calls in flight and the last
holder of a model in use.
"""

from __future__ import annotations

import logging

from distributed.deploy.adaptive import Adaptive as DaskAdaptive
from distributed.protocol.pickle import dumps

from dasktensor_worker.monitor import DEMAND_HANDLER, ChannelMonitor

logger = logging.getLogger(__name__)


class Adaptive(DaskAdaptive):
    """Dask's ``Adaptive``, with the demand of the remote-call channel added.

    Use it where a cluster's ``adapt`` takes Dask's: ``cluster.adapt(Adaptive=dt.Adaptive,
    minimum=1, maximum=8)`` (``LocalCluster``, dask-jobqueue's and dask-kubernetes'
    clusters).  Its target is the larger of Dask's (tasks and memory) and the channel's:
    for each remote model or stage with a replica on every worker (no ``replicas=``
    limit), the most calls in flight (running or waiting) in the last 5 s over the calls
    one replica runs at once (its ``concurrency``).  A worker that joins gets replicas
    at its callers' next look at the cluster (``dasktensor.remote.refresh-interval``,
    5 s).  Scale-down retires idle workers as Dask's does, but not one with calls in
    flight, nor the last holder of a model that answered a call in the last 30 s; a
    call caught by a retiring worker is retried elsewhere by its caller.

    Parameters
    ----------
    cluster, interval, minimum, maximum, wait_count, target_duration, **kwargs
        Those of ``distributed.deploy.Adaptive``.

    Examples
    --------
    >>> import dasktensor as dt
    >>> from distributed import LocalCluster
    >>> cluster = LocalCluster(n_workers=1, dashboard_address=":0")  # doctest: +SKIP
    >>> cluster.adapt(Adaptive=dt.Adaptive, minimum=1, maximum=4)  # doctest: +SKIP
    <dasktensor.cluster._adaptive.Adaptive object at 0x...>
    """

    async def target(self) -> int:
        """Workers wanted: the larger of Dask's target and the channel's demand."""
        try:
            demand = await getattr(self.scheduler, DEMAND_HANDLER)()
        except Exception:  # no monitor on the scheduler yet: start one, ask next time
            await self._start_monitor()
            return await super().target()
        if demand["tasks"] == 0 and demand["memory"] <= 0.6:
            # Dask's own rule asks for no worker then (no task, memory under 60 %); its
            # answer, once below the workers there are, is how many it would keep after
            # closing the idle ones it may: with a busy worker kept by the monitor, a
            # last idle one holding any data would be kept for memory's sake
            tasks = 0
        else:
            tasks = await super().target()
        return max(tasks, int(demand["target"]))

    async def _start_monitor(self) -> None:
        try:
            await self.scheduler.register_scheduler_plugin(
                plugin=dumps(ChannelMonitor()), name=ChannelMonitor.name, idempotent=True
            )
        except Exception:
            logger.warning(
                "dt.Adaptive could not start the channel monitor on the scheduler (is "
                "dasktensor installed there?); scaling on Dask's tasks alone",
                exc_info=True,
            )
