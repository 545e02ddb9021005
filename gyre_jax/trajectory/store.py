"""Durable, append-only store of one run's records: the frame log, its index, the cursor.

``TrajectoryStore(dir, run_id=...)`` appends validated records (``append``) to the frame log
(``frame_log.py``: format, torn tails, crash safety), keeps an in-memory index of every rollout's
frames, answers queries (``calls``, ``outcome``, ``pending_rollouts`` ...), and owns the training
cursor (``cursor.py``: which rollouts were trained or dropped, snapshot + journal). One writer (an
``flock``) and any number of read-only tailers (``writable=False``; ``refresh()`` indexes new
frames). docs/design.md ("The resume protocol") says what each write makes durable.

Validation. ``append`` takes records or raw dicts (what the proxy receives). An invalid record
(field checks in records.py, or cross-record checks here: run id, duplicate call index, a call
after its rollout's outcome, a second outcome, task/group ids that change within a rollout) is
written with its error text to ``quarantine.jsonl``, counted, and the ``RecordError`` is raised.
An exact re-send of a stored record is counted as a duplicate and not written twice.

``pending_rollouts()`` is "has an outcome, all its calls are in, not consumed", in arrival order.
For exact resume, save ``cursor_state()`` in the training checkpoint and ``restore_cursor`` it on
restore: rollouts marked after that checkpoint become pending again.

Damage report (call both at resume, and log them). A rollout's outcome is appended after all its
calls, so a rollout whose outcome frame was lost to damage would otherwise look unfinished and
silently never train. ``unfinished_rollouts()`` lists rollouts with calls and no outcome (running,
or at resume never to finish). ``damaged_rollouts()`` says which rollouts damage (corrupt regions
still in the log, torn tails saved under ``torn/``) may have cost records: each damaged frame's
JSON header is read where it can be (a best reading: the CRC failed), and bytes that cannot be read
as frames are *unaccounted*, which can hold only the outcome of a rollout whose last good record
precedes them. ``DamagedRollout.reason``:

  * ``calls_missing``: the outcome is stored but fewer calls than its ``num_calls`` (certain);
  * ``outcome_damaged``: no outcome; a damaged frame's header names its outcome;
  * ``call_damaged``: no outcome; a damaged frame's header names one of its calls;
  * ``outcome_maybe_damaged``: no outcome; unaccounted damage lies after its last good record.

Frames a power failure took whole leave no bytes: such a rollout shows in
``unfinished_rollouts()`` only. Frames with a good CRC that break the cross-record rules are not
damage: ``stats().conflicts``. Opening scans and CRC-checks the whole log (~1 GB/s) and parses
only the small JSON headers; reading a rollout reads just its frames (``os.pread``).
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

from gyre_jax.errors import storage_error
from gyre_jax.trajectory.cursor import (  # noqa: F401 - the store's public names stay importable from here
    CURSOR_COMPACT_MIN_BYTES,
    CURSOR_NAME,
    JOURNAL_NAME,
    Cursor,
    _atomic_write_json,
)
from gyre_jax.trajectory.frame_log import (  # noqa: F401 - as above
    _FRAME,
    EVENTS_NAME,
    LOG_NAME,
    MAGIC,
    MAX_PAYLOAD,
    TORN_DIR,
    FrameLog,
    _frame,
    _frame_ok,
    _read_damage,
    _scan,
)
from gyre_jax.trajectory.frame_log import append_line as _append_line
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

FSYNC_POLICIES = ("always", "interval", "never")
META_NAME, QUARANTINE_NAME = "meta.json", "quarantine.jsonl"


class StoreBusy(RuntimeError):
    """Another process has this store open for writing (or holds its cursor)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    fsync: str = "interval"  # 'always' | 'interval' | 'never' (frame_log.py)
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
        if writable:
            self._writer_lock_f = self._take_lock("writer.lock", "writer")
        self._log = FrameLog(self.directory, writable=writable, fsync=config.fsync,
                             fsync_interval_s=config.fsync_interval_s)
        self._rollouts: dict[str, _Rollout] = {}
        self._outcome_order: list[str] = []
        self._ncalls = 0
        self._duplicates = 0
        self._conflicts: list = []
        self._damage_read: dict = {}  # region -> _read_damage result
        self._closed = False
        self.refresh()
        if writable:
            self._log.recover_tail()
        self._cursor = Cursor(self.directory, self.run_id, writable=writable, outcome_offset=self._outcome_offset_of,
                              log_offset=lambda: self._log.scanned,
                              take_lock=lambda: self._take_lock("cursor.lock", "cursor"), seam=self)

    @property
    def _wfd(self) -> int:
        """The log's write descriptor (tests put /dev/full's in its place: a real ENOSPC on every append)."""
        return self._log.wfd

    @_wfd.setter
    def _wfd(self, fd: int) -> None:
        self._log.wfd = fd

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
        """Index complete frames appended since the last scan; returns how many (``FrameLog.refresh``)."""
        with self._lock:
            return self._log.refresh(self._index_frame)

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
                off = self._log.scanned
                self._check_and_index(header, off, plen, record=record)
                crc = 0
                for b in parts:
                    crc = zlib.crc32(b, crc)
                try:
                    self._log.write([_FRAME.pack(MAGIC, plen, crc), *parts], off)
                except BaseException:
                    self._unindex_last(off)  # the frame was cut back: the index forgets it too
                    raise
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
        return self._log.read_payload(off, plen)

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
        return [rid for rid in self.complete_rollouts() if rid not in self._cursor.consumed]

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
            regions = [(off, n, LOG_NAME) for off, n in self._log.corrupt]
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
                self._damage_read[reg] = _read_damage(self._log.read_bytes(off, n), torn=False)
            elif os.path.exists(source):
                with open(source, "rb") as f:
                    self._damage_read[reg] = _read_damage(f.read(), torn=True)
            else:
                self._damage_read[reg] = ([], False)  # the saved bytes are gone: could be anything
        return self._damage_read[reg]

    # ------------------------------------------------------------------ cursor (cursor.py)
    def _outcome_offset_of(self, rid: str) -> int | None:
        r = self._rollouts.get(rid)
        return None if r is None or r.outcome is None else r.outcome[0]

    def cursor_state(self) -> dict[str, Any]:
        """JSON-able cursor, to save in a training checkpoint."""
        return self._cursor.state()

    def restore_cursor(self, state: Mapping[str, Any]) -> None:
        """Make ``state`` (from ``cursor_state``) the persisted cursor, e.g. on checkpoint restore."""
        with self._lock:
            self._cursor.restore(state)

    @staticmethod
    def journal_write(fd: int, line: bytes, offset: int) -> int:
        return os.pwrite(fd, line, offset)  # one seam for every journal write, so a fault injector (testing/faulty_main) can fail it like a full disk

    def _consume(self, rollout_ids: Iterable[str], entry: dict) -> None:
        with self._lock:
            ids = list(rollout_ids)
            for rid in ids:
                r = self._rollouts.get(rid)
                if r is None or not self._is_complete(r):
                    raise ValueError(f"cannot consume rollout {rid!r}: it is not complete in {self.directory}")
                if rid in self._cursor.consumed:
                    raise ValueError(f"rollout {rid!r} was already consumed: {self._cursor.consumed[rid]}")
                if ids.count(rid) > 1:
                    raise ValueError(f"rollout {rid!r} listed twice")
            self._cursor.consume(ids, entry)

    def mark_trained(self, rollout_ids: Iterable[str], *, step: int) -> None:
        self._consume(rollout_ids, {"state": "trained", "step": int(step), "reason": None})

    def mark_dropped(self, rollout_ids: Iterable[str], *, step: int, reason: str) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError("mark_dropped needs a non-empty reason")
        self._consume(rollout_ids, {"state": "dropped", "step": int(step), "reason": reason})

    def mark_step(self, step: int, *, trained: Iterable[str], dropped: Mapping[str, str], record: Mapping[str, Any]) -> None:
        """A whole training step's rollouts in one durable line: ``trained``, and ``dropped`` (id -> reason,
        their failure class), with the step's ``record`` (JSON: what a resume needs to replay it, e.g. the
        groups it took in order). A stop never leaves half of a step consumed."""
        trained, dropped = list(trained), dict(dropped)
        if any(not isinstance(r, str) or not r for r in dropped.values()):
            raise ValueError(f"mark_step: every dropped rollout needs a non-empty reason, got {dropped}")
        self._consume(trained + list(dropped), {"step": int(step), "dropped": dropped, "record": dict(record)})

    def step_records(self) -> dict[int, dict]:
        """The record of every step consumed whole (``mark_step``) that the cursor holds, by step."""
        with self._lock:
            return {k: dict(v) for k, v in self._cursor.steps.items()}

    def consumed(self) -> dict[str, dict]:
        return {k: dict(v) for k, v in self._cursor.consumed.items()}

    # ------------------------------------------------------------------ stats / close
    def quarantined(self) -> list[dict]:
        path = self._path(QUARANTINE_NAME)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def torn_tails(self) -> list[tuple]:
        return self._log.torn_tails()

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats()

    def _stats(self) -> StoreStats:
        complete = self.complete_rollouts()
        consumed = self._cursor.consumed
        states = [e["state"] for e in consumed.values()]
        return StoreStats(
            calls=self._ncalls,
            outcomes=len(self._outcome_order),
            rollouts=len(self._rollouts),
            complete=len(complete),
            incomplete=len(self._outcome_order) - len(complete),
            pending=sum(rid not in consumed for rid in complete),
            unfinished=sum(r.outcome is None and bool(r.calls) for r in self._rollouts.values()),
            damaged_rollouts=len(self.damaged_rollouts()),
            trained=states.count("trained"),
            dropped=states.count("dropped"),
            quarantined=len(self.quarantined()),
            duplicates=self._duplicates,
            torn_tails=tuple(self.torn_tails()),
            corrupt_regions=tuple(self._log.corrupt),
            conflicts=tuple(self._conflicts),
            tail_pending_bytes=self._log.tail_pending,
            log_bytes=self._log.scanned + self._log.tail_pending,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.directory} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._log.close()
        self._cursor.close()
        if self._writer_lock_f is not None:
            self._writer_lock_f.close()

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
