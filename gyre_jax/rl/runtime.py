"""Small runtime pieces of the loop: its clock, the harness's event-loop thread, the role timeline."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from typing import Sequence

from gyre_jax.scheduler.vocab import ROLLOUT, SWITCHING_ROLES, TRAIN


class RealClock:
    def __init__(self):
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


class LoopThread:
    """An asyncio loop in a daemon thread (the harness runs here)."""

    def __init__(self, name: str = "gyre-harness"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        """Run the loop on its thread (construction starts nothing)."""
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what still runs (agents, grader subprocesses), let it unwind, then stop."""

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(3):  # killed graders' pipes close in callbacks: let them run before the loop stops
                await asyncio.sleep(0.01)
            await asyncio.get_running_loop().shutdown_default_executor()  # asyncio.to_thread's workers

        try:
            self.submit(cancel_all()).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@dataclasses.dataclass(frozen=True)
class Switch:
    """A completed role switch."""

    cell: int
    role: str  # the role it switched to (train or rollout)
    t_start: float
    seconds: float


class Timeline:
    """Role segments per cell (cell, t0, t1, role) and completed switches; written by the switch threads,
    read by the loop's (every read and write under one lock)."""

    def __init__(self, clock: RealClock, roles: Sequence[str]):
        self.clock = clock
        self._lock = threading.Lock()
        self._open = {c: (r, 0.0) for c, r in enumerate(roles)}
        self.segments: list[tuple[int, float, float, str]] = []
        self._switches: list[Switch] = []

    def switches_since(self, n: int) -> list[Switch]:
        """The switches completed after the first ``n``."""
        with self._lock:
            return self._switches[n:]

    def switch_count(self) -> int:
        with self._lock:
            return len(self._switches)

    def set(self, cell: int, role: str) -> None:
        now = self.clock.now()
        with self._lock:
            prev, t0 = self._open[cell]
            self.segments.append((cell, t0, now, prev))
            self._open[cell] = (role, now)
            if prev in SWITCHING_ROLES and role in (TRAIN, ROLLOUT):
                self._switches.append(Switch(cell, role, t0, now - t0))

    def snapshot(self) -> tuple[list[tuple[int, float, float, str]], float]:
        """(every segment so far, the open ones ending now; now): what the attempt record keeps each step."""
        now = self.clock.now()
        with self._lock:
            return self.segments + [(c, t0, now, r) for c, (r, t0) in self._open.items()], now

    def close(self) -> list[tuple[int, float, float, str]]:
        now = self.clock.now()
        with self._lock:
            for c, (r, t0) in self._open.items():
                self.segments.append((c, t0, now, r))
                self._open[c] = (r, now)
            return list(self.segments)
