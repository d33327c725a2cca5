"""The channel's page on Dask's dashboard: ``/individual-dasktensor-calls``.

Channel calls (remote models, resident stages, shards) skip the scheduler, so the task
stream does not show them.  This page is a Bokeh document like the dashboard's own
individual plots, fed by the scheduler's :class:`~dasktensor_worker.monitor.ChannelMonitor`:

* a stream of the calls per worker over the last 30 s: a time axis, a bar per call or batch
  (as long as it took, in its model's colour, red if it raised), and on hover its model,
  method, duration, batch size, worker and device;
* a table per model: calls, errors, calls in flight, mean time per call or batch, p99
  time, replicas, mean batch size, and where the replicas are: each one's worker and
  device (``tcp://10.0.0.5:40431: GPU 0 (NVIDIA H200)``, ``...: cpu``).

It is listed in ``/individual-plots.json``, so the dashboard's "More..." menu and
dask-labextension offer it as "Dasktensor Calls".  ``/dasktensor/calls`` redirects to it.

How it gets there:

* importing this module adds it to ``distributed.dashboard.scheduler.applications``,
  which a scheduler reads when it starts its dashboard: ``dt.connect()`` imports it before
  starting its local cluster, and ``dask scheduler --preload dasktensor_worker.dashboard``
  imports it before the dashboard starts (its ``dask_setup`` starts the monitor);
* a scheduler already running gets it when the monitor starts (:func:`add_page`: the
  first remote model on that cluster registers the monitor), added to its running Bokeh
  server.
"""

from __future__ import annotations

import time
from functools import partial
from urllib.parse import urljoin

from bokeh.layouts import column
from bokeh.models import (
    ColumnDataSource,
    DataTable,
    DatetimeTickFormatter,
    FactorRange,
    HoverTool,
    HTMLTemplateFormatter,
    NumberFormatter,
    Range1d,
    TableColumn,
)
from bokeh.palettes import Category10
from bokeh.plotting import figure
from tornado import web

from dasktensor_worker.monitor import monitor_of

#: the page's path on the dashboard (a Bokeh application)
PATH = "/individual-dasktensor-calls"
#: the address of the earlier hand-written page, which now redirects to PATH
OLD_PATH = "/dasktensor/calls"
#: seconds of calls the stream shows
SPAN = 30.0
ERROR = "#d62728"
PALETTE = [c for c in Category10[10] if c != ERROR]
#: a model's colour in the table, as a square (an HTMLTemplateFormatter's template; each
#: page makes its own formatter: a Bokeh model belongs to one document)
SWATCH = '<div style="background:<%= value %>;width:12px;height:12px;margin:5px 0"></div>'


class CallsView:
    """The Bokeh models of the page, updated from a monitor once a second."""

    def __init__(self, monitor, **kwargs):
        self.monitor = monitor
        self.number = max(0, monitor.numbered - 5_000)  # the newest calls already seen
        self.colours: dict[str, str] = {}
        self._shown = ""  # the table's rows, as shown
        self.calls = ColumnDataSource(
            {k: [] for k in ("x", "width", "worker", "device", "colour", "model", "method")}
            | {"ms": [], "size": []}
        )
        self.figure = figure(
            title="Calls through the channel (remote models, resident stages, shards)",
            x_axis_type="datetime",
            x_range=Range1d(time.time() * 1000 - SPAN * 1000, time.time() * 1000),
            y_range=FactorRange(factors=[]),
            height=300,
            tools="save",
            toolbar_location="above",
            sizing_mode="stretch_width",
            min_border_left=150,
            **kwargs,
        )
        bars = self.figure.rect(
            x="x",
            y="worker",
            width="width",
            height=0.7,
            fill_color="colour",
            line_color="colour",
            line_width=3,  # a call of a fraction of a millisecond still shows
            source=self.calls,
            name="calls",
        )
        bars.nonselection_glyph = None
        self.figure.add_tools(
            HoverTool(
                renderers=[bars],
                point_policy="follow_mouse",
                tooltips=[
                    ("model", "@model"),
                    ("method", "@method"),
                    ("time", "@ms{0.00} ms"),
                    ("calls in it", "@size"),
                    ("worker", "@worker"),
                    ("device", "@device"),
                ],
            )
        )
        self.figure.xgrid.visible = False
        self.figure.xaxis.formatter = DatetimeTickFormatter(
            seconds="%H:%M:%S", milliseconds="%H:%M:%S.%3N", minsec="%H:%M:%S", context=None
        )
        self.figure.yaxis.axis_label = "worker"
        self.models = ColumnDataSource(
            {
                k: []
                for k in (
                    "colour",
                    "model",
                    "calls",
                    "errors",
                    "inflight",
                    "mean",
                    "p99",
                    "replicas",
                    "batch",
                    "where",
                )
            }
        )
        ms = NumberFormatter(format="0.00")
        self.table = DataTable(
            source=self.models,
            columns=[
                TableColumn(
                    field="colour",
                    title="",
                    width=16,
                    formatter=HTMLTemplateFormatter(template=SWATCH),
                ),
                TableColumn(field="model", title="model"),
                TableColumn(field="calls", title="calls"),
                TableColumn(field="errors", title="errors"),
                TableColumn(field="inflight", title="in flight"),
                TableColumn(field="mean", title="mean (ms)", formatter=ms),
                TableColumn(field="p99", title="p99 (ms)", formatter=ms),
                TableColumn(field="replicas", title="replicas"),
                TableColumn(field="batch", title="mean batch", formatter=ms),
                TableColumn(field="where", title="replicas on (worker: device)", width=400),
            ],
            index_position=None,
            height=200,
            sizing_mode="stretch_width",
            name="models",
        )
        self.root = column(self.figure, self.table, sizing_mode="stretch_both")

    def colour(self, name: str, status: str) -> str:
        if status != "OK":
            return ERROR
        if name not in self.colours:
            self.colours[name] = PALETTE[len(self.colours) % len(PALETTE)]
        return self.colours[name]

    def update(self) -> None:
        monitor = self.monitor
        monitor.watched_until = time.time() + 3 * monitor.interval  # fetch the calls
        new = [r for r in list(monitor.records) if r[0] > self.number]
        if new:
            self.number = new[-1][0]
            rows = {k: [] for k in self.calls.data}
            for _, worker, (name, method, start, stop, status, size) in new:
                rows["x"].append((start + stop) / 2 * 1000)
                rows["width"].append((stop - start) * 1000)
                rows["worker"].append(worker)
                rows["device"].append(monitor.device(worker))
                rows["colour"].append(self.colour(name, status))
                rows["model"].append(name if status == "OK" else f"{name} (raised)")
                rows["method"].append(method)
                rows["ms"].append((stop - start) * 1000)
                rows["size"].append(size)
            self.calls.stream(rows, rollover=5_000)
        workers = sorted(set(monitor.replies) | set(self.calls.data["worker"]))
        if list(self.figure.y_range.factors) != workers:
            self.figure.y_range.factors = workers
        models = monitor.models()
        names = sorted(models)
        for name in names:
            self.colour(name, "OK")
        rows = {
            "colour": [self.colours[n] for n in names],
            "model": names,
            "calls": [models[n]["calls"] for n in names],
            "errors": [models[n]["errors"] for n in names],
            "inflight": [models[n]["inflight"] for n in names],
            "mean": [_ms(models[n]["seconds"], models[n]["evaluations"]) for n in names],
            "p99": [_ms(models[n]["p99"] or 0.0, 1 if models[n]["p99"] else 0) for n in names],
            "replicas": [models[n]["replicas"] for n in names],
            "batch": [_ratio(models[n]["calls"], models[n]["evaluations"]) for n in names],
            "where": [_where(models[n]["devices"]) for n in names],
        }
        if repr(rows) != self._shown:  # (repr: NaN equals itself there)
            self._shown = repr(rows)
            self.models.data.update(rows)
            # Bokeh's table redraws when its rows' indices change, not their values:
            # a change of one of its properties redraws it
            self.table.tags = [self.table.tags[0] + 1 if self.table.tags else 1]
        # the last SPAN seconds, or less when the calls began later (at least 5 s)
        end = time.time() * 1000
        xs, widths = self.calls.data["x"], self.calls.data["width"]
        first = min((x - w / 2 for x, w in zip(xs, widths, strict=True)), default=end) - 500
        start = min(max(end - SPAN * 1000, first), end - 5_000)
        self.figure.x_range.start, self.figure.x_range.end = start, end


def _ms(seconds: float, n: int) -> float:
    return float("nan") if not n else 1000 * seconds / n


def _where(devices: dict) -> str:
    """``"tcp://...:40431: GPU 0 (NVIDIA H200); tcp://...:40432: cpu"``: a model's
    replicas, by worker, with the device each runs on.

    >>> _where({"tcp://b:2": "cpu", "tcp://a:1": "GPU 0 (H200)"})
    'tcp://a:1: GPU 0 (H200); tcp://b:2: cpu'
    """
    return "; ".join(f"{w}: {d}" for w, d in sorted(devices.items()))


def _ratio(calls: int, evaluations: int) -> float:
    return float("nan") if not evaluations else calls / evaluations


def calls_doc(scheduler, extra, doc) -> None:
    """The page's Bokeh document (what the dashboard serves at :data:`PATH`)."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME

    monitor = monitor_of(scheduler)  # (started here when the page opens first)
    page = CallsView(monitor)
    page.update()
    add_periodic_callback(doc, page, int(monitor.interval * 1000))
    doc.add_root(page.root)
    doc.theme = BOKEH_THEME
    doc.title = "Dask: dasktensor calls"


def _install() -> None:
    """List the page among the dashboard's applications (read when a scheduler starts
    its dashboard)."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:  # no Bokeh on this side
        return
    dashboard.applications.setdefault(PATH, calls_doc)


_install()


def add_page(scheduler) -> None:
    """Give a running scheduler's dashboard the page (if it lacks it) and the redirect
    from :data:`OLD_PATH`.  A scheduler without a dashboard gets nothing."""
    routing = getattr(scheduler, "http_application", None)
    if routing is None:
        return
    from bokeh.server.tornado import BokehTornado

    bokeh = next((a for a in routing.applications if isinstance(a, BokehTornado)), None)
    if bokeh is None:
        return
    prefix = bokeh._prefix  # "" or "/prefix"
    if PATH not in bokeh.app_paths:
        _add_application(bokeh, PATH, partial(calls_doc, scheduler, {"prefix": prefix}))
        _list_in_menu(scheduler)
    if not getattr(scheduler, "_dasktensor_redirect", False):
        target = urljoin(prefix.rstrip("/") + "/", PATH.lstrip("/"))
        routing.add_application(
            web.Application([(prefix + OLD_PATH + "/?", web.RedirectHandler, {"url": target})])
        )
        scheduler._dasktensor_redirect = True


def _add_application(bokeh, path: str, make_doc) -> None:
    """Add a Bokeh application to a running ``BokehTornado`` (its constructor's work
    for one more path: a context, the per-application routes, its static route)."""
    from bokeh.application import Application
    from bokeh.application.handlers.function import FunctionHandler
    from bokeh.server.contexts import ApplicationContext
    from bokeh.server.tornado import create_static_handler
    from bokeh.server.urls import per_app_patterns

    app = Application(FunctionHandler(make_doc))
    context = ApplicationContext(app, url=path, logout_url=None)
    context._loop = bokeh._loop
    routes = []
    for pattern, handler in per_app_patterns:
        routes.append((bokeh._prefix + path + pattern, handler, {"application_context": context}))
    websocket = next(r[0] for r in routes if r[0].endswith("/ws"))
    for route in routes:
        route[2]["bokeh_websocket_path"] = websocket
    routes.append(create_static_handler(bokeh._prefix, path, app))
    bokeh._applications[path] = context
    bokeh.add_handlers(r".*", routes)


def _list_in_menu(scheduler) -> None:
    """Add the page to the "More..." menu of the dashboard's own pages (the menu is
    made once per scheduler, when its dashboard starts)."""
    try:
        from distributed.dashboard.scheduler import template_variables
    except ImportError:
        return
    plots = template_variables(scheduler)["plots"]
    url = PATH.strip("/")
    if not any(p["url"] == url for p in plots):
        plots.append({"url": url, "name": "Dasktensor Calls"})
        plots.sort(key=lambda p: p["name"])


async def dask_setup(scheduler) -> None:
    """``dask scheduler --preload dasktensor_worker.dashboard``: start the channel
    monitor (the import of this module has listed the page already), and the redirect;
    what ``dasktensor_worker.pages.CallsPage``, which clients register, does too."""
    monitor_of(scheduler)
    add_page(scheduler)
