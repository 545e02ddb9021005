"""Bounded capture of a process's output: the first and the last bytes, never the whole.

A harness or a grader command may print without end (a policy under RL will find that
out); keeping everything and truncating afterwards puts tens of MiB in the trainer's
memory and in the outcome records. ``BoundedCapture`` keeps ``head`` bytes from the start
and a ring of ``tail`` bytes from the end while the output streams, and counts the rest.
"""
from __future__ import annotations

import asyncio
import threading


class BoundedCapture:
    """At most ``head + tail`` bytes of a stream, plus how many bytes were dropped between them."""

    def __init__(self, head: int = 16384, tail: int = 16384):
        if head < 0 or tail < 0:
            raise ValueError(f"BoundedCapture: head and tail must be >= 0, got {head}, {tail}")
        self.head_limit, self.tail_limit = head, tail
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or not self.tail_limit:
            return
        self._tail += data
        if len(self._tail) > self.tail_limit:
            del self._tail[: len(self._tail) - self.tail_limit]

    @property
    def dropped(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    def text(self) -> str:
        """What was kept, with a marker where bytes were dropped."""
        mid = f"\n[... {self.dropped} bytes not kept ...]\n" if self.dropped else ""
        return self._head.decode(errors="replace") + mid + self._tail.decode(errors="replace")

    def tail_text(self, limit: int | None = None) -> str:
        """The last bytes seen (at most ``limit``), for parsing a final result line."""
        data = bytes(self._head + self._tail) if not self.dropped else bytes(self._tail)
        if limit is not None:
            data = data[-limit:]
        return data.decode(errors="replace")


async def drain_async(stream: asyncio.StreamReader, capture: BoundedCapture, chunk: int = 65536) -> None:
    """Read ``stream`` to its end into ``capture`` (memory stays bounded however much is written)."""
    while True:
        data = await stream.read(chunk)
        if not data:
            return
        capture.feed(data)


def drain_thread(fileobj, capture: BoundedCapture, chunk: int = 65536) -> threading.Thread:
    """A daemon thread reading a blocking pipe to its end into ``capture``; join it after the process ends."""

    def run():
        while True:
            data = fileobj.read1(chunk) if hasattr(fileobj, "read1") else fileobj.read(chunk)
            if not data:
                return
            capture.feed(data)

    t = threading.Thread(target=run, name="gyre-capture", daemon=True)
    t.start()
    return t
