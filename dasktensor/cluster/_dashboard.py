"""The calls page: where the remote-call channel's calls show on the dashboard.

Calls through the channel skip the scheduler, so Dask's task stream cannot show them;
:func:`show_calls_page` adds ``/dasktensor/calls`` to the scheduler's dashboard
(``dt.connect`` and remote models do it).
"""

from __future__ import annotations

import warnings

from dasktensor._runtime import ProcessState, runtime


class _PagesShown(ProcessState):
    """The clients whose scheduler was given the calls page by this process."""

    def __init__(self):
        self.shown: set[tuple[int, str]] = set()


def show_calls_page(client) -> None:
    """Add the calls page to the cluster's dashboard, once per client and process.

    ``/dasktensor/calls`` (``dasktensor_worker.dashboard``) shows the channel's calls,
    which Dask's task stream cannot.  A scheduler that cannot load the page (no
    ``dasktensor_worker`` installed there) leaves the cluster working without it.
    """
    key = (id(client), client.scheduler.address)
    shown = runtime.state(_PagesShown).shown
    if key in shown:
        return
    shown.add(key)
    from dasktensor_worker.dashboard import CallsPage

    try:
        client.register_plugin(CallsPage())
    except Exception as e:  # the calls still work: say once what is missing
        warnings.warn(
            f"the dashboard's calls page could not be added to the scheduler at "
            f"{client.scheduler.address} ({type(e).__name__}: {e}); install dasktensor "
            "in the scheduler's environment to see remote calls on its dashboard",
            RuntimeWarning,
            stacklevel=3,
        )


def calls_link(client) -> str | None:
    """The address of the dashboard's calls page of ``client``'s cluster, or None.

    Remote-model calls and resident stages skip the scheduler, so Dask's task stream does
    not show them; this page does: a bar per call on each worker, and per model the
    calls, errors, calls in flight and mean time.  ``dt.connect()`` adds it to the
    dashboard (so does the first use of a remote model).

    Examples
    --------
    >>> import dasktensor as dt
    >>> client = dt.connect(n_workers=1, dashboard_address="127.0.0.1:0")  # doctest: +SKIP
    >>> dt.calls_link(client)  # doctest: +SKIP
    'http://127.0.0.1:38121/dasktensor/calls'
    """
    link = getattr(client, "dashboard_link", None)
    if not link or "dashboard" not in client.scheduler_info().get("services", {}):
        return None
    show_calls_page(client)
    return link.rsplit("/", 1)[0] + "/dasktensor/calls"
