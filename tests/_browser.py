"""Headless Chromium for the browser tests (``test_dashboard.py``, ``test_display.py``).

Debian's Chromium (``apt-get install chromium``, which ``.ci/run`` does) is driven with
Playwright, launched from that binary (``executable_path``: no browser is downloaded,
``playwright install`` is not run).  Tests that use it skip only when the chromium binary
is absent.  They run Playwright's async API inside ``asyncio.run``: its sync API would
leave its event loop marked as running in the main thread, where tests also start and
close cluster clients.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest
from playwright.async_api import async_playwright

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
)


def chromium_or_skip() -> str:
    """The chromium binary to launch; without one, the calling test is skipped."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; see .ci/run)")
    return CHROMIUM


@contextlib.asynccontextmanager
async def browser_page(chromium: str, width: int, height: int):
    """A ``width`` x ``height`` page (CSS pixels, scale 1) of headless ``chromium``.

    The browser is closed on exit.  Crash reports ($XDG_CONFIG_HOME) and shared memory
    files ($TMPDIR, as Playwright passes --disable-dev-shm-usage) go to a temporary
    directory removed on exit: one with a short path, as Chromium's singleton socket is
    made in $TMPDIR (under pytest's ``tmp_path`` its path is too long for a unix socket).
    """
    with tempfile.TemporaryDirectory(prefix="dasktensor-chromium-") as scratch:
        dirs = dict.fromkeys(["XDG_CONFIG_HOME", "XDG_CACHE_HOME", "TMPDIR"], scratch)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=chromium, env={**os.environ, **dirs}
            )
            try:
                yield await browser.new_page(
                    viewport={"width": width, "height": height}, device_scale_factor=1
                )
            finally:
                await browser.close()
