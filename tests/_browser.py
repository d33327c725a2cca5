"""Headless Chromium for the tests, driven through its DevTools protocol.

Debian's Chromium (``apt-get install chromium``, which ``.ci/run`` does) is driven over a
websocket with tornado's client (distributed depends on tornado), so the tests need no
browser driver package.  Tests that use it skip only when the chromium binary is absent.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


class DevTools:
    """A minimal client of Chromium's DevTools protocol, on one browser websocket."""

    def __init__(self, ws):
        self.ws = ws
        self.n = 0

    async def send(self, method: str, session: str | None = None, **params):
        self.n += 1
        message = {"id": self.n, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self.ws.write_message(json.dumps(message))
        while True:  # events (no domain is enabled, so few) are skipped
            raw = await self.ws.read_message()
            if raw is None:
                raise ConnectionError(f"Chromium closed the DevTools connection ({method})")
            reply = json.loads(raw)
            if reply.get("id") == self.n:
                break
        if "error" in reply:
            raise RuntimeError(f"DevTools {method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, session: str, expression: str):
        result = await self.send(
            "Runtime.evaluate",
            session,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"JavaScript error: {details.get('exception', details)}")
        return result["result"].get("value")

    async def open_page(self, url: str, width: int, height: int, scale: float = 1) -> str:
        """A new tab of ``width`` x ``height`` CSS pixels showing ``url``: its session."""
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        page = attached["sessionId"]
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            page,
            width=width,
            height=height,
            deviceScaleFactor=scale,
            mobile=False,
        )
        await self.send("Page.navigate", page, url=url)
        return page

    async def screenshot(self, page: str, clip: dict | None = None) -> bytes:
        """A PNG of the page (of the ``clip`` rectangle, in CSS pixels, if given)."""
        params = {"format": "png"}
        if clip is not None:
            params["clip"] = {**clip, "scale": 1}
        shot = await self.send("Page.captureScreenshot", page, **params)
        return base64.b64decode(shot["data"])


@contextlib.contextmanager
def headless_chromium(log_path: Path, width: int, height: int):
    """Headless Chromium with DevTools on a free loopback port: its browser websocket URL.

    Its output goes to ``log_path``; it is stopped (with every process of its group) and
    its profile removed on exit.
    """
    profile = tempfile.mkdtemp(prefix="dasktensor-chromium-")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                CHROMIUM,
                *CHROMIUM_FLAGS,
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
            ],
            # crash reports ($XDG_CONFIG_HOME) and shared memory files ($TMPDIR, as Debian's
            # launcher passes --disable-dev-shm-usage when /dev/shm is small) go to the profile
            env={
                **os.environ,
                "XDG_CONFIG_HOME": profile,
                "XDG_CACHE_HOME": profile,
                "TMPDIR": profile,
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # its own process group: renderers are ended with it
        )
    try:
        # Chromium writes the port it chose and the browser's path to DevToolsActivePort
        port_file = os.path.join(profile, "DevToolsActivePort")
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while len(lines) < 2:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Chromium did not open DevTools (exit code {process.poll()}): "
                    + log_path.read_text(errors="replace")[-2000:]
                )
            time.sleep(0.05)
            if os.path.exists(port_file):
                with open(port_file) as f:
                    lines = f.read().split()
        yield f"ws://127.0.0.1:{lines[0]}{lines[1]}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        try:  # any child left in the process group that Chromium led
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(profile, ignore_errors=True)
