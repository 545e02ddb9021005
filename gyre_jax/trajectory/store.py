"""Durable, append-only store of one run's records, with a training cursor.

Format: a length + CRC32 framed binary log (``log.bin``). Each frame is::

    b"GYR1" | u32 payload length | u32 crc32(payload) | payload (records.to_bytes)

Why this and not JSONL or ArrayRecord: the payload is the raw little-endian
token bytes (4 B/token, decoded zero-copy), which JSONL cannot carry without
base64 (+33%) and per-line parsing; the CRC tells a torn or damaged frame from a
good one with certainty, which a JSON line that happens to parse cannot; the
magic lets a reader resynchronise after a damaged frame; ArrayRecord is a heavier
dependency, is not meant to be read while it is being written, and gives no
control over the torn-tail policy. One ``os.write`` per frame on an
``O_APPEND`` descriptor.

Crash safety. A ``kill -9`` can cut a frame short (a large ``write`` is stopped
between pages), never reorder it, so a crash leaves at most one torn frame at the
end. When a writer opens the store it scans the log; bytes after the last good
frame that no good frame follows are a torn tail: they are copied to
``torn/<offset>.bin``, the log is truncated to the last good frame, and the event
is logged (warning), appended to ``events.jsonl`` and listed in
``stats().torn_tails``. A damaged frame *followed by* good frames is never
truncated: it is skipped by resynchronising on the magic and listed in
``stats().corrupt_regions``. What ``write`` returned is in the page cache and
survives a process crash; ``StoreConfig.fsync`` bounds what a power or kernel
failure can lose: ``always`` (fsync each append), ``interval`` (at most
``fsync_interval_s`` of appends, checked at each append and at close), ``never``.

Readers. Any number of read-only ``TrajectoryStore(dir, writable=False)``
instances may tail the log while one writer (an ``flock``) appends: ``refresh()``
indexes new complete frames and leaves an incomplete tail for the next call.
It reads with ``pread`` (no mapping): the writer may cut a torn tail or its own
failed frame while a reader looks at it, and the cursor's loader reads again when
a compaction ran between its snapshot and its journal (tests/test_store_races.py).

Validation. ``append`` takes records or raw dicts (what the proxy receives).
An invalid record (field checks in records.py, or cross-record checks here: run
id, duplicate call index, a call after its rollout's outcome, a second outcome,
task/group ids that change within a rollout) is written with its error text to
``quarantine.jsonl``, counted, and the ``RecordError`` is raised. Good records
before and after it are kept. An exact re-send of a stored record is counted as a
duplicate and not written twice.

Cursor. Which rollouts the trainer consumed (trained, or dropped with a reason),
with the step and the byte offset of each one's outcome frame (so a cursor
restored against the wrong log fails loudly). Durable as a snapshot plus a
journal, so a step costs one short line, not a rewrite of every step before it:

  * ``cursor.jsonl``, the journal: one line per ``mark_trained``/``mark_dropped``
    call, ``{"epoch": E, "step", "state", "reason", "rollouts": {id: outcome offset}}``,
    written at the journal's good end and fsynced before the call returns. A
    failed write is cut back (memory stays what the disk says). A line without its
    newline, or that does not parse, at the end is a torn tail (a crash mid-write):
    ignored when read, cut off when the journal is next written. Such a line with a
    good line after it is damage: opening fails, naming the file and the line.
  * ``cursor.json``, the snapshot (write temp, fsync, rename, fsync dir): the whole
    cursor and the journal epoch ``E`` it continues with. Written by
    ``restore_cursor`` and by compaction (when the journal outgrows the snapshot,
    and at least ``CURSOR_COMPACT_MIN_BYTES``: total bytes written stay linear in
    the steps). The snapshot with epoch E+1 is written first, then the journal is
    emptied; a crash between the two leaves epoch-E lines, which are skipped. So
    every prefix of the write sequence reads back as the last acknowledged cursor.

A workdir from before the journal (a ``cursor.json`` with no epoch) reads as
epoch 0 with an empty journal. ``pending_rollouts()`` is "has an outcome, all its
calls are in, not consumed" in arrival order. For exact resume, save
``cursor_state()`` in the training checkpoint with the params and call
``restore_cursor`` with it on restore: rollouts marked after that checkpoint
become pending again.

Damage report (call both at resume, and log them). A rollout's outcome is
appended after all its calls (a call after the outcome is refused), so a rollout
whose outcome frame was lost to damage would otherwise just look unfinished, and
silently never train. ``unfinished_rollouts()`` lists the rollouts with calls and
no outcome: still running, or (read at resume, when the process that ran them is
gone) never to finish, because the crash cut them off or their outcome was lost.
``damaged_rollouts()`` says which rollouts damage may have cost records, and how
sure that is. Damage is every ``corrupt_regions`` range (bytes still in
``log.bin``) and every torn tail (bytes saved in ``torn/``). In those bytes the
store walks frame by frame and reads each frame's JSON header where it can. The
CRC failed, so a readable header is a best reading, not proof (a flip that turns
one rollout id into another, still valid JSON, would fool it); it is the only
way to name a rollout from damaged bytes. Bytes it cannot read as frames are
*unaccounted*: they could hold any rollout's frame. Offsets order frames in
time (a torn tail at offset T came after every frame before T and before every
frame at T or later, which recovery appended), so unaccounted damage can hold
only the outcome of a rollout whose last good record precedes it. Per rollout
that is not complete, ``DamagedRollout.reason`` says:

  * ``calls_missing``: the outcome is stored but fewer calls than its ``num_calls``
    are. Certain: calls precede the outcome, so they will never arrive. Regions:
    damage naming one of its calls, and unaccounted damage before its outcome
    (none: the calls were never stored, e.g. quarantined or never sent).
  * ``outcome_damaged``: no outcome; a damaged frame's header names its outcome.
  * ``call_damaged``: no outcome; a damaged frame's header names one of its calls
    (when it finishes, it will be incomplete).
  * ``outcome_maybe_damaged``: no outcome; unaccounted damage lies after its last
    good record, so its outcome may have been there. Not provable either way: it
    may just have been running when the log was damaged.

Frames a power failure took whole (``fsync`` other than ``always``) leave no bytes
to read; such a rollout shows in ``unfinished_rollouts()`` only. Frames with a
good CRC that break the cross-record rules are not damage: ``stats().conflicts``.

Cost: opening scans and CRC-checks the whole log (~1 GB/s) and parses only the
small JSON headers; reading a rollout reads just its frames (``os.pread``).
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import struct
import threading
import time
import zlib
from typing import Any, Iterable, Mapping, cast

import numpy as np

from gyre_jax.errors import StorageError, storage_error
from gyre_jax.trajectory.records import (
    ModelCallRecord,
    Record,
    RecordError,
    RolloutOutcome,
    record_from_bytes,
    record_from_dict,
    record_from_json,
)

log = logging.getLogger(__name__)

MAGIC = b"GYR1"
_FRAME = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
MAX_PAYLOAD = 1 << 30
FSYNC_POLICIES = ("always", "interval", "never")
LOG_NAME, META_NAME, CURSOR_NAME, JOURNAL_NAME = "log.bin", "meta.json", "cursor.json", "cursor.jsonl"
CURSOR_COMPACT_MIN_BYTES = 64 << 10  # journal bytes below which compaction is not worth a snapshot
QUARANTINE_NAME, EVENTS_NAME, TORN_DIR = "quarantine.jsonl", "events.jsonl", "torn"


class StoreBusy(RuntimeError):
    """Another process has this store open for writing (or holds its cursor)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    fsync: str = "interval"  # 'always' | 'interval' | 'never' (module docstring)
    fsync_interval_s: float = 1.0  # for 'interval'
    vocab_size: int | None = None  # if set, token ids must be < vocab_size

    def __post_init__(self):
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"StoreConfig.fsync={self.fsync!r}; known: {FSYNC_POLICIES}")
        if not self.fsync_interval_s > 0:
            raise ValueError(f"StoreConfig.fsync_interval_s={self.fsync_interval_s} must be > 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"StoreConfig.vocab_size={self.vocab_size} must be >= 1")


@dataclasses.dataclass(frozen=True)
class StoreStats:
    calls: int
    outcomes: int
    rollouts: int  # rollouts with at least one record
    complete: int  # outcome present and all its calls in
    incomplete: int  # outcome present but fewer calls than outcome.num_calls
    pending: int  # complete and not consumed
    unfinished: int  # calls and no outcome: running, or at resume, never to finish (unfinished_rollouts)
    damaged_rollouts: int  # rollouts damage may have cost records (damaged_rollouts())
    trained: int
    dropped: int
    quarantined: int
    duplicates: int  # exact re-sends, not written twice
    torn_tails: tuple  # ((offset, nbytes, saved_to), ...) truncated by writer recovery, all time
    corrupt_regions: tuple  # ((offset, nbytes), ...) damaged frames skipped (followed by good ones)
    conflicts: tuple  # ((offset, message), ...) frames in the log that break cross-record rules
    tail_pending_bytes: int  # reader: bytes after the last complete frame (a write in progress)
    log_bytes: int


DAMAGE_REASONS = ("calls_missing", "outcome_damaged", "call_damaged", "outcome_maybe_damaged")


@dataclasses.dataclass(frozen=True)
class DamagedRollout:
    """A rollout that is not complete and that damage may have cost records (module docstring)."""

    rollout_id: str
    reason: str  # one of DAMAGE_REASONS
    calls: int  # its call records in the index (0: none survived)
    regions: tuple  # ((offset, nbytes, source), ...) damage that names it or may hold its records;
    # source: LOG_NAME (bytes still in the log) or the torn-tail file the bytes were saved to


@dataclasses.dataclass
class _Rollout:
    task_id: str
    group_id: str
    calls: dict  # call_index -> (offset, payload_len)
    outcome: tuple | None = None  # (offset, payload_len)
    num_calls: int | None = None


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


def _atomic_write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a failed write leaves no half file behind
            os.unlink(tmp)
        raise
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _append_line(path: str, obj) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj, separators=(",", ":"), default=_jsonable) + "\n")
        f.flush()
        os.fsync(f.fileno())


class TrajectoryStore:
    """One run's records in ``directory``. See the module docstring."""

    def __init__(self, directory: str, *, run_id: str | None = None, config: StoreConfig = StoreConfig(), writable: bool = True):
        self.directory = os.path.abspath(directory)
        self.config = config
        self.writable = writable
        self._lock = threading.RLock()  # appends may come from several threads of the proxy
        self._path = lambda name: os.path.join(self.directory, name)
        meta_path = self._path(META_NAME)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if run_id is not None and meta["run_id"] != run_id:
                raise ValueError(f"store {self.directory} belongs to run {meta['run_id']!r}, not {run_id!r}")
            self.run_id = meta["run_id"]
        else:
            if not writable or run_id is None:
                raise FileNotFoundError(f"no store at {self.directory} (creating one needs writable=True and a run_id)")
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write_json(meta_path, {"format": "gyre-trajectory-log", "version": 1, "run_id": run_id})
            self.run_id = run_id
        self._writer_lock_f = None
        self._cursor_lock_f = None
        if writable:
            self._writer_lock_f = self._take_lock("writer.lock", "writer")
        log_path = self._path(LOG_NAME)
        if writable:
            self._wfd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._rfd = os.open(log_path, os.O_RDONLY)
        self._rollouts: dict[str, _Rollout] = {}
        self._outcome_order: list[str] = []
        self._ncalls = 0
        self._duplicates = 0
        self._corrupt: list = []
        self._conflicts: list = []
        self._damage_read: dict = {}  # region -> _read_damage result
        self._scanned = 0  # log offset up to which frames are indexed
        self._tail_pending = 0
        self._last_sync = time.monotonic()
        self._dirty = False
        self._closed = False
        self.refresh()
        if writable:
            self._recover_tail()
        self._consumed: dict[str, dict] = {}
        self._cursor_epoch = 0  # journal lines of this epoch continue the snapshot
        self._journal_good = 0  # journal bytes up to the end of its last good line
        self._load_cursor()

    # ------------------------------------------------------------------ open / scan
    def _take_lock(self, name: str, what: str):
        f = open(self._path(name), "a")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StoreBusy(f"another process holds the {what} lock of {self.directory}") from None
        return f

    def refresh(self) -> int:
        """Index complete frames appended since the last scan; returns how many.

        Read with ``pread``, never through a mapping: a writer cuts bytes after the last good frame (a torn
        tail when it opens, its own failed frame in ``_write``), and a reader that touches a mapped page past
        the new end of the file is killed by SIGBUS. Good frames are never cut, so a copy read here stays
        true; a tail read as it is being cut is just shorter (pending, read again next time)."""
        with self._lock:
            end = os.fstat(self._rfd).st_size
            if end <= self._scanned:
                self._tail_pending = 0
                return 0
            n, off, corrupt = 0, self._scanned, []
            while off < end:
                head = os.pread(self._rfd, _FRAME.size, off)
                if len(head) == _FRAME.size:
                    magic, plen, crc = _FRAME.unpack(head)
                    if magic == MAGIC and plen <= MAX_PAYLOAD and off + _FRAME.size + plen <= end:
                        payload = os.pread(self._rfd, plen, off + _FRAME.size)
                        if len(payload) == plen and zlib.crc32(payload) == crc:
                            self._index_frame(payload, off, plen)
                            n, off = n + 1, off + _FRAME.size + plen
                            continue
                # Damage or a tail: is a good frame further on (_scan)? Read from a copy of the rest.
                rest = os.pread(self._rfd, end - off, off)
                frames, bad, tail = _scan(rest, 0, len(rest))
                view = memoryview(rest)
                for f_off, plen in frames:
                    self._index_frame(view[f_off + _FRAME.size : f_off + _FRAME.size + plen], off + f_off, plen)
                n, corrupt, end, off = n + len(frames), [(off + o, k) for o, k in bad], off + len(rest), off + tail
                break
            for c_off, k in corrupt:
                log.warning("trajectory store %s: damaged bytes [%d, %d) skipped", self.directory, c_off, c_off + k)
            self._corrupt.extend(corrupt)
            self._scanned = off
            self._tail_pending = end - off
            return n

    def _index_frame(self, payload, off: int, plen: int) -> None:
        """Index the frame at ``off`` from its payload's JSON header."""
        try:
            (hlen,) = struct.unpack_from("<I", payload, 0) if plen >= 4 else (plen,)
            h = json.loads(bytes(payload[4 : 4 + min(hlen, plen - 4)]))
            if not isinstance(h, dict):
                raise ValueError(f"header is {type(h).__name__}, not a JSON object")
            self._check_and_index(h, off, plen)
        except (RecordError, ValueError, KeyError, TypeError, struct.error) as e:
            self._conflicts.append((off, str(e)))
            log.warning("trajectory store %s: frame at offset %d not indexed: %s", self.directory, off, e)

    def _recover_tail(self) -> None:
        size = os.fstat(self._rfd).st_size
        if self._scanned == size:
            return
        off, n = self._scanned, size - self._scanned
        os.makedirs(self._path(TORN_DIR), exist_ok=True)
        saved, k = self._path(os.path.join(TORN_DIR, f"{off}.bin")), 1
        while os.path.exists(saved):  # an earlier crash tore the log at this same offset
            saved, k = self._path(os.path.join(TORN_DIR, f"{off}.{k}.bin")), k + 1
        with open(saved, "wb") as f:
            f.write(os.pread(self._rfd, n, off))
            f.flush()
            os.fsync(f.fileno())
        os.truncate(self._path(LOG_NAME), off)
        os.fsync(self._wfd)
        self._tail_pending = 0
        _append_line(self._path(EVENTS_NAME), {"time": time.time(), "event": "torn_tail_truncated", "offset": off, "nbytes": n, "saved_to": saved})
        log.warning("trajectory store %s: torn tail of %d bytes at offset %d truncated (saved to %s)", self.directory, n, off, saved)

    # ------------------------------------------------------------------ append
    def append(self, record: Record | Mapping[str, Any] | str | bytes) -> int:
        """Validate and append one record (object, raw dict or JSON); returns its log offset.

        Raises RecordError after quarantining an invalid record. An exact re-send
        of a stored record returns the stored offset and counts a duplicate.
        """
        if not self.writable:
            raise RuntimeError(f"store {self.directory} was opened read-only")
        raw = record
        try:
            if isinstance(record, (str, bytes)):
                record = record_from_json(record)
            elif isinstance(record, Mapping):
                record = record_from_dict(record)
            elif not isinstance(record, (ModelCallRecord, RolloutOutcome)):
                raise RecordError("record", "type", f"expected ModelCallRecord, RolloutOutcome, dict or JSON, got {type(record).__name__}")
            if isinstance(record, ModelCallRecord) and self.config.vocab_size is not None:
                for f in ("prompt_ids", "output_ids"):
                    a = getattr(record, f)
                    if a.shape[0] and int(a.max()) >= self.config.vocab_size:
                        k = int(np.flatnonzero(a >= self.config.vocab_size)[0])
                        raise RecordError(record.where, f, f"token id {int(a[k])} at index {k} >= vocab_size {self.config.vocab_size}")
            header, parts = record.to_parts()  # zero-copy buffers of the payload
            plen = sum(len(b) for b in parts)
            with self._lock:
                self._check_open()
                dup = self._duplicate_offset(record, plen)
                if dup is not None:
                    self._duplicates += 1
                    return dup
                off = self._scanned
                self._check_and_index(header, off, plen, record=record)
                crc = 0
                for b in parts:
                    crc = zlib.crc32(b, crc)
                self._write([_FRAME.pack(MAGIC, plen, crc), *parts], off)
                return off
        except RecordError as e:
            self._quarantine(raw if not isinstance(raw, (ModelCallRecord, RolloutOutcome)) else raw.to_dict(), e)
            raise

    def _duplicate_offset(self, record: Record, plen: int) -> int | None:
        r = self._rollouts.get(record.rollout_id)
        if r is None:
            return None
        loc = r.calls.get(record.call_index) if isinstance(record, ModelCallRecord) else r.outcome
        if loc is None or loc[1] != plen:
            return None
        return loc[0] if self._read_payload(*loc) == record.to_bytes() else None

    def _check_and_index(self, h: Mapping[str, Any], off: int, plen: int, record: Record | None = None) -> None:
        """Cross-record rules; on success the frame is in the index."""
        kind, rid = h["kind"], h["rollout_id"]
        where = record.where if record is not None else f"frame at offset {off} (rollout_id={rid!r})"
        if h["run_id"] != self.run_id:
            raise RecordError(where, "run_id", f"{h['run_id']!r} but this store holds run {self.run_id!r}")
        r = self._rollouts.get(rid)
        if r is not None:
            for f in ("task_id", "group_id"):
                if h[f] != getattr(r, f):
                    raise RecordError(where, f, f"{h[f]!r} but earlier records of rollout {rid!r} say {getattr(r, f)!r}")
            if r.outcome is not None:
                what = "a second outcome" if kind == "outcome" else "a call"
                raise RecordError(where, "rollout_id", f"{what} for rollout {rid!r}, whose outcome is already recorded at offset {r.outcome[0]}")
        if kind == "call":
            ci = h["call_index"]
            if r is not None and ci in r.calls:
                raise RecordError(where, "call_index", f"rollout {rid!r} already has a different call {ci} at offset {r.calls[ci][0]}")
        if r is None:
            r = self._rollouts[rid] = _Rollout(task_id=h["task_id"], group_id=h["group_id"], calls={})
        if kind == "call":
            r.calls[h["call_index"]] = (off, plen)
            self._ncalls += 1
        else:
            r.outcome = (off, plen)
            r.num_calls = h.get("num_calls")
            self._outcome_order.append(rid)

    def _write(self, bufs: list, off: int) -> None:
        total = sum(len(b) for b in bufs)
        bufs = [memoryview(b) for b in bufs]
        written = 0
        try:
            while True:  # one writev per frame; loop only on a short write
                n = os.writev(self._wfd, bufs)
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
            # Do not leave our own torn frame behind; undo the index entry too.
            self._unindex_last(off)
            try:
                os.truncate(self._path(LOG_NAME), off)
            except OSError:  # e.g. a read-only remount: the reader's torn-tail recovery handles what is left
                log.exception("trajectory store %s: could not cut a failed write back to offset %d", self.directory, off)
            if isinstance(e, OSError):
                raise storage_error(self._path(LOG_NAME), "appending to", e) from e
            raise
        self._scanned = off + total
        self._dirty = True
        now = time.monotonic()
        if self.config.fsync == "always" or (self.config.fsync == "interval" and now - self._last_sync >= self.config.fsync_interval_s):
            try:
                os.fsync(self._wfd)
            except OSError as e:  # the frame may not be durable: say so, never carry on as if it were
                raise storage_error(self._path(LOG_NAME), "syncing", e) from e
            self._last_sync, self._dirty = now, False

    def _unindex_last(self, off: int) -> None:
        for rid, r in list(self._rollouts.items()):
            for ci, loc in list(r.calls.items()):
                if loc[0] == off:
                    del r.calls[ci]
                    self._ncalls -= 1
            if r.outcome is not None and r.outcome[0] == off:
                r.outcome = None
                self._outcome_order.remove(rid)
            if not r.calls and r.outcome is None:  # the failed frame was its first: it was never stored
                del self._rollouts[rid]

    def _quarantine(self, raw, err: RecordError) -> None:
        entry = {"time": time.time(), "error": str(err), "where": err.where, "field": err.field, "record": raw}
        with self._lock:
            try:
                _append_line(self._path(QUARANTINE_NAME), entry)
            except OSError as e:  # the bad record must not be lost silently: the run stops instead
                raise storage_error(self._path(QUARANTINE_NAME), "quarantining a record in", e) from e
        log.warning("trajectory store %s: quarantined %s", self.directory, err)

    # ------------------------------------------------------------------ read
    def _read_payload(self, off: int, plen: int) -> bytes:
        frame = os.pread(self._rfd, _FRAME.size + plen, off)
        if _frame_ok(frame, 0, len(frame)) != plen:
            raise OSError(f"trajectory store {self.directory}: frame at offset {off} changed on disk (bad CRC)")
        return frame[_FRAME.size :]

    def rollout_ids(self) -> list[str]:
        with self._lock:
            return list(self._rollouts)

    def calls(self, rollout_id: str) -> list[ModelCallRecord]:
        """All calls of a rollout, by call index."""
        r = self._rollouts.get(rollout_id)
        if r is None:
            raise KeyError(f"no records for rollout {rollout_id!r} in {self.directory}")
        # The index files call payloads under calls and the outcome's under outcome.
        return [cast(ModelCallRecord, record_from_bytes(self._read_payload(*r.calls[ci]))) for ci in sorted(r.calls)]

    def outcome(self, rollout_id: str) -> RolloutOutcome | None:
        r = self._rollouts.get(rollout_id)
        if r is None:
            raise KeyError(f"no records for rollout {rollout_id!r} in {self.directory}")
        return None if r.outcome is None else cast(RolloutOutcome, record_from_bytes(self._read_payload(*r.outcome)))

    def _is_complete(self, r: _Rollout) -> bool:
        return r.outcome is not None and (r.num_calls is None or len(r.calls) >= r.num_calls)

    def complete_rollouts(self) -> list[str]:
        """Rollouts with an outcome and all their calls, in outcome arrival order."""
        with self._lock:
            return [rid for rid in self._outcome_order if self._is_complete(self._rollouts[rid])]

    def pending_rollouts(self) -> list[str]:
        """Complete rollouts the trainer has not consumed (trained or dropped), in arrival order."""
        return [rid for rid in self.complete_rollouts() if rid not in self._consumed]

    def unfinished_rollouts(self) -> list[str]:
        """Rollouts with calls and no outcome, in first-record order.

        Still running, or, read at resume once the process that ran them is gone,
        never to finish: cut off by the crash, or their outcome was lost (see
        ``damaged_rollouts``).
        """
        with self._lock:
            return [rid for rid, r in self._rollouts.items() if r.outcome is None and r.calls]

    def damaged_rollouts(self) -> dict[str, DamagedRollout]:
        """Rollouts that are not complete and that damage may have cost records, by id.

        Reasons and how sure each is: module docstring ("Damage report"). Rollouts
        known only from damaged bytes (every record damaged) are included with
        ``calls=0``. Order: first-record order, then those known only from damage.
        """
        with self._lock:
            regions = [(off, n, LOG_NAME) for off, n in self._corrupt]
            regions += [(off, n, saved) for off, n, saved in self.torn_tails()]
            regions.sort(key=lambda g: g[0])  # stable: tails torn at one offset stay in time order
            rank = {g: i for i, g in enumerate(regions)}
            named: dict[str, dict[str, list]] = {}  # rollout id -> kind -> regions naming it
            unaccounted = []
            for reg in regions:
                names, whole = self._read_region(reg)
                for kind, rid in names:
                    named.setdefault(rid, {}).setdefault(kind, []).append(reg)
                if not whole:
                    unaccounted.append(reg)
            out = {}
            for rid in dict.fromkeys([*self._rollouts, *named]):
                r, nm = self._rollouts.get(rid), named.get(rid, {})
                if r is not None and self._is_complete(r):
                    continue
                if r is not None and r.outcome is not None:
                    reason = "calls_missing"
                    regs = nm.get("call", []) + [g for g in unaccounted if g[0] <= r.outcome[0]]
                else:
                    last = max((off for off, _ in r.calls.values()), default=-1) if r is not None else -1
                    after = [g for g in unaccounted if g[0] > last]
                    if "outcome" in nm:
                        reason, regs = "outcome_damaged", nm["outcome"] + nm.get("call", [])
                    elif "call" in nm:
                        reason, regs = "call_damaged", nm["call"] + after
                    elif after:
                        reason, regs = "outcome_maybe_damaged", after
                    else:
                        continue
                out[rid] = DamagedRollout(rid, reason, 0 if r is None else len(r.calls), tuple(sorted(set(regs), key=rank.__getitem__)))
            return out

    def _read_region(self, reg: tuple) -> tuple[list, bool]:
        if reg not in self._damage_read:
            off, n, source = reg
            if source == LOG_NAME:
                self._damage_read[reg] = _read_damage(os.pread(self._rfd, n, off), torn=False)
            elif os.path.exists(source):
                with open(source, "rb") as f:
                    self._damage_read[reg] = _read_damage(f.read(), torn=True)
            else:
                self._damage_read[reg] = ([], False)  # the saved bytes are gone: could be anything
        return self._damage_read[reg]

    # ------------------------------------------------------------------ cursor
    def _load_cursor(self) -> None:
        """Snapshot + journal as on disk (module docstring). A reader may race a compaction: it retries."""
        for _ in range(20):
            before = self._snapshot_id()
            snap_epoch, consumed, good, epoch_seen = self._read_cursor_files()
            if epoch_seen is None and self._snapshot_id() == before:
                break
            # A compaction ran between reading the snapshot and the journal (the snapshot was replaced, or the
            # journal holds a newer epoch): what was read may miss the emptied journal's lines. Read both again.
            time.sleep(0.01)
        else:
            raise ValueError(f"cursor of {self.directory}: no consistent read in 20 tries (snapshot epoch {snap_epoch}, "
                             f"a journal line of epoch {epoch_seen}; a journal newer than its snapshot is damage)")
        self._consumed, self._cursor_epoch, self._journal_good = consumed, snap_epoch, good

    def _read_cursor_files(self) -> tuple[int, dict, int, int | None]:
        """(snapshot epoch, consumed, journal bytes up to the last good line, a newer epoch seen or None)."""
        path = self._path(CURSOR_NAME)
        state, epoch = {"run_id": self.run_id, "consumed": {}}, 0
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            epoch = int(state.get("journal_epoch", 0))  # a cursor.json from before the journal: epoch 0
        consumed = self._check_cursor(state)
        jpath = self._path(JOURNAL_NAME)
        try:
            with open(jpath, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return epoch, consumed, 0, None
        good, pos, bad = 0, 0, None  # bad: (line number, text) of an unreadable line not yet known to be the tail
        for lineno, line in enumerate(data.split(b"\n")[:-1], 1):  # the piece after the last newline is torn
            pos += len(line) + 1
            try:
                e = json.loads(line)
                rows, e_epoch = e["rollouts"], int(e["epoch"])
            except (ValueError, KeyError, TypeError):
                bad = bad or (lineno, line[:80])
                continue
            if bad is not None:
                raise ValueError(f"cursor journal {jpath} is damaged at line {bad[0]} ({bad[1]!r}), and good lines follow it")
            good = pos
            if e_epoch < epoch:
                continue  # written before the last compaction, which the snapshot holds
            if e_epoch > epoch:
                return epoch, consumed, good, e_epoch
            entry = {"state": e["state"], "step": e["step"], "reason": e["reason"]}
            for rid, off in rows.items():
                if rid in consumed:
                    raise ValueError(f"cursor journal {jpath} line {lineno}: rollout {rid!r} consumed twice")
                self._check_entry(rid, off)
                consumed[rid] = dict(entry, outcome_offset=off)
        return epoch, consumed, good, None

    def _check_entry(self, rid: str, off: int) -> None:
        r = self._rollouts.get(rid)
        if r is None or r.outcome is None or r.outcome[0] != off:
            have = None if r is None or r.outcome is None else r.outcome[0]
            raise ValueError(f"cursor entry {rid!r} (outcome at offset {off}) does not match this log (outcome at {have})")

    def _check_cursor(self, state: Mapping[str, Any]) -> dict[str, dict]:
        if state.get("run_id") != self.run_id:
            raise ValueError(f"cursor is for run {state.get('run_id')!r}, store holds {self.run_id!r}")
        consumed = {}
        for rid, e in state["consumed"].items():
            self._check_entry(rid, e["outcome_offset"])
            consumed[rid] = dict(e)
        return consumed

    def cursor_state(self) -> dict[str, Any]:
        """JSON-able cursor, to save in a training checkpoint."""
        return {"version": 1, "run_id": self.run_id, "log_offset": self._scanned, "consumed": {k: dict(v) for k, v in self._consumed.items()}}

    def restore_cursor(self, state: Mapping[str, Any]) -> None:
        """Make ``state`` (from ``cursor_state``) the persisted cursor, e.g. on checkpoint restore."""
        with self._lock:
            consumed = self._check_cursor(state)
            self._own_cursor()
            self._write_snapshot(consumed)

    def _own_cursor(self) -> None:
        """Take the cursor lock (once); what another holder wrote before is read again first."""
        if self._cursor_lock_f is None:
            self._cursor_lock_f = self._take_lock("cursor.lock", "cursor")
            self._load_cursor()

    def _write_snapshot(self, consumed: dict[str, dict]) -> None:
        """``consumed`` as the snapshot of the next epoch, then an empty journal (module docstring)."""
        path, epoch = self._path(CURSOR_NAME), self._cursor_epoch + 1
        state = dict(self.cursor_state(), consumed=consumed, version=2, journal_epoch=epoch)
        try:
            _atomic_write_json(path, state)
        except OSError as e:
            raise storage_error(path, "writing", e) from e
        self._consumed, self._cursor_epoch = consumed, epoch  # durable from here: the journal's lines are stale
        try:
            self._truncate_journal(0)
        except OSError as e:  # harmless on disk (stale lines are skipped); the next compaction tries again
            log.warning("could not empty the cursor journal %s after a snapshot: %s", self._path(JOURNAL_NAME), e)

    def _truncate_journal(self, n: int) -> None:
        fd = os.open(self._path(JOURNAL_NAME), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, n)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._journal_good = n

    def _append_cursor(self, ids: list[str], entry: dict) -> None:
        """One journal line for ``ids``, durable on return; nothing of it on disk if this raises."""
        jpath = self._path(JOURNAL_NAME)
        line = json.dumps({"epoch": self._cursor_epoch, **entry, "rollouts": {rid: self._outcome_offset(rid) for rid in ids}},
                          separators=(",", ":")).encode() + b"\n"
        start = self._journal_good
        try:
            fd = os.open(jpath, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error(jpath, "writing", e) from e
        try:
            if os.fstat(fd).st_size != start:
                os.ftruncate(fd, start)  # a torn tail, or a failed write that could not be cut back then
            if self.journal_write(fd, line, start) != len(line):
                raise OSError(28, "short write to the cursor journal")
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the next append cuts it back before writing (size != start); a reader skips a torn tail
            raise storage_error(jpath, "writing", e) from e
        finally:
            os.close(fd)
        self._journal_good = start + len(line)

    def _snapshot_id(self) -> tuple | None:
        try:
            st = os.stat(self._path(CURSOR_NAME))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # a rename puts a new inode there

    def _outcome_offset(self, rid: str) -> int:
        """Where a finished rollout's outcome record starts (only finished rollouts are consumed)."""
        outcome = self._rollouts[rid].outcome
        if outcome is None:
            raise RuntimeError(f"store: rollout {rid!r} has no outcome record to consume")
        return outcome[0]

    def _snapshot_bytes(self) -> int:
        try:
            return os.path.getsize(self._path(CURSOR_NAME))
        except FileNotFoundError:
            return 0

    @staticmethod
    def journal_write(fd: int, line: bytes, offset: int) -> int:
        return os.pwrite(fd, line, offset)  # one seam for every journal write, so a fault injector (testing/faulty_main) can fail it like a full disk

    def _consume(self, rollout_ids: Iterable[str], entry: dict) -> None:
        with self._lock:
            self._consume_locked(list(rollout_ids), entry)

    def _consume_locked(self, ids: list[str], entry: dict) -> None:
        for rid in ids:
            r = self._rollouts.get(rid)
            if r is None or not self._is_complete(r):
                raise ValueError(f"cannot consume rollout {rid!r}: it is not complete in {self.directory}")
            if rid in self._consumed:
                raise ValueError(f"rollout {rid!r} was already consumed: {self._consumed[rid]}")
            if ids.count(rid) > 1:
                raise ValueError(f"rollout {rid!r} listed twice")
        self._own_cursor()
        for rid in ids:
            if rid in self._consumed:  # consumed by the cursor's previous holder, read when taking the lock
                raise ValueError(f"rollout {rid!r} was already consumed: {self._consumed[rid]}")
        self._append_cursor(ids, entry)  # memory changes only once the disk has it: no half-step in a save
        for rid in ids:
            self._consumed[rid] = dict(entry, outcome_offset=self._outcome_offset(rid))
        if self._journal_good > max(CURSOR_COMPACT_MIN_BYTES, self._snapshot_bytes()):
            try:
                self._write_snapshot(dict(self._consumed))
            except StorageError as e:  # the step is durable in the journal; compaction can wait for room
                log.warning("cursor compaction failed, the journal keeps growing: %s", e)

    def mark_trained(self, rollout_ids: Iterable[str], *, step: int) -> None:
        self._consume(rollout_ids, {"state": "trained", "step": int(step), "reason": None})

    def mark_dropped(self, rollout_ids: Iterable[str], *, step: int, reason: str) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError("mark_dropped needs a non-empty reason")
        self._consume(rollout_ids, {"state": "dropped", "step": int(step), "reason": reason})

    def consumed(self) -> dict[str, dict]:
        return {k: dict(v) for k, v in self._consumed.items()}

    # ------------------------------------------------------------------ stats / close
    def quarantined(self) -> list[dict]:
        path = self._path(QUARANTINE_NAME)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def torn_tails(self) -> list[tuple]:
        path = self._path(EVENTS_NAME)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            ev = [json.loads(line) for line in f if line.strip()]
        return [(e["offset"], e["nbytes"], e["saved_to"]) for e in ev if e["event"] == "torn_tail_truncated"]

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats()

    def _stats(self) -> StoreStats:
        complete = self.complete_rollouts()
        states = [e["state"] for e in self._consumed.values()]
        return StoreStats(
            calls=self._ncalls,
            outcomes=len(self._outcome_order),
            rollouts=len(self._rollouts),
            complete=len(complete),
            incomplete=len(self._outcome_order) - len(complete),
            pending=sum(rid not in self._consumed for rid in complete),
            unfinished=sum(r.outcome is None and bool(r.calls) for r in self._rollouts.values()),
            damaged_rollouts=len(self.damaged_rollouts()),
            trained=states.count("trained"),
            dropped=states.count("dropped"),
            quarantined=len(self.quarantined()),
            duplicates=self._duplicates,
            torn_tails=tuple(self.torn_tails()),
            corrupt_regions=tuple(self._corrupt),
            conflicts=tuple(self._conflicts),
            tail_pending_bytes=self._tail_pending,
            log_bytes=self._scanned + self._tail_pending,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.directory} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self.writable and self._dirty:
                os.fsync(self._wfd)
            self._closed = True
        if self.writable:
            os.close(self._wfd)
        os.close(self._rfd)
        for f in (self._writer_lock_f, self._cursor_lock_f):
            if f is not None:
                f.close()

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
