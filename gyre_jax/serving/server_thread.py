"""Run the proxy (and its engines) on an event loop in a background thread.

For synchronous callers (a launcher job, tests, notebooks): the server keeps its
own loop, clients talk to it over loopback HTTP like any other harness, and
``run`` executes a coroutine on the server's loop (e.g. ``router.drain``).

    st = ServerThread(build)          # build: async () -> Proxy (runs on the loop)
    url = st.start()                  # "http://127.0.0.1:PORT"
    st.run(st.proxy.router.drain("cell0"))
    st.stop()
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable

from gyre_jax.errors import RunFailed


class StartTimeout(RunFailed):
    """The server (its engines: weights placed, steps compiled) was not ready within the start-up deadline."""


class ServerThread:
    def __init__(self, build: Callable[[], Awaitable]):
        self._build = build
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._abandoned = False  # start() gave up waiting: stop as soon as the build is done
        self.proxy: Any = None  # what build() made (a Proxy), once started
        self.url: str | None = None

    def start(self, timeout: float = 300.0, what: str = "the proxy and its engines") -> str:
        """Start; ``StartTimeout`` (a RunFailed: the launcher prints one ``error:`` line and exits 1) when not
        ready within ``timeout`` s. A build still running then stops its server as soon as it finishes."""
        self._thread = threading.Thread(target=self._main, name="gyre-proxy", daemon=True)
        self._thread.start()
        try:
            self.url = self._ready.result(timeout)
        except concurrent.futures.TimeoutError:
            self._abandoned = True
            raise StartTimeout(f"{what} were not ready within {timeout:.0f} s (weights placed, decode steps "
                               "compiled): on a loaded host raise config.cells.start_timeout_s; a warm compilation "
                               "cache (JAX_COMPILATION_CACHE_DIR) makes a rerun start faster") from None
        return self.url

    def _main(self):
        asyncio.run(self._serve())

    async def _serve(self):
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.proxy = await self._build()
            url = await self.proxy.start()
        except BaseException as e:  # noqa: BLE001 - report start-up failures to start()
            self._ready.set_exception(e)
            return
        self._ready.set_result(url)
        if self._abandoned:
            self._stop.set()
        await self._stop.wait()
        await self.proxy.stop()
        await self.proxy.router.close()

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ServerThread: not started (call start() first)")
        return self._loop

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._started_loop()).result(timeout)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._started_loop())

    async def run_async(self, coro):
        """Await, from another event loop, a coroutine run on the server's loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
