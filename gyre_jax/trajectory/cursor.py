"""The trajectory store's training cursor: which rollouts the trainer consumed, durably.

An entry per consumed rollout: trained or dropped (with a reason), the step, and the byte
offset of its outcome frame (a cursor restored against the wrong log fails loudly). On disk as
a snapshot plus a journal, so a step costs one short line, not a rewrite of every step before it
(docs/design.md, "The resume protocol", has the order of writes and what each prefix means):

  * ``cursor.jsonl``, the journal: one line per consumption, ``{"epoch": E, "step", "state",
    "reason", "rollouts": {id: outcome offset}}``, or for a whole training step ``{"epoch": E,
    "step", "rollouts", "dropped": {id: reason}, "record": {...}}`` (its rollouts trained unless
    dropped, and the step's record: the groups it took in order, its size; what a resume replays),
    written at the journal's good end and fsynced before the call returns. A failed write is cut back (memory stays what the disk says). A last
    line without its newline, or that does not parse, is a torn tail: ignored when read, cut off
    at the next write. Such a line with a good line after it is damage: opening fails, naming it.
  * ``cursor.json``, the snapshot (write temp, fsync, rename, fsync dir): the whole cursor and the
    journal epoch E it continues with, and the step records. Written by ``restore`` and by compaction (when the journal
    outgrows it, at least ``CURSOR_COMPACT_MIN_BYTES``: bytes written stay linear in the steps).
    The epoch E+1 snapshot is written first, then the journal emptied; a crash between leaves
    epoch-E lines, which are skipped.

A snapshot from before the journal (no epoch) reads as epoch 0 with an empty journal. Readers
(another process's read-only store) may race a compaction: the loader reads again.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Mapping

from gyre_jax.errors import StorageError, storage_error

log = logging.getLogger(__name__)

CURSOR_NAME, JOURNAL_NAME = "cursor.json", "cursor.jsonl"
CURSOR_COMPACT_MIN_BYTES = 64 << 10  # journal bytes below which compaction is not worth a snapshot


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


def _entry(line: Mapping[str, Any], rid: str) -> dict:
    """A consumed rollout's entry from its journal line (either form, module docstring)."""
    if "record" in line:  # a whole step: trained unless dropped
        reason = line.get("dropped", {}).get(rid)
        return {"state": "trained" if reason is None else "dropped", "step": line["step"], "reason": reason}
    return {"state": line["state"], "step": line["step"], "reason": line["reason"]}


class Cursor:
    """The consumed rollouts of one store (module docstring). The store validates what is consumed and calls
    in under its own lock; ``outcome_offset(rid)`` is where the store's index has the rollout's outcome (None:
    no outcome), ``log_offset()`` how far the log is indexed, ``take_lock()`` the cursor's file lock (a
    second writer process fails there), and ``seam.journal_write(fd, line, offset)`` every journal write (one
    place a fault injector can fail it like a full disk: ``TrajectoryStore.journal_write``)."""

    def __init__(self, directory: str, run_id: str, *, writable: bool, outcome_offset: Callable[[str], int | None],
                 log_offset: Callable[[], int], take_lock: Callable[[], Any], seam):
        self.directory, self.run_id, self.writable = directory, run_id, writable  # writable: the writer's store
        self._outcome_offset_of, self._log_offset, self._take_lock, self._seam = (outcome_offset, log_offset,
                                                                                  take_lock, seam)
        self._lock_f = None
        self.consumed: dict[str, dict] = {}
        self.steps: dict[int, dict] = {}  # step -> its record (``consume_step``), of the steps consumed whole
        self._epoch = 0  # journal lines of this epoch continue the snapshot
        self._journal_good = 0  # journal bytes up to the end of its last good line
        self.load()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def load(self) -> None:
        """Snapshot + journal as on disk. A reader may race a compaction: it retries."""
        for _ in range(20):
            before = self._snapshot_id()
            snap_epoch, consumed, steps, good, epoch_seen = self._read_files()
            if epoch_seen is None and self._snapshot_id() == before:
                break
            # A compaction ran between reading the snapshot and the journal (the snapshot was replaced, or the
            # journal holds a newer epoch): what was read may miss the emptied journal's lines. Read both again.
            time.sleep(0.01)
        else:
            raise ValueError(f"cursor of {self.directory}: no consistent read in 20 tries (snapshot epoch {snap_epoch}, "
                             f"a journal line of epoch {epoch_seen}; a journal newer than its snapshot is damage)")
        self.consumed, self.steps, self._epoch, self._journal_good = consumed, steps, snap_epoch, good

    def _read_files(self) -> tuple[int, dict, dict, int, int | None]:
        """(snapshot epoch, consumed, step records, journal bytes up to the last good line, a newer epoch seen
        or None)."""
        path = self._path(CURSOR_NAME)
        state: dict[str, Any] = {"run_id": self.run_id, "consumed": {}}
        epoch = 0
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            epoch = int(state.get("journal_epoch", 0))  # a cursor.json from before the journal: epoch 0
        consumed = self.check(state)
        steps = {int(k): v for k, v in state.get("steps", {}).items()}
        jpath = self._path(JOURNAL_NAME)
        try:
            with open(jpath, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return epoch, consumed, steps, 0, None
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
                return epoch, consumed, steps, good, e_epoch
            for rid, off in rows.items():
                if rid in consumed:
                    raise ValueError(f"cursor journal {jpath} line {lineno}: rollout {rid!r} consumed twice")
                self._check_entry(rid, off)
                consumed[rid] = dict(_entry(e, rid), outcome_offset=off)
            if "record" in e:
                steps[int(e["step"])] = e["record"]
        return epoch, consumed, steps, good, None

    def _check_entry(self, rid: str, off: int) -> None:
        have = self._outcome_offset_of(rid)
        if have != off:
            raise ValueError(f"cursor entry {rid!r} (outcome at offset {off}) does not match this log (outcome at {have})")

    def check(self, state: Mapping[str, Any]) -> dict[str, dict]:
        """The consumed entries of ``state`` (``state()``'s form), each checked against the log."""
        if state.get("run_id") != self.run_id:
            raise ValueError(f"cursor is for run {state.get('run_id')!r}, store holds {self.run_id!r}")
        consumed = {}
        for rid, e in state["consumed"].items():
            self._check_entry(rid, e["outcome_offset"])
            consumed[rid] = dict(e)
        return consumed

    def state(self) -> dict[str, Any]:
        """JSON-able cursor, to save in a training checkpoint."""
        return {"version": 1, "run_id": self.run_id, "log_offset": self._log_offset(),
                "consumed": {k: dict(v) for k, v in self.consumed.items()},
                "steps": {str(k): v for k, v in self.steps.items()}}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Make ``state`` (from ``state()``) the persisted cursor, e.g. on checkpoint restore. A checkpoint from
        before step records restores none (its steps cannot be replayed)."""
        consumed = self.check(state)
        self.own()
        self._write_snapshot(consumed, {int(k): v for k, v in state.get("steps", {}).items()})

    def own(self) -> None:
        """Take the cursor lock (once); what another holder wrote before is read again first."""
        if self._lock_f is None:
            self._lock_f = self._take_lock()
            self.load()

    def _write_snapshot(self, consumed: dict[str, dict], steps: dict[int, dict]) -> None:
        """``consumed`` and ``steps`` as the snapshot of the next epoch, then an empty journal (module docstring)."""
        path, epoch = self._path(CURSOR_NAME), self._epoch + 1
        state = dict(self.state(), consumed=consumed, steps={str(k): v for k, v in steps.items()}, version=2,
                     journal_epoch=epoch)
        try:
            _atomic_write_json(path, state)
        except OSError as e:
            raise storage_error(path, "writing", e) from e
        # durable from here: the journal's lines are stale
        self.consumed, self.steps, self._epoch = consumed, steps, epoch
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

    def _append(self, ids: list[str], entry: dict) -> None:
        """One journal line for ``ids``, durable on return; nothing of it on disk if this raises."""
        jpath = self._path(JOURNAL_NAME)
        line = json.dumps({"epoch": self._epoch, **entry, "rollouts": {rid: self._outcome_offset(rid) for rid in ids}},
                          separators=(",", ":")).encode() + b"\n"
        start = self._journal_good
        try:
            fd = os.open(jpath, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error(jpath, "writing", e) from e
        try:
            if os.fstat(fd).st_size != start:
                os.ftruncate(fd, start)  # a torn tail, or a failed write that could not be cut back then
            if self._seam.journal_write(fd, line, start) != len(line):
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
        off = self._outcome_offset_of(rid)
        if off is None:
            raise RuntimeError(f"store: rollout {rid!r} has no outcome record to consume")
        return off

    def _snapshot_bytes(self) -> int:
        try:
            return os.path.getsize(self._path(CURSOR_NAME))
        except FileNotFoundError:
            return 0

    def consume(self, ids: list[str], entry: dict) -> None:
        """Mark ``ids`` (complete rollouts, checked by the store) consumed as ``entry`` says, durably. ``entry``:
        ``{"state", "step", "reason"}``, or a whole step's ``{"step", "dropped": {id: reason}, "record"}``
        (one line: a stop never leaves half a step consumed)."""
        self.own()
        for rid in ids:
            if rid in self.consumed:  # consumed by the cursor's previous holder, read when taking the lock
                raise ValueError(f"rollout {rid!r} was already consumed: {self.consumed[rid]}")
        self._append(ids, entry)  # memory changes only once the disk has it: no half-step in a save
        for rid in ids:
            self.consumed[rid] = dict(_entry(entry, rid), outcome_offset=self._outcome_offset(rid))
        if "record" in entry:
            self.steps[int(entry["step"])] = entry["record"]
        if self._journal_good > max(CURSOR_COMPACT_MIN_BYTES, self._snapshot_bytes()):
            try:
                self._write_snapshot(dict(self.consumed), dict(self.steps))
            except StorageError as e:  # the step is durable in the journal; compaction can wait for room
                log.warning("cursor compaction failed, the journal keeps growing: %s", e)

    def close(self) -> None:
        if self._lock_f is not None:
            self._lock_f.close()
