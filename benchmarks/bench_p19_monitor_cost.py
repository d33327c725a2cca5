"""P19: what the channel's metrics and dashboard page cost a sampler's calls.

The scheduler's channel monitor (``dasktensor_worker.monitor``) asks every worker's call
log once a second what happened; while the dashboard's calls page
(``/individual-dasktensor-calls``) is open it also fetches every call's record, which the
page streams to the browser (a bar per call).  Here: P1's round trip (a
``RemoteModel`` of ``_ops.Normal``, 10-dimensional logp and gradient, called with
``model.call`` on the one worker process of a ``LocalCluster`` that preloads dasktensor,
the scheduler and its dashboard in this process as with ``dt.connect()``), timed in
alternating blocks of back-to-back calls (as a sampler calls), each ~3 s long (spanning
three of the monitor's looks and the page's updates), 8 blocks of each variant:

* **page open**: the calls page open in headless Chromium (Playwright's async API, in a
  thread of its own running its asyncio loop), its Bokeh document rendered before the
  block, and checked after it: its table counts the block's calls and its plot holds
  the calls' bars (the page really updated during the block);
* **page closed**: the same browser on ``about:blank``, once the monitor no longer fetches
  the records: the page's session on the scheduler renews that while it lives, and Bokeh
  keeps a session its browser left for ``unused_session_lifetime_milliseconds`` (15 s by
  default, then 3 s more of fetching: 18 s).  The benchmark's dashboard drops them after
  1 s, so that the variants can alternate often; what a block measures is the same
  (a connected session, or none);
* **no monitor** (informational): the channel monitor closed and removed from the
  scheduler (no look at the workers at all), put back before the next block that wants
  it.  The workers' call logs still count every call (they always do).

The variants' blocks alternate (reversed every other round); a block's mean per call is
one sample (it includes the monitor's and the page's once-a-second work), the median over
a variant's blocks its time.  Target: page open / page closed <= 1.05.  Beside it, as
gauges of the noise: the ratio between the two halves of the page-closed blocks (the 1st,
3rd, 5th... against the 2nd, 4th, 6th...: the same state, measured apart), the median of
the rounds' own open / closed ratios (a page-open block next to a page-closed one shares
the machine's slow phases), and the per-call median and p99 of each variant.  Also
printed: the CPU each variant takes per second (the calling thread, the rest of this
process -- the scheduler, its dashboard, Playwright's thread --, the worker, and the
browser's processes), to see where a difference comes from on a machine of 2 cores that
runs all of them.  Without Chromium the benchmark says so and is skipped.

Run: ``python benchmarks/bench_p19_monitor_cost.py``
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Row,
    fmt_time,
    load_row,
    local_cluster,
    print_rows,
    print_table,
    quiet,
    versions_line,
)

NAME = "p19-monitor-cost"
ROUNDS = 8  # blocks of each variant
BLOCK_SECONDS = 3.0  # the length of a block (its number of calls is calibrated once)
OPEN, CLOSED, NONE = "page open", "page closed", "no monitor"
MONITOR = "dasktensor-channel"  # ChannelMonitor.name
CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
)

# The calls page's Bokeh document as the browser holds it (tests/test_dashboard.py): the
# calls plotted (the source with columns model, method, size, worker) and the table's rows.
CALLS_PAGE_JS = r"""
(() => {
  const B = window.Bokeh;
  if (!B || !B.documents || !B.documents.length) return null;
  let plotted = null, table = null;
  for (const doc of B.documents) {
    for (const model of doc.all_models) {
      const data = model.data;
      if (data == null || typeof data !== "object") continue;
      const col = (c) => (data instanceof Map ? data.get(c) : data[c]);
      if (col("method") && col("size") && col("worker")) plotted = col("model").length;
      if (col("calls") && col("inflight") && col("p99")) {
        const names = Array.from(col("model"));
        table = Object.fromEntries(names.map((m, i) => [m, col("calls")[i]]));
      }
    }
  }
  return plotted !== null && table !== null ? {plotted, table} : null;
})()
"""


class Browser:
    """Headless Chromium driven by Playwright's async API in a thread of its own (which
    runs the asyncio loop): one page, on the calls page or on ``about:blank``.

    Crash reports and shared-memory files go to a temporary directory removed on close
    (as ``tests/_browser.py`` does).
    """

    def __init__(self, chromium: str):
        self.scratch = tempfile.TemporaryDirectory(prefix="dasktensor-chromium-")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="p19-browser")
        self.thread.start()
        self.playwright = self.browser = self.page = None
        try:
            self.run(self._start(chromium))
        except BaseException:
            self.close()
            raise

    def run(self, coro, timeout: float = 60.0):
        """Run ``coro`` on the browser's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, chromium: str) -> None:
        from playwright.async_api import async_playwright

        dirs = dict.fromkeys(["XDG_CONFIG_HOME", "XDG_CACHE_HOME", "TMPDIR"], self.scratch.name)
        self.playwright = await async_playwright().start()
        self.browser = await self.playwright.chromium.launch(
            executable_path=chromium, env={**os.environ, **dirs}
        )
        self.page = await self.browser.new_page(
            viewport={"width": 1280, "height": 720}, device_scale_factor=1
        )

    async def _open(self, url: str, timeout: float) -> dict:
        await self.page.goto(url)
        deadline = time.monotonic() + timeout
        while (seen := await self.page.evaluate(CALLS_PAGE_JS)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the calls page's Bokeh document did not render in {timeout} s"
                )
            await asyncio.sleep(0.2)
        return seen

    def open(self, url: str, timeout: float = 30.0) -> dict:
        """Load the calls page and wait for its Bokeh document; what it shows."""
        return self.run(self._open(url, timeout), timeout + 10)

    def look(self) -> dict | None:
        """What the page shows: ``{"plotted": calls plotted, "table": {model: calls}}``."""
        return self.run(self.page.evaluate(CALLS_PAGE_JS))

    def blank(self) -> None:
        self.run(self.page.goto("about:blank"))

    async def _stop(self) -> None:
        if self.browser is not None:
            await self.browser.close()
        if self.playwright is not None:
            await self.playwright.stop()

    def close(self) -> None:
        try:
            if self.thread.is_alive():
                self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()
            self.scratch.cleanup()


class CpuMeter:
    """CPU seconds used so far by this process (the calling thread apart), the worker
    process, and the browser (Playwright's driver and Chromium's processes, the
    processes this one started after ``before``), to read where a variant's time goes."""

    def __init__(self, worker_pid: int, before: set[int]):
        import psutil

        me = psutil.Process()
        self.worker = psutil.Process(worker_pid)
        self.browser = [p for p in me.children() if p.pid not in before]

    def now(self) -> dict:
        import psutil

        def cpu(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        browser = {}
        for root in self.browser:
            try:
                for p in [root, *root.children(recursive=True)]:
                    browser[p.pid] = cpu(p)
            except psutil.NoSuchProcess:
                pass
        return {
            "caller": time.thread_time(),
            "process": time.process_time(),
            "worker": cpu(self.worker),
            "browser": browser,
        }

    @staticmethod
    def used(a: dict, b: dict, wall: float) -> dict[str, float]:
        """CPU seconds per wall second between the looks ``a`` and ``b``."""
        caller = b["caller"] - a["caller"]
        browser = sum(t - a["browser"].get(pid, 0.0) for pid, t in b["browser"].items())
        return {
            "calling thread": caller / wall,
            "rest of this process": (b["process"] - a["process"] - caller) / wall,
            "worker": (b["worker"] - a["worker"]) / wall,
            "browser": browser / wall,
        }


async def _remove_monitor(dask_scheduler) -> bool:
    """On the scheduler: close the channel monitor (its looks at the workers) and remove
    it from the plugins."""
    monitor = dask_scheduler.plugins.get(MONITOR)
    if monitor is None:
        return False
    await monitor.close()
    dask_scheduler.remove_plugin(MONITOR)
    return True


def _add_monitor(dask_scheduler) -> None:
    """On the scheduler: a channel monitor again (a new one, as the page would start)."""
    from dasktensor_worker.monitor import monitor_of

    monitor_of(dask_scheduler)


def main(rounds: int = ROUNDS) -> list[Row]:
    quiet()
    if CHROMIUM is None:
        print(f"[{NAME}] chromium is not installed (Debian: apt-get install chromium): skipped")
        return [Row(NAME, "skipped: chromium not installed", math.nan)]
    import dask
    import numpy as np
    from _ops import Normal
    from bench_p1_latency import DIM

    import dasktensor as dt
    import dasktensor_worker.dashboard  # noqa: F401  (lists the page, as dt.connect does)

    print(f"[{NAME}] {versions_line()}")
    rows = [load_row(NAME)]
    x = np.random.default_rng(0).normal(size=DIM)
    made = 0  # calls made so far (the worker's total for the model)

    # the page's session is dropped 1 s after the browser leaves it (Bokeh: 15 s)
    lifetime = {
        "distributed.scheduler.dashboard.bokeh-application."
        "unused_session_lifetime_milliseconds": 1000
    }
    with (
        dask.config.set(lifetime),
        local_cluster(
            n_workers=1,
            preload=["dasktensor"],
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={},  # (local_cluster's default turns the dashboard off)
        ) as client,
    ):
        scheduler = client.cluster.scheduler
        url = client.dashboard_link.rsplit("/", 1)[0] + "/individual-dasktensor-calls"
        model = dt.RemoteModel(Normal, name="normal", scheduler=client)

        def call():
            return model.call("logp_grad", x)

        np.testing.assert_allclose(call()[1], -x)
        made += 1

        def monitor():
            return scheduler.plugins.get(MONITOR)

        assert monitor() is not None, "the remote model did not start the channel monitor"

        def watched() -> bool:
            m = monitor()
            return m is not None and m.watched

        # calibrate: calls per block of ~BLOCK_SECONDS (warm, page closed, monitor on)
        for _ in range(200):
            call()
        t0 = time.perf_counter()
        for _ in range(1000):
            call()
        per_call = (time.perf_counter() - t0) / 1000
        made += 1200
        calls = max(500, int(round(BLOCK_SECONDS / per_call, -2)))
        print(f"[{NAME}] {fmt_time(per_call)} a call warm: blocks of {calls} calls; {url}")

        import psutil

        before = {p.pid for p in psutil.Process().children()}
        browser = Browser(CHROMIUM)
        (worker_pid,) = client.run(os.getpid).values()
        meter = CpuMeter(worker_pid, before)
        state = {"page": False, "monitor": True}
        waits: dict[str, list[float]] = {"page rendered": [], "session dropped": []}

        def settle_page_away():
            """Wait until no page session renews the monitor's fetching of records."""
            t = time.perf_counter()
            deadline = t + 60
            while watched() and time.perf_counter() < deadline:
                time.sleep(0.25)
            if watched():
                raise RuntimeError("the monitor still fetched records 60 s after the page closed")
            waits["session dropped"].append(time.perf_counter() - t)

        def enter(variant: str) -> None:
            """Put the cluster and the browser in the state of ``variant``."""
            if variant == OPEN:
                if not state["monitor"]:
                    client.run_on_scheduler(_add_monitor)
                    state["monitor"] = True
                if not state["page"]:
                    t = time.perf_counter()
                    browser.open(url)
                    waits["page rendered"].append(time.perf_counter() - t)
                    state["page"] = True
                    time.sleep(2.0)  # past the page's first load (a one-off)
                assert watched(), "the page is open but the monitor fetches no records"
            else:
                if state["page"]:
                    browser.blank()
                    state["page"] = False
                    settle_page_away()
                want = variant == CLOSED
                if want and not state["monitor"]:
                    client.run_on_scheduler(_add_monitor)
                elif not want and state["monitor"]:
                    assert client.run_on_scheduler(_remove_monitor)
                state["monitor"] = want
                time.sleep(1.0)
                assert not watched()
            assert (monitor() is not None) == (variant != NONE)

        samples: dict[str, list[float]] = {v: [] for v in (OPEN, CLOSED, NONE)}
        each: dict[str, list[np.ndarray]] = {v: [] for v in samples}
        cpu: dict[str, list[dict]] = {v: [] for v in samples}
        log = []  # (round, variant, mean per call, page's table count, bars plotted)
        try:
            for r in range(rounds):
                order = list(samples) if r % 2 == 0 else list(reversed(samples))
                for variant in order:
                    enter(variant)
                    times = np.empty(calls)
                    gc.disable()
                    try:
                        a = meter.now()
                        t0 = time.perf_counter()
                        for i in range(calls):
                            t = time.perf_counter()
                            call()
                            times[i] = time.perf_counter() - t
                        wall = time.perf_counter() - t0
                        cpu[variant].append(meter.used(a, meter.now(), wall))
                        mean = wall / calls
                    finally:
                        gc.enable()
                    made += calls
                    samples[variant].append(mean)
                    each[variant].append(times)
                    shown, plotted = "", ""
                    if variant == OPEN:  # the page counted the block's calls and drew them
                        deadline = time.monotonic() + 10
                        while True:
                            seen = browser.look() or {"table": {}, "plotted": 0}
                            shown, plotted = seen["table"].get("normal", 0), seen["plotted"]
                            if shown >= made or time.monotonic() > deadline:
                                break
                            time.sleep(0.25)
                        if shown < made or plotted == 0:
                            raise RuntimeError(
                                f"the open page did not update: {shown} of {made} calls "
                                f"counted, {plotted} plotted"
                            )
                        assert watched()
                    else:
                        assert not watched()
                    log.append((r + 1, variant, fmt_time(mean), shown, plotted))
                    print(f"  round {r + 1} {variant:12s} {fmt_time(mean)} a call", flush=True)
        finally:
            browser.close()
            if not state["monitor"]:
                client.run_on_scheduler(_add_monitor)
            model.close()

    print_table(
        ["round", "variant", "mean per call", "calls on the page's table", "bars plotted"],
        log,
        title=f"[{NAME}] blocks of {calls} calls (mean per call of each block)",
    )
    med = {v: statistics.median(s) for v, s in samples.items()}
    closed = samples[CLOSED]
    aa = statistics.median(closed[0::2]) / statistics.median(closed[1::2])
    paired = statistics.median(o / c for o, c in zip(samples[OPEN], closed))
    every = {v: np.concatenate(t) for v, t in each.items()}
    print_table(
        ["variant", "median of block means", "/ page closed", "per-call median", "per-call p99",
         "blocks"],
        [
            (v, fmt_time(med[v]), f"{med[v] / med[CLOSED]:.3f}",
             fmt_time(float(np.median(every[v]))), fmt_time(float(np.percentile(every[v], 99))),
             len(samples[v]))
            for v in samples
        ],
        title=f"[{NAME}] P1 round trip (model.call of a {DIM}-dim normal's logp and gradient)",
    )  # fmt: skip
    kinds = list(cpu[OPEN][0])
    print_table(
        ["variant", *kinds],
        [(v, *(f"{statistics.median(c[k] for c in cpu[v]):.2f}" for k in kinds)) for v in cpu],
        title=f"[{NAME}] CPU seconds per second during the blocks (medians; "
        f"{os.cpu_count()} cores); this process holds the scheduler and its dashboard",
    )
    for what, seconds in waits.items():
        if seconds:
            print(f"{what}: {', '.join(f'{s:.1f}' for s in seconds)} s")
    rows += [
        Row(NAME, "round trip, page open", med[OPEN], unit="s"),
        Row(NAME, "round trip, page closed", med[CLOSED], unit="s"),
        Row(NAME, "round trip, no monitor", med[NONE], unit="s"),
        Row(NAME, "page open / page closed", med[OPEN] / med[CLOSED], 1.05),
        Row(NAME, "page closed / no monitor", med[CLOSED] / med[NONE]),
        Row(NAME, "page open / page closed, median of the rounds' ratios", paired),
        Row(NAME, "A/A noise: page-closed blocks 1,3,5.. / 2,4,6..", aa),
        Row(
            NAME,
            "browser CPU s per s, page open (median)",
            statistics.median(c["browser"] for c in cpu[OPEN]),
        ),
        Row(
            NAME,
            "p99 per call, page open / page closed",
            float(np.percentile(every[OPEN], 99) / np.percentile(every[CLOSED], 99)),
        ),
        load_row(NAME),
    ]
    print_rows(rows, title=f"[{NAME}] summary")
    return rows


if __name__ == "__main__":
    from _common import save_results

    save_results(NAME, main())  # not saved with DASKTENSOR_BENCH_NO_SAVE=1
