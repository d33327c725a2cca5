"""The calls page: remote-model calls and resident stages on the scheduler's dashboard.

Channel calls skip the scheduler, so the task stream does not show them.  This scheduler
plugin adds two routes to the dashboard's web server (the one serving ``/status``):

* ``/dasktensor/calls``: a page that looks like the task stream: one row per worker, a
  bar per call or batch of a batched method (its model's colour, as long as it took, red
  if it raised; its title gives the batch size), and a table per model: calls, errors,
  calls in flight, mean time per call or batch, mean batch size, and which workers
  answered;
* ``/dasktensor/calls.json``: what the page reads every second, gathered from every
  worker's call log (:mod:`dasktensor_worker.calllog`) with one broadcast.

``RemoteModel`` registers the plugin (idempotent) the first time it finds its replicas on
a cluster; ``client.register_plugin(CallsPage())`` does it by hand.  A scheduler without
a dashboard gets no page.  The page is plain HTML and JavaScript: no Bokeh needed.
"""

from __future__ import annotations

import json

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from dasktensor_worker.calllog import LOG_HANDLER

#: where the page lives on the dashboard
PAGE = "/dasktensor/calls"


class CallsPage(SchedulerPlugin):
    """Serve ``/dasktensor/calls`` from the scheduler's dashboard.

    Examples
    --------
    >>> import distributed
    >>> from dasktensor_worker.dashboard import CallsPage
    >>> local = dict(processes=False, n_workers=1, dashboard_address="127.0.0.1:0")
    >>> with distributed.Client(**local) as c:  # doctest: +SKIP
    ...     c.register_plugin(CallsPage())
    ...     print(c.dashboard_link.replace("/status", "/dasktensor/calls"))
    http://127.0.0.1:.../dasktensor/calls
    """

    name = "dasktensor-calls-page"
    idempotent = True

    def __init__(self):
        self._app = None
        self._routing = None

    async def start(self, scheduler) -> None:
        routing = getattr(scheduler, "http_application", None)
        if routing is None:  # no dashboard on this scheduler
            return
        args = {"scheduler": scheduler}
        self._app = web.Application(
            [(PAGE, _PageHandler), (PAGE + ".json", _RecordsHandler, args)]
        )
        self._routing = routing
        routing.add_application(self._app)

    async def close(self) -> None:
        if self._routing is not None and self._app in self._routing.applications:
            self._routing.applications.remove(self._app)


class _PageHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(_HTML)


class _RecordsHandler(web.RequestHandler):
    def initialize(self, scheduler):
        self.scheduler = scheduler

    async def get(self):
        since = float(self.get_argument("since", "0"))
        replies = await self.scheduler.broadcast(
            msg={"op": LOG_HANDLER, "since": since}, on_error="return"
        )
        workers = {a: r for a, r in replies.items() if isinstance(r, dict)}
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"workers": workers}))


_HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dasktensor: remote calls</title>
<style>
 body { font-family: sans-serif; margin: 1em; color: #222; }
 h1 { font-size: 1.2em; } table { border-collapse: collapse; margin-top: 1em; }
 td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #ddd; }
 td:first-child, th:first-child { text-align: left; } .swatch { display: inline-block;
 width: 10px; height: 10px; margin-right: 6px; } #stream text { font-size: 11px; }
</style></head><body>
<h1>dasktensor: calls of remote models and resident stages (last <span id="span">30</span> s)</h1>
<p id="status">waiting for the workers...</p>
<svg id="stream" width="1000" height="40"></svg>
<table id="models"><thead><tr><th>model</th><th>calls</th><th>errors</th>
<th>in flight</th><th>mean time</th><th>mean batch</th><th>workers</th></tr></thead>
<tbody></tbody></table>
<script>
const SPAN = 30, PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b",
  "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
const colours = {}, records = {}; let since = 0;
function colour(name) {
  if (!(name in colours)) colours[name] = PALETTE[Object.keys(colours).length % PALETTE.length];
  return colours[name];
}
function esc(s) { return String(s).replace(/[&<>"]/g, c => "&#" + c.charCodeAt(0) + ";"); }
async function poll() {
  try {
    const reply = await (await fetch("calls.json?since=" + since)).json();
    draw(reply.workers);
  } catch (e) { document.getElementById("status").textContent = "no answer: " + e; }
  setTimeout(poll, 1000);
}
function draw(workers) {
  const addresses = Object.keys(workers).sort(), totals = {}, inflight = {}, held = {};
  let now = 0;
  for (const a of addresses) {
    const w = workers[a]; now = Math.max(now, w.now);
    records[a] = (records[a] || []).concat(w.records);
    for (const [name, t] of Object.entries(w.totals)) {
      const s = totals[name] || (totals[name] = [0, 0, 0, 0]);
      s[0] += t[0]; s[1] += t[1]; s[2] += t[2]; s[3] += t[3];
      (held[name] || (held[name] = new Set())).add(a);
    }
    for (const [name, n] of Object.entries(w.inflight)) inflight[name] = (inflight[name] || 0) + n;
  }
  if (now) since = now - 1;  // a little overlap: calls ending around the last look
  const svg = document.getElementById("stream"), rowH = 22, left = 170, width = 1000 - left;
  svg.setAttribute("height", Math.max(40, addresses.length * rowH + 20));
  let parts = [];
  addresses.forEach((a, i) => {
    const seen = new Set();
    records[a] = records[a].filter(r => r[3] > now - SPAN);
    parts.push(`<text x="0" y="${i * rowH + 15}">${esc(a)}</text>`);
    for (const r of records[a]) {
      const key = r.join("|"); if (seen.has(key)) continue; seen.add(key);
      const x = left + width * (1 - (now - r[2]) / SPAN);
      const w = Math.max(1, width * (r[3] - r[2]) / SPAN);
      const fill = r[4] === "OK" ? colour(r[0]) : "#d62728";
      parts.push(`<rect class="call" x="${x}" y="${i * rowH + 3}" width="${w}" height="16" ` +
        `fill="${fill}"><title>${esc(r[0])}.${esc(r[1])}: ` +
        `${((r[3] - r[2]) * 1e3).toFixed(1)} ms` +
        `${r[5] > 1 ? ", a batch of " + r[5] + " calls" : ""}</title></rect>`);
    }
  });
  svg.innerHTML = parts.join("");
  const rows = Object.keys(totals).sort().map(name => {
    const t = totals[name];
    return `<tr data-model="${esc(name)}"><td><span class="swatch" ` +
      `style="background:${colour(name)}"></span>${esc(name)}</td>` +
      `<td class="calls">${t[0]}</td><td class="errors">${t[1]}</td>` +
      `<td class="inflight">${inflight[name] || 0}</td>` +
      `<td>${t[3] ? (1e3 * t[2] / t[3]).toFixed(2) + " ms" : "-"}</td>` +
      `<td class="batch">${t[3] ? (t[0] / t[3]).toFixed(1) : "-"}</td>` +
      `<td>${held[name].size}</td></tr>`;
  });
  document.querySelector("#models tbody").innerHTML = rows.join("");
  document.getElementById("status").textContent =
    `${addresses.length} worker(s) answering, ${Object.keys(totals).length} model(s)`;
}
poll();
</script></body></html>
"""
