"""A headless Chromium driven over the Chrome DevTools Protocol, for tests and screenshots of the run report.

    with HeadlessChromium() as browser:
        browser.open("file:///tmp/w/elastic/report/index.html")
        browser.click("#rollout-table tbody tr")          # a real mouse click at the element's centre
        browser.wait_for("document.querySelectorAll('#tree .node').length > 0")
        browser.screenshot("/tmp/report.png")
        assert not browser.errors                          # uncaught exceptions and console.error lines

Why this and not selenium or playwright: neither is a dependency of the project, and the protocol needs
only a websocket (aiohttp, which the proxy already uses) and the browser Debian ships
(``/usr/bin/chromium``). The browser runs with a fresh profile, no sandbox (containers), no GPU, no
first-run, sync, component updates or background networking, and a host resolver that resolves
nothing but 127.0.0.1: a page it opens cannot reach outside this machine.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--mute-audio", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--remote-debugging-port=0",
         "--remote-allow-origins=http://127.0.0.1")


class BrowserError(RuntimeError):
    pass


def available(binary: str = CHROMIUM) -> bool:
    return os.access(binary, os.X_OK)


class HeadlessChromium:
    """One browser, one page (module docstring). ``timeout_s`` bounds every wait."""

    def __init__(self, *, binary: str = CHROMIUM, width: int = 1440, height: int = 900, timeout_s: float = 60.0):
        self.binary, self.width, self.height, self.timeout_s = binary, width, height, timeout_s
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._proc: subprocess.Popen | None = None
        self._profile = ""
        self._session: Any = None
        self._ws: Any = None
        self._id = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._events: list[dict] = []
        self._reader: asyncio.Task | None = None

    # -------------------------------------------------------------- life
    def __enter__(self) -> "HeadlessChromium":
        self._profile = tempfile.mkdtemp(prefix="gyre-chromium-")
        self._proc = subprocess.Popen([self.binary, *FLAGS, f"--user-data-dir={self._profile}",
                                       f"--window-size={self.width},{self.height}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            self._run(self._connect())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self._ws is not None or self._session is not None:
                self._run(self._disconnect())
        except Exception:  # noqa: BLE001 - closing: the process is killed below anyway
            pass
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._loop.close()
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)

    def _run(self, coro):
        return self._loop.run_until_complete(asyncio.wait_for(coro, self.timeout_s))

    async def _connect(self) -> None:
        import aiohttp

        port_file = os.path.join(self._profile, "DevToolsActivePort")
        t0 = time.monotonic()
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if self._proc is not None and self._proc.poll() is not None:
                raise BrowserError(f"{self.binary} exited with {self._proc.returncode} before it listened")
            if time.monotonic() - t0 > self.timeout_s:
                raise BrowserError(f"{self.binary} did not open its DevTools port in {self.timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        port = int(open(port_file).read().split()[0])
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json(content_type=None) if t.get("type") == "page"]
        if not pages:
            raise BrowserError("the browser has no page")
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())
        for domain in ("Page", "Runtime"):
            await self._send(f"{domain}.enable")
        await self._send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                         deviceScaleFactor=1, mobile=False)

    async def _disconnect(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        self._ws = self._session = None

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                self.errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                               for a in params.get("args", [])))
            self._events.append(data)

    async def _send(self, method: str, **params) -> dict:
        self._id += 1
        fut = self._loop.create_future()
        self._pending[self._id] = fut
        await self._ws.send_str(json.dumps({"id": self._id, "method": method, "params": params}))
        reply = await fut
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    # -------------------------------------------------------------- what a test does
    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        async def go():
            n = len(self._events)
            await self._send("Page.navigate", url=url)
            while not any(e.get("method") == "Page.loadEventFired" for e in self._events[n:]):
                await asyncio.sleep(0.05)
        self._run(go())

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serializable values)."""
        r = self._run(self._send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True))
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]!r} threw: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float | None = None) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            v = self.eval(expression)
            if v:
                return v
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression!r}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A mouse press and release at the centre of the first element ``selector`` matches (scrolled into view)."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        if box is None:
            raise BrowserError(f"no element matches {selector!r}")
        x, y = box

        async def press():
            for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
                await self._send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        self._run(press())

    def screenshot(self, path: str, *, full_page: bool = False) -> str:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            w, h = self.eval("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}
            params["captureBeyondViewport"] = True
        r = self._run(self._send("Page.captureScreenshot", **params))
        with open(path, "wb") as f:
            f.write(base64.b64decode(r["data"]))
        return path
