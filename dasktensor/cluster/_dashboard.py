"""The channel on Dask's own tools: the dashboard page, the metrics, the demand.

Calls through the channel skip the scheduler, so Dask's task stream, ``/metrics`` and
``Adaptive`` cannot see them.  :func:`show_calls_page` registers the scheduler plugin
that gathers them (``dasktensor_worker.monitor.ChannelMonitor``), which adds the page
``/individual-dasktensor-calls`` to the dashboard, the ``dasktensor_*`` metrics to
``/metrics`` and the demand that ``dt.Adaptive`` reads (``dt.connect`` and remote
models do it).
"""

from __future__ import annotations

import warnings

from dasktensor._runtime import ProcessState, runtime

#: the page's path on the dashboard (dasktensor_worker.dashboard.PATH, without Bokeh)
PAGE = "/individual-dasktensor-calls"


class _PagesShown(ProcessState):
    """The clients whose scheduler was given the channel monitor by this process."""

    def __init__(self):
        self.shown: set[tuple[int, str]] = set()


def list_the_page() -> None:
    """List the page among the dashboard's applications, for the schedulers this
    process starts from now on (``dt.connect``'s local cluster); nothing without Bokeh."""
    try:
        import dasktensor_worker.dashboard  # noqa: F401  (lists the page on import)
    except ImportError:
        pass


def show_calls_page(client) -> None:
    """Start the channel monitor on the cluster's scheduler, and add its page to the
    dashboard, once per client and process.

    The monitor (``dasktensor_worker.monitor``) gathers the workers' call logs and
    shows them on the dashboard (``/individual-dasktensor-calls``) and on ``/metrics``,
    and tells ``dt.Adaptive`` the channel's demand.  A scheduler that cannot load it (no
    ``dasktensor_worker`` installed there) leaves the cluster working without it.
    """
    key = (id(client), client.scheduler.address)
    shown = runtime.state(_PagesShown).shown
    if key in shown:
        return
    shown.add(key)
    from dasktensor_worker.pages import CallsPage  # (no Bokeh: the scheduler's business)

    try:
        client.register_plugin(CallsPage())
    except Exception as e:  # the calls still work: say once what is missing
        warnings.warn(
            f"the channel monitor (the dashboard's calls page, the dasktensor metrics, "
            f"dt.Adaptive's demand) could not be added to the scheduler at "
            f"{client.scheduler.address} ({type(e).__name__}: {e}); install dasktensor "
            "in the scheduler's environment to see remote calls on its dashboard",
            RuntimeWarning,
            stacklevel=3,
        )


def calls_link(client) -> str | None:
    """The address of the dashboard's calls page of ``client``'s cluster, or None.

    Remote-model calls, resident stages and shards skip the scheduler, so Dask's task
    stream does not show them; this page does: a bar per call or batch on each worker
    (hover for model, method, time, batch size, worker and its device), and per model
    the calls, errors, calls in flight, mean and p99 time, replicas, mean batch size and
    the replicas' workers with their devices (``GPU 0 (NAME)`` or ``cpu``).  It is
    listed in the dashboard's "More..." menu as "Dasktensor Calls"; ``dt.connect()``
    adds it (so does the first use of a remote model).

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1, dashboard_address="127.0.0.1:0")  # doctest: +SKIP
    >>> dt.calls_link(client)  # doctest: +SKIP
    'http://127.0.0.1:38121/individual-dasktensor-calls'
    """
    link = getattr(client, "dashboard_link", None)
    if not link or "dashboard" not in client.scheduler_info().get("services", {}):
        return None
    show_calls_page(client)
    return link.rsplit("/", 1)[0] + PAGE
