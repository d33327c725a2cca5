"""``CallsPage``: the plugin that starts a scheduler's channel monitor and puts its page
on the scheduler's dashboard.

It imports no Bokeh, so that registering it costs a caller nothing (importing Bokeh took
0.4-0.7 s of a remote model's first call): the page's module
(:mod:`dasktensor_worker.dashboard`, Bokeh) is imported on the scheduler, and only if the
scheduler serves a Bokeh dashboard, which has imported Bokeh already.
"""

from __future__ import annotations

import sys

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktensor_worker.monitor import monitor_of


class CallsPage(SchedulerPlugin):
    """Start the scheduler's channel monitor, and put its page on the scheduler's
    dashboard if it runs one.

    Registered by remote models, ``dt.connect`` and ``dt.calls_link`` (idempotent);
    ``client.register_plugin(CallsPage())`` does it by hand.  It lives here, without
    Bokeh, so that registering it costs the caller nothing: Bokeh's import took 0.4-0.7
    s of a remote model's first call.  The page itself
    (:func:`dasktensor_worker.dashboard.add_page`) is added only on a scheduler serving
    a Bokeh dashboard, which has imported Bokeh already.

    Examples
    --------
    >>> import distributed
    >>> from dasktensor_worker.pages import CallsPage
    >>> local = dict(processes=False, n_workers=1, dashboard_address="127.0.0.1:0")
    >>> with distributed.Client(**local) as c:  # doctest: +SKIP
    ...     c.register_plugin(CallsPage())
    ...     print(c.dashboard_link.replace("/status", "/individual-dasktensor-calls"))
    http://127.0.0.1:.../individual-dasktensor-calls
    """

    name = "dasktensor-calls-page"
    idempotent = True

    async def start(self, scheduler) -> None:
        monitor_of(scheduler)
        if _serves_bokeh(scheduler):
            from dasktensor_worker.dashboard import add_page

            add_page(scheduler)


def _serves_bokeh(scheduler) -> bool:
    """Whether ``scheduler`` serves a Bokeh dashboard (nothing is imported to say so)."""
    routing = getattr(scheduler, "http_application", None)
    tornado = sys.modules.get("bokeh.server.tornado")
    if routing is None or tornado is None:
        return False
    return any(isinstance(a, tornado.BokehTornado) for a in routing.applications)
