"""What each attempt of a run did, on disk: its cells' roles over time and how it ended.

A run is one or more attempts (a rerun after a failure, a kill or a stop resumes the same workdir).
Each attempt keeps one file, ``<mode>/attempts/NNNNNN.json``, rewritten (atomically) after every step
and when the attempt ends::

    {"attempt": 1, "pid": 4242, "started_unix": 1765000000.0, "first_step": 3, "n_cells": 4, "setup_s": 21.5,
     "phase": "start",                                           # only when it ended before its loop began
     "sft_steps": 0, "sft_loss_last": null,                      # the warm start, when this attempt ran it
     "status": "running" | "finished" | "failed" | "stopped", "error": null | "one line",
     "updated_unix": ..., "duration_s": 812.4,                   # seconds on this attempt's clock
     "counters": {"engine_errors": 0, "retries": 3, ...},       # what adds up over attempts, as of the write
     "segments": [[cell, t0, t1, role], ...],                    # roles, seconds since the attempt began
     "step_ends": [[step, t], ...]}

Why a file per attempt: the timeline and the summary of a resumed run must cover every attempt (a
process only knows its own), a report of a run that failed must say how it failed (the ``error:`` line
went to a terminal), and a report of a running run reads the file of the attempt still writing. A
killed attempt keeps what its last step wrote, with ``status: running`` and a pid that is gone
(``AttemptLog.read_all`` says ``killed`` then).

Writes never stop the run: this is a record for people, and a full disk is reported by the store and
the checkpoint, which the run cannot do without.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Sequence

log = logging.getLogger(__name__)

DIR = "attempts"
STATUSES = ("running", "finished", "failed", "stopped", "killed")


class AttemptLog:
    """This attempt's file; ``update`` after each step, ``end`` once."""

    def __init__(self, mode_dir: str, *, first_step: int, n_cells: int, extra: dict | None = None, now=time.time):
        """``extra``: more fields of the head (the loop's: ``setup_s``, ``sft_steps``, ``sft_loss_last``)."""
        self.dir = os.path.join(mode_dir, DIR)
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError:  # update() says so; the run goes on
            log.warning("rl: could not make %s", self.dir, exc_info=True)
        self.attempt = len(attempt_files(mode_dir))
        self.path = os.path.join(self.dir, f"{self.attempt:06d}.json")
        self._now = now
        self.head = {"attempt": self.attempt, "pid": os.getpid(), "started_unix": now(), "first_step": first_step,
                     "n_cells": n_cells, **(extra or {})}
        self.step_ends: list[list] = []
        self.counters: dict = {}
        self.update((), 0.0)

    def update(self, segments: Sequence[tuple], duration_s: float, *, step: int | None = None,
               status: str = "running", error: str | None = None, counters: dict | None = None) -> None:
        """Rewrite the file: the segments so far (closed and open ones), a step that just ended at
        ``duration_s`` (seconds on the attempt's clock), the attempt's counters so far (numbers, or
        dicts of numbers, that add up over attempts: engine errors, retries, injected faults...)."""
        if step is not None:
            self.step_ends.append([int(step), float(duration_s)])
        if counters is not None:
            self.counters = dict(counters)
        doc = {**self.head, "status": status, "error": error, "updated_unix": self._now(),
               "duration_s": float(duration_s), "counters": self.counters,
               "segments": [[int(c), round(float(t0), 4), round(float(t1), 4), str(r)] for c, t0, t1, r in segments],
               "step_ends": self.step_ends}
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError:
            log.warning("rl: could not write %s (the run goes on; its timeline may miss this attempt's last steps)",
                        self.path, exc_info=True)

    def end(self, segments: Sequence[tuple], duration_s: float, failure: BaseException | None,
            counters: dict | None = None) -> None:
        if failure is None:
            status, error = "finished", None
        elif isinstance(failure, KeyboardInterrupt):
            status, error = "stopped", str(failure) or type(failure).__name__
        else:
            status, error = "failed", f"{type(failure).__name__}: {failure}"
        self.update(segments, duration_s, status=status, error=error, counters=counters)


def record_start_failure(mode_dir: str, failure: BaseException) -> None:
    """An attempt that ended before its loop started (the task check refused a task, an engine did not
    start, a stop during set-up): its record, with phase 'start', so a report of the run says why."""
    try:
        log_ = AttemptLog(mode_dir, first_step=-1, n_cells=0, extra={"phase": "start"})
    except OSError:
        log.warning("rl: could not record the failed start in %s", mode_dir, exc_info=True)
        return
    log_.end((), 0.0, failure)


def attempt_files(mode_dir: str) -> list[str]:
    d = os.path.join(mode_dir, DIR)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".json") and n[:-5].isdigit())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, not ours
        return True
    return True


def read_all(mode_dir: str) -> list[dict]:
    """Every attempt's record, oldest first; an attempt still 'running' whose process is gone is 'killed'
    (the last file it wrote was at the end of a step; what it did after is lost with it). A file that
    does not parse (a disk that failed mid-write) is skipped with a warning."""
    out = []
    for p in attempt_files(mode_dir):
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            log.warning("skipping unreadable attempt record %s", p, exc_info=True)
            continue
        if doc.get("status") == "running" and not _alive(int(doc.get("pid", 0) or 0)):
            doc["status"] = "killed"
        out.append(doc)
    return out


def whole_timeline(attempts: Sequence[dict], gap_s: float = 0.0) -> tuple[list, list, list, float]:
    """(segments, step_ends, restarts, total_s) of every attempt laid end to end on one time axis.

    Attempt k starts where attempt k-1's record ends (plus ``gap_s``): time between attempts (a dead
    process, a queue) is nobody's cell time. ``step_ends``: [(step, t)], ``restarts``: [(t, attempt,
    first_step)] for every attempt after the first."""
    segments, ends, restarts, offset = [], [], [], 0.0
    attempts = [a for a in attempts if a.get("phase") != "start"]  # ended before any cell had a role
    for i, a in enumerate(attempts):
        if i:
            offset += gap_s
            restarts.append((offset, int(a["attempt"]), int(a["first_step"])))
        segments += [(int(c), t0 + offset, t1 + offset, r) for c, t0, t1, r in a.get("segments", ())]
        ends += [(int(s), t + offset) for s, t in a.get("step_ends", ())]
        offset += float(a.get("duration_s", 0.0))
    return segments, ends, restarts, offset


def add_counters(docs: Sequence[dict]) -> dict:
    """The attempts' ``counters`` summed key by key (a dict value: summed inside)."""
    out: dict = {}
    for d in docs:
        for k, v in (d.get("counters") or {}).items():
            if isinstance(v, dict):
                inner = out.setdefault(k, {})
                for kk, vv in v.items():
                    inner[kk] = inner.get(kk, 0) + vv
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out
