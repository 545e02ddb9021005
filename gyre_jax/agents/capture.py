"""Bounded capture of a process's output: the first and the last bytes, never the whole.

A harness or a grader command may print without end (a policy under RL will find that
out); keeping everything and truncating afterwards puts tens of MiB in the trainer's
memory and in the outcome records. ``BoundedCapture`` keeps ``head`` bytes from the start
and a ring of ``tail`` bytes from the end while the output streams, and counts the rest.
"""
from __future__ import annotations

import asyncio
import json
import threading

# The bounds on what reaches an outcome record, in one place. Any string is cut to its first
# and last RECORD_TEXT_BYTES // 2 bytes; a details object (the grader's, the harness's) is
# cut to RECORD_DETAILS_BYTES of JSON at most, RECORD_ITEMS entries per list or object and
# RECORD_DEPTH levels of nesting. A record of hundreds of rollouts stays small whatever a
# policy or a grader prints.
RECORD_TEXT_BYTES = 8192
RECORD_DETAILS_BYTES = 65536
RECORD_ITEMS = 256
RECORD_DEPTH = 16


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
        return _join(bytes(self._head), self.dropped, bytes(self._tail))

    def tail_text(self, limit: int | None = None) -> str:
        """The last bytes seen (at most ``limit``), for parsing a final result line."""
        data = bytes(self._head + self._tail) if not self.dropped else bytes(self._tail)
        if limit is not None:
            data = data[-limit:]
        return data.decode(errors="replace")


async def drain_async(stream: asyncio.StreamReader | None, capture: BoundedCapture, chunk: int = 65536) -> None:
    """Read ``stream`` to its end into ``capture`` (memory stays bounded however much is written).
    None (a process started without that pipe) has nothing to read."""
    while stream is not None:
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


def _join(head: bytes, dropped: int, tail: bytes) -> str:
    mid = f"\n[... {dropped} bytes not kept ...]\n" if dropped else ""
    return head.decode(errors="replace") + mid + tail.decode(errors="replace")


def bound_text(text: str, limit: int = RECORD_TEXT_BYTES) -> str:
    """``text`` if it is at most ``limit`` bytes, else its first and last ``limit // 2`` bytes
    with how many were dropped between them."""
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text
    half = limit // 2
    return _join(data[:half], len(data) - 2 * half, data[len(data) - half:] if half else b"")


def bound_json(value, *, text_bytes: int = RECORD_TEXT_BYTES, total_bytes: int = RECORD_DETAILS_BYTES):
    """``value`` (JSON-like: dicts, lists, strings, numbers) cut to the record bounds above:
    every string by :func:`bound_text`, at most ``RECORD_ITEMS`` entries per container (a
    ``"..."`` entry says how many were dropped), ``RECORD_DEPTH`` levels (deeper ones become
    a note), and if the JSON is still over ``total_bytes``, a note with its head and tail."""
    out = _bound(value, text_bytes, 0)
    try:
        blob = json.dumps(out, ensure_ascii=False, default=str)
    except (TypeError, ValueError) as e:  # a NaN key, a cycle: not a record, say what
        return {"unrecordable": f"{type(e).__name__}: {e}"}
    if len(blob.encode(errors="replace")) <= total_bytes:
        return out
    return {"over_bound": f"{len(blob.encode(errors='replace'))} bytes of JSON, over the bound of {total_bytes}",
            "json": bound_text(blob, total_bytes // 2)}


def _bound(value, text_bytes: int, depth: int):
    if isinstance(value, str):
        return bound_text(value, text_bytes)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if depth >= RECORD_DEPTH:
        return f"[nested deeper than {RECORD_DEPTH} levels: not kept]"
    if isinstance(value, dict):
        items = list(value.items())
        out = {bound_text(str(k), 256): _bound(v, text_bytes, depth + 1) for k, v in items[:RECORD_ITEMS]}
        if len(items) > RECORD_ITEMS:
            out["..."] = f"{len(items) - RECORD_ITEMS} more entries not kept"
        return out
    if isinstance(value, (list, tuple)):
        kept = [_bound(v, text_bytes, depth + 1) for v in value[:RECORD_ITEMS]]
        if len(value) > RECORD_ITEMS:
            kept.append(f"... {len(value) - RECORD_ITEMS} more items not kept")
        return kept
    return bound_text(str(value), text_bytes)
