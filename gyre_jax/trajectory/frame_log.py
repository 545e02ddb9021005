"""The trajectory store's log: length + CRC32 frames appended to ``log.bin``.

Each frame is ``b"GYR1" | u32 payload length | u32 crc32(payload) | payload`` (the payload is
``records.to_bytes``: a JSON header, then raw little-endian arrays). Why this and not JSONL or
ArrayRecord: tokens travel as raw bytes (4 B/token, decoded zero-copy), which JSONL cannot carry
without base64 and per-line parsing; the CRC tells a torn or damaged frame from a good one with
certainty; the magic lets a reader resynchronise after damage; ArrayRecord is a heavier dependency
that is not meant to be read while written. One ``writev`` per frame on an ``O_APPEND`` descriptor.

Crash safety. A ``kill -9`` can cut a frame short, never reorder it, so a crash leaves at most one
torn frame at the end. A writer opening the log moves bytes after the last good frame that no good
frame follows (a torn tail) to ``torn/<offset>.bin``, truncates the log there and records the event in
``events.jsonl``. A damaged frame *followed by* good frames is skipped (resynchronising on the magic),
never truncated: a corrupt region. ``fsync`` (``StoreConfig.fsync``: always, interval, never) bounds
what a power failure can lose; what ``write`` returned survives a process crash.

Readers tail the log with ``pread``, never a mapping: a writer cuts bytes after the last good frame
(a torn tail at open, its own failed frame), and a reader touching a mapped page past the new end
would die of SIGBUS (tests/test_store_races.py).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import time
import zlib
from typing import Callable

import numpy as np

from gyre_jax.errors import storage_error

log = logging.getLogger(__name__)

MAGIC = b"GYR1"
_FRAME = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
MAX_PAYLOAD = 1 << 30
LOG_NAME, EVENTS_NAME, TORN_DIR = "log.bin", "events.jsonl", "torn"


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _frame_ok(buf, off: int, end: int) -> int:
    """Payload length if a complete frame with a good CRC starts at off, else -1 (bad) or -2 (incomplete)."""
    if end - off < _FRAME.size:
        return -2
    magic, plen, crc = _FRAME.unpack_from(buf, off)
    if magic != MAGIC or plen > MAX_PAYLOAD:
        return -1
    if off + _FRAME.size + plen > end:
        return -2
    if zlib.crc32(buf[off + _FRAME.size : off + _FRAME.size + plen]) != crc:
        return -1
    return plen


def _scan(buf, start: int, end: int):
    """Frames in buf[start:end]: ([(offset, plen)], [(corrupt offset, nbytes)], tail_start).

    ``tail_start`` is where the bytes that no good frame follows begin (== end when
    the log ends cleanly); the caller decides whether that tail is torn or pending.
    """
    frames: list[tuple[int, int]] = []
    corrupt: list[tuple[int, int]] = []
    off = start
    while off < end:
        plen = _frame_ok(buf, off, end)
        if plen >= 0:
            frames.append((off, plen))
            off += _FRAME.size + plen
            continue
        # Bad or incomplete here: is there a good frame later? Then [off, that) is
        # damage in the middle of the log; otherwise [off, end) is the tail.
        nxt = buf.find(MAGIC, off + 1, end)
        while nxt != -1 and _frame_ok(buf, nxt, end) < 0:
            nxt = buf.find(MAGIC, nxt + 1, end)
        if nxt == -1:
            return frames, corrupt, off
        corrupt.append((off, nxt - off))
        off = nxt
    return frames, corrupt, off


def _frame_header(buf, off: int, end: int) -> tuple[str, str, int] | None:
    """(kind, rollout_id, end of frame) from the frame header at off, if readable (CRC not checked)."""
    if end - off < _FRAME.size + 4:
        return None
    magic, plen, _ = _FRAME.unpack_from(buf, off)
    if magic != MAGIC or plen > MAX_PAYLOAD:
        return None
    (hlen,) = struct.unpack_from("<I", buf, off + _FRAME.size)
    h0 = off + _FRAME.size + 4
    if hlen > plen - 4 or h0 + hlen > end:
        return None
    try:
        h = json.loads(bytes(buf[h0 : h0 + hlen]))
    except ValueError:
        return None
    if not isinstance(h, dict) or h.get("kind") not in ("call", "outcome") or not isinstance(h.get("rollout_id"), str):
        return None
    return h["kind"], h["rollout_id"], off + _FRAME.size + plen


def _read_damage(buf, *, torn: bool) -> tuple[list[tuple[str, str]], bool]:
    """(kind, rollout_id) of each readable frame header in damaged bytes, and whether those frames tile them.

    Walks frame by frame from the start; where no header is readable, the bytes up to
    the next magic are unaccounted. A torn tail's last frame may run past the end.
    """
    names, whole, off, end = [], True, 0, len(buf)
    while off < end:
        h = _frame_header(buf, off, end)
        if h is None or (h[2] > end and not torn):
            whole = False
            nxt = buf.find(MAGIC, off + 1)
            off = end if nxt == -1 else nxt
            if h is not None:
                names.append(h[:2])
            continue
        names.append(h[:2])
        off = h[2]
    return names, whole


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return repr(x)


def append_line(path: str, obj) -> None:
    """One fsynced JSON line appended to ``path`` (events, quarantine)."""
    with open(path, "a") as f:
        f.write(json.dumps(obj, separators=(",", ":"), default=_jsonable) + "\n")
        f.flush()
        os.fsync(f.fileno())


class FrameLog:
    """``log.bin`` of one store directory: scan (index callback per good frame), append, read back.

    Not thread-safe by itself: the store calls it under its own lock."""

    def __init__(self, directory: str, *, writable: bool, fsync: str, fsync_interval_s: float):
        self.directory, self.writable = directory, writable
        self.fsync, self.fsync_interval_s = fsync, fsync_interval_s
        self.path = os.path.join(directory, LOG_NAME)
        if writable:
            self.wfd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._rfd = os.open(self.path, os.O_RDONLY)
        self.corrupt: list[tuple[int, int]] = []
        self.scanned = 0  # log offset up to which frames are indexed
        self.tail_pending = 0
        self._last_sync = time.monotonic()
        self._dirty = False

    def refresh(self, index_frame: Callable[[memoryview | bytes, int, int], None]) -> int:
        """Index complete frames appended since the last scan (``index_frame(payload, offset, plen)``); how many.

        Good frames are never cut, so a copy read here stays true; a tail read as it is being cut is just
        shorter (pending, read again next time)."""
        end = os.fstat(self._rfd).st_size
        if end <= self.scanned:
            self.tail_pending = 0
            return 0
        n, off, corrupt = 0, self.scanned, []
        while off < end:
            head = os.pread(self._rfd, _FRAME.size, off)
            if len(head) == _FRAME.size:
                magic, plen, crc = _FRAME.unpack(head)
                if magic == MAGIC and plen <= MAX_PAYLOAD and off + _FRAME.size + plen <= end:
                    payload = os.pread(self._rfd, plen, off + _FRAME.size)
                    if len(payload) == plen and zlib.crc32(payload) == crc:
                        index_frame(payload, off, plen)
                        n, off = n + 1, off + _FRAME.size + plen
                        continue
            # Damage or a tail: is a good frame further on (_scan)? Read from a copy of the rest.
            rest = os.pread(self._rfd, end - off, off)
            frames, bad, tail = _scan(rest, 0, len(rest))
            view = memoryview(rest)
            for f_off, plen in frames:
                index_frame(view[f_off + _FRAME.size : f_off + _FRAME.size + plen], off + f_off, plen)
            n, corrupt, end, off = n + len(frames), [(off + o, k) for o, k in bad], off + len(rest), off + tail
            break
        for c_off, k in corrupt:
            log.warning("trajectory store %s: damaged bytes [%d, %d) skipped", self.directory, c_off, c_off + k)
        self.corrupt.extend(corrupt)
        self.scanned = off
        self.tail_pending = end - off
        return n

    def recover_tail(self) -> None:
        """The writer's open: a torn tail (bytes no good frame follows) is saved under torn/ and cut off."""
        size = os.fstat(self._rfd).st_size
        if self.scanned == size:
            return
        off, n = self.scanned, size - self.scanned
        os.makedirs(os.path.join(self.directory, TORN_DIR), exist_ok=True)
        saved, k = os.path.join(self.directory, TORN_DIR, f"{off}.bin"), 1
        while os.path.exists(saved):  # an earlier crash tore the log at this same offset
            saved, k = os.path.join(self.directory, TORN_DIR, f"{off}.{k}.bin"), k + 1
        with open(saved, "wb") as f:
            f.write(os.pread(self._rfd, n, off))
            f.flush()
            os.fsync(f.fileno())
        os.truncate(self.path, off)
        os.fsync(self.wfd)
        self.tail_pending = 0
        append_line(os.path.join(self.directory, EVENTS_NAME),
                    {"time": time.time(), "event": "torn_tail_truncated", "offset": off, "nbytes": n, "saved_to": saved})
        log.warning("trajectory store %s: torn tail of %d bytes at offset %d truncated (saved to %s)",
                    self.directory, n, off, saved)

    def torn_tails(self) -> list[tuple]:
        path = os.path.join(self.directory, EVENTS_NAME)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            ev = [json.loads(line) for line in f if line.strip()]
        return [(e["offset"], e["nbytes"], e["saved_to"]) for e in ev if e["event"] == "torn_tail_truncated"]

    def write(self, bufs: list, off: int) -> None:
        """One frame's buffers at ``off`` (the log's end). On failure nothing of it stays in the file (cut back
        to ``off``) and an OSError becomes the store's StorageError naming the log."""
        total = sum(len(b) for b in bufs)
        bufs = [memoryview(b) for b in bufs]
        written = 0
        try:
            while True:  # one writev per frame; loop only on a short write
                n = os.writev(self.wfd, bufs)
                written += n
                if written == total:
                    break
                while n:
                    k = min(n, len(bufs[0]))
                    bufs[0] = bufs[0][k:]
                    n -= k
                    if not len(bufs[0]):
                        bufs.pop(0)
        except BaseException as e:
            # Do not leave our own torn frame behind.
            try:
                os.truncate(self.path, off)
            except OSError:  # e.g. a read-only remount: the reader's torn-tail recovery handles what is left
                log.exception("trajectory store %s: could not cut a failed write back to offset %d", self.directory, off)
            if isinstance(e, OSError):
                raise storage_error(self.path, "appending to", e) from e
            raise
        self.scanned = off + total
        self._dirty = True
        now = time.monotonic()
        if self.fsync == "always" or (self.fsync == "interval" and now - self._last_sync >= self.fsync_interval_s):
            try:
                os.fsync(self.wfd)
            except OSError as e:  # the frame may not be durable: say so, never carry on as if it were
                raise storage_error(self.path, "syncing", e) from e
            self._last_sync, self._dirty = now, False

    def read_payload(self, off: int, plen: int) -> bytes:
        frame = os.pread(self._rfd, _FRAME.size + plen, off)
        if _frame_ok(frame, 0, len(frame)) != plen:
            raise OSError(f"trajectory store {self.directory}: frame at offset {off} changed on disk (bad CRC)")
        return frame[_FRAME.size :]

    def read_bytes(self, off: int, n: int) -> bytes:
        return os.pread(self._rfd, n, off)

    def close(self) -> None:
        if self.writable:
            if self._dirty:
                os.fsync(self.wfd)
            os.close(self.wfd)
        os.close(self._rfd)
