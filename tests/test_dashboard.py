"""The dashboard reads like the model: headless Chromium renders the task stream of a job.

Debian's Chromium (``/usr/bin/chromium``) is driven with Playwright (``_browser.py``:
launched from that binary, no browser is downloaded); the tests skip only when the
chromium binary is absent.  Playwright's async API runs in ``asyncio.run`` while a job
runs: its sync API would leave its event loop marked as running in the main thread, where
the tests also start and close the cluster's client.

The screenshot is kept as a test artifact under pytest's ``tmp_path``, and copied to
``$DASKTENSOR_SCREENSHOT_DIR/dashboard.png`` when that variable is set (how
``docs/dashboard.png`` is made).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import threading
import time

import dask
import numpy as np
import pytensor.tensor as pt
import pytest
from _browser import browser_page, chromium_or_skip
from _ops import Scale
from playwright.async_api import Page

import dasktensor as dt

WIDTH, HEIGHT = 1280, 720

# The names in the task stream, read from the page's Bokeh document: the ColumnDataSource
# of the task-stream plot (columns key, name, worker_thread, ...) as the browser holds it.
TASK_STREAM_JS = r"""
(() => {
  const B = window.Bokeh;
  if (!B || !B.documents || !B.documents.length) return null;
  for (const doc of B.documents) {
    for (const model of doc.all_models) {
      const data = model.data;
      if (data == null || typeof data !== "object") continue;
      const col = (c) => (data instanceof Map ? data.get(c) : data[c]);
      if (col("name") && col("key") && col("worker_thread")) {
        return {names: Array.from(col("name")), keys: Array.from(col("key")).map(String)};
      }
    }
  }
  return null;
})()
"""


def widest_bar_js(names: str, widths: str, marker: str, wanted: str) -> str:
    """Where a person would point the mouse to read a bar: the centre of the widest bar
    whose ``names`` column is ``wanted``, in page coordinates, from the rendered glyph's
    screen coordinates (sx, sy) and the canvas' position.  The plot is the one whose
    source has the columns ``names``, ``widths`` and ``marker``."""
    return (
        r"""
(() => {
  for (const view of Bokeh.index.all_views()) {
    const source = view.model.data_source;
    if (view.glyph == null || source == null || source.data == null) continue;
    const data = source.data;
    const col = (c) => (data instanceof Map ? data.get(c) : data[c]);
    const names = col("NAMES"), widths = col("WIDTHS");
    if (names == null || widths == null || col("MARKER") == null) continue;
    let best = -1;
    for (let i = 0; i < names.length; i++) {
      if (names[i] === "WANTED" && (best < 0 || widths[i] > widths[best])) best = i;
    }
    if (best < 0 || view.glyph.sx == null || best >= view.glyph.sx.length) return null;
    const box = view.plot_view.canvas_view.el.getBoundingClientRect();
    return [box.left + view.glyph.sx[best], box.top + view.glyph.sy[best]];
  }
  return null;
})()
""".replace("NAMES", names)
        .replace("WIDTHS", widths)
        .replace("MARKER", marker)
        .replace("WANTED", wanted)
    )


# a scale-heavy task of the task stream
RECTANGLE_JS = widest_bar_js("name", "duration", "worker_thread", "scale-heavy")

# The text a person sees: every text node of the rendered DOM, shadow roots included
# (Bokeh renders its views, the hover tooltip among them, in shadow DOM).
VISIBLE_TEXT_JS = r"""
(() => {
  const texts = [];
  const walk = (node) => {
    if (node.nodeName === "STYLE" || node.nodeName === "SCRIPT") return;
    if (node.nodeType === Node.TEXT_NODE) {
      const text = node.textContent.trim();
      if (text) texts.push(text);
      return;
    }
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  walk(document.body);
  return texts.join(" ");
})()
"""

NEXT_FRAME_JS = "new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))"


@pytest.fixture
def chromium():
    """The chromium binary the tests launch."""
    return chromium_or_skip()


@pytest.fixture
def dashboard_client():
    """An embedded cluster of 2 worker processes, with its dashboard on loopback."""
    client = dt.connect(n_workers=2, dashboard_address="127.0.0.1:0", set_as_default=False)
    try:
        yield client
    finally:
        client.shutdown()
        client.close()


class Job:
    """dasktensor work in a background thread until stopped: heavy Ops and a pmap.

    The function runs on the task path (``dasktensor.execute.path: tasks``), the one that
    puts every call in Dask's task stream (the default channel path shows its calls on
    the calls page, below).
    """

    def __init__(self, client):
        x = pt.vector("x")
        # four heavy tasks per call (keys scale-heavy-<i>-<token>), 0.25 s each
        self.f = dt.function(
            [x], sum(Scale(float(k), delay=0.25)(x).sum() for k in range(1, 5)), scheduler=client
        )
        # four chunks per call (keys pmap-<token>, pmap-out-<token>)
        self.g = dt.pmap(lambda v: pt.tanh(v).sum(), chunks=10)
        self.client = client
        self.calls = 0
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dashboard-job", daemon=True)

    def _run(self):
        try:
            while not self.stopped.is_set():
                with dask.config.set({"dasktensor.execute.path": "tasks"}):
                    assert float(self.f(np.ones(3))) == 30.0
                y = self.g(np.ones((40, 3))).compute(scheduler=self.client)
                np.testing.assert_allclose(y, np.full(40, 3 * np.tanh(1.0)))
                self.calls += 1
        except BaseException as e:  # re-raised by stop()
            self.error = e

    def __enter__(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the dasktensor job did not stop"
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=60)


def is_pmap(name: str) -> bool:
    """A pmap task's name: pmap, pmap-out, or fused by Dask (array-pmap-pmap-out)."""
    return "pmap" in name.split("-")


async def until(what: str, probe, timeout: float, interval: float = 0.2):
    """Poll ``await probe()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


async def look_at_task_stream(page: Page, page_url: str, job: Job, failed_png):
    """Load the page while the job runs; return (names, keys, tooltip text, screenshot).

    On failure, what the page showed is saved to ``failed_png``.
    """
    try:
        await page.goto(page_url)

        def has_dasktensor_names(stream):
            names = set(stream["names"]) if stream else set()
            return "scale-heavy" in names and any(is_pmap(n) for n in names)

        async def stream_while_running():
            if job.error is not None:
                raise job.error
            stream = await page.evaluate(TASK_STREAM_JS)
            # a few rounds of work in the picture, not only the first (compiling) one
            return stream if has_dasktensor_names(stream) and job.calls >= 3 else None

        # the Bokeh document is rendered and the job's tasks have reached the browser
        stream = await until("dasktensor's tasks in the task stream", stream_while_running, 40)

        # a still picture: stop the job, let the last tasks arrive, then hover a task
        job.stop()
        last = None

        async def settled():
            nonlocal last
            n = len((await page.evaluate(TASK_STREAM_JS))["names"])
            done, last = n == last, n
            return done

        await until("the task stream to settle", settled, 10, interval=0.5)
        stream = await page.evaluate(TASK_STREAM_JS)
        # no tooltip yet: the name below appears because the mouse points at a task
        assert "scale-heavy" not in await page.evaluate(VISIBLE_TEXT_JS)

        async def tooltip():
            point = await page.evaluate(RECTANGLE_JS)
            if not point:  # not drawn yet
                return None
            for x, y in [(1, 1), point]:  # leave and re-enter: the hover tool draws anew
                await page.mouse.move(x, y)
            await asyncio.sleep(0.3)
            text = await page.evaluate(VISIBLE_TEXT_JS)
            return text if "scale-heavy:" in text else None

        text = await until("a tooltip naming a scale-heavy task", tooltip, 10, interval=0.5)
        await page.evaluate(NEXT_FRAME_JS)
        return stream["names"], stream["keys"], text, await page.screenshot()
    except BaseException:
        with contextlib.suppress(Exception):
            failed_png.write_bytes(await page.screenshot(timeout=10_000))
        raise


async def task_stream_in_chromium(chromium: str, page_url: str, job: Job, failed_png):
    """:func:`look_at_task_stream` in a page of headless ``chromium``."""
    async with browser_page(chromium, WIDTH, HEIGHT) as page:
        return await look_at_task_stream(page, page_url, job, failed_png)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_task_stream_page_shows_dasktensor_task_names(chromium, dashboard_client, tmp_path):
    base = dashboard_client.dashboard_link.rsplit("/", 1)[0]
    assert base.startswith("http://127.0.0.1:")
    with Job(dashboard_client) as job:
        names, keys, tooltip, png = asyncio.run(
            asyncio.wait_for(
                task_stream_in_chromium(
                    chromium, f"{base}/individual-task-stream", job, tmp_path / "failed.png"
                ),
                120,
            )
        )
    assert job.calls >= 3

    screenshot = tmp_path / "dashboard.png"
    screenshot.write_bytes(png)
    print(f"screenshot: {screenshot}")
    if os.environ.get("DASKTENSOR_SCREENSHOT_DIR"):
        os.makedirs(os.environ["DASKTENSOR_SCREENSHOT_DIR"], exist_ok=True)
        shutil.copy(
            screenshot, os.path.join(os.environ["DASKTENSOR_SCREENSHOT_DIR"], "dashboard.png")
        )
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    # the task stream's data in the browser: dasktensor's names and keys
    assert "scale-heavy" in names
    assert any(is_pmap(name) for name in names), set(names)
    assert any(key.startswith("scale-heavy-") for key in keys)
    # what a person sees when pointing at a task: its name in the rendered tooltip
    assert "scale-heavy:" in tooltip


# ----------------------------------------------------------------------------- calls page

# The calls page's Bokeh document as the browser holds it: the calls plotted (the source
# with columns model, method, size, worker) and the per-model table's rows.
CALLS_PAGE_JS = r"""
(() => {
  const B = window.Bokeh;
  if (!B || !B.documents || !B.documents.length) return null;
  let calls = null, table = null;
  for (const doc of B.documents) {
    for (const model of doc.all_models) {
      const data = model.data;
      if (data == null || typeof data !== "object") continue;
      const col = (c) => (data instanceof Map ? data.get(c) : data[c]);
      if (col("method") && col("size") && col("worker")) {
        calls = {models: Array.from(col("model")), sizes: Array.from(col("size"))};
      }
      if (col("calls") && col("inflight") && col("p99")) {
        const names = Array.from(col("model"));
        table = names.map((m, i) => ({model: m, calls: col("calls")[i],
          errors: col("errors")[i], replicas: col("replicas")[i], p99: col("p99")[i]}));
      }
    }
  }
  return calls && table ? {calls, table} : null;
})()
"""

# a site-a call of the calls page
CALL_BAR_JS = widest_bar_js("model", "width", "method", "site-a")

CALLS = {"site-a": 120, "site-b": 80}  # back to back, one thread a model


class Callers:
    """Two remote models called from two threads, a known number of times each, and
    one call of site-a that raises in the model (a parameter vector too short)."""

    def __init__(self, client):
        from dasktensor.cli._demo import Site

        self.models = {
            tag: dt.RemoteModel(functools.partial(Site, seed, 0.02), name=tag, scheduler=client)
            for seed, tag in enumerate(CALLS)
        }
        for m in self.models.values():
            m.start()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(tag,), daemon=True) for tag in CALLS
        ]

    def _run(self, tag):
        try:
            for _ in range(CALLS[tag]):
                self.models[tag].call("logp_grad", np.zeros(2))
            if tag == "site-a":
                with pytest.raises(IndexError):
                    self.models[tag].call("logp_grad", np.zeros(1))
        except BaseException as e:
            self.errors.append(e)

    def start(self):
        for t in self.threads:
            t.start()

    def join(self):
        for t in self.threads:
            t.join(timeout=120)
        return not any(t.is_alive() for t in self.threads)

    def close(self):
        for m in self.models.values():
            m.close()


async def look_at_calls_page(chromium: str, base: str, callers: Callers, failed_png):
    """Open the calls page from the dashboard's list of plots, make the calls, and read
    the page: (its table, the calls plotted, a tooltip's text, a screenshot)."""
    async with browser_page(chromium, WIDTH, HEIGHT) as page:
        try:
            plots = await (await page.request.get(f"{base}/individual-plots.json")).json()
            await page.goto(base + plots["Individual Dasktensor Calls"])
            await until("the page's Bokeh document", lambda: page.evaluate(CALLS_PAGE_JS), 30)
            await asyncio.get_running_loop().run_in_executor(None, callers.start)
            await asyncio.get_running_loop().run_in_executor(None, callers.join)

            async def all_counted():
                seen = await page.evaluate(CALLS_PAGE_JS)
                rows = {r["model"]: r for r in seen["table"]}
                done = {m: rows.get(m, {}).get("calls") for m in CALLS}
                want = {"site-a": CALLS["site-a"] + 1, "site-b": CALLS["site-b"]}
                return seen if done == want and len(seen["calls"]["models"]) >= 201 else None

            seen = await until("every call in the table and the plot", all_counted, 30, 0.5)
            # no tooltip yet: the method's name appears because the mouse points at a call
            assert "logp_grad" not in await page.evaluate(VISIBLE_TEXT_JS)

            async def tooltip():
                point = await page.evaluate(CALL_BAR_JS)
                if not point:
                    return None
                for x, y in [(1, 1), point]:
                    await page.mouse.move(x, y)
                await asyncio.sleep(0.3)
                text = await page.evaluate(VISIBLE_TEXT_JS)
                return text if "logp_grad" in text else None

            text = await until("a tooltip of a site-a call", tooltip, 10, interval=0.5)
            await page.evaluate(NEXT_FRAME_JS)
            png = await page.screenshot()
            # a second tab (or a reload) while this one is open renders its own page
            other = await page.context.browser.new_page()
            await other.goto(base + plots["Individual Dasktensor Calls"])

            async def counted_there():
                there = await other.evaluate(CALLS_PAGE_JS)
                rows = {r["model"]: r["calls"] for r in (there or {}).get("table", [])}
                return rows if rows.get("site-b") == CALLS["site-b"] else None

            await until("the calls in a second tab", counted_there, 30, 0.5)
            return seen, text, png
        except BaseException:
            with contextlib.suppress(Exception):
                failed_png.write_bytes(await page.screenshot(timeout=10_000))
            raise


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_calls_page_is_a_dashboard_plot_that_counts_and_draws_the_calls(
    chromium, dashboard_client, tmp_path
):
    base = dashboard_client.dashboard_link.rsplit("/", 1)[0]
    callers = Callers(dashboard_client)
    try:
        seen, text, png = asyncio.run(
            asyncio.wait_for(
                look_at_calls_page(chromium, base, callers, tmp_path / "failed.png"), 180
            )
        )
    finally:
        callers.close()
    assert not callers.errors, callers.errors
    (tmp_path / "calls.png").write_bytes(png)
    if os.environ.get("DASKTENSOR_SCREENSHOT_DIR"):
        shutil.copy(tmp_path / "calls.png", os.environ["DASKTENSOR_SCREENSHOT_DIR"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    rows = {r["model"]: r for r in seen["table"]}
    assert rows["site-a"]["errors"] == 1 and rows["site-b"]["errors"] == 0
    assert rows["site-a"]["replicas"] == rows["site-b"]["replicas"] == 2  # one a worker
    assert 20 <= rows["site-a"]["p99"] < 1000  # ms: the 20-ms model, from the histogram
    plotted = seen["calls"]["models"]
    assert plotted.count("site-b") == CALLS["site-b"]
    assert plotted.count("site-a") == CALLS["site-a"] and "site-a (raised)" in plotted
    assert "site-a" in text and "logp_grad" in text and "ms" in text  # the hover


def test_the_old_calls_address_redirects_to_the_page(dashboard_client):
    import urllib.request

    base = dashboard_client.dashboard_link.rsplit("/", 1)[0]
    dt.calls_link(dashboard_client)
    with urllib.request.urlopen(f"{base}/dasktensor/calls") as reply:
        assert reply.geturl() == f"{base}/individual-dasktensor-calls"
        assert b"Bokeh" in reply.read()
