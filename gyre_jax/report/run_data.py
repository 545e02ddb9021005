"""The run-level half of the report: what a run wrote besides its trajectories, read back as tables.

From a mode directory (``<workdir>/<mode>``): ``metrics.jsonl`` (a line per step), ``eval/eval.jsonl``
(a line per evaluated policy version) and ``eval/vNNNNNN/episodes.jsonl`` (a line per held-out
episode), ``attempts/*.json`` (each attempt's cell roles and how it ended, ``rl.attempts``),
``summary.json`` (once an attempt finished). Each reader tolerates what a running or killed run
leaves: a missing file is empty, a torn last line is skipped, a malformed line is counted (never a
crash: a report must open on a broken run, which is when it is needed most).
"""
from __future__ import annotations

import collections
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

from gyre_jax.rl import attempts as attempts_lib

TOP_REASONS = 3  # failure reasons listed per step


def read_jsonl(path: str) -> tuple[list[dict], int]:
    """(the JSON objects of a JSONL file, lines that were not one); a missing file is ([], 0)."""
    if not os.path.exists(path):
        return [], 0
    out, bad = [], 0
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(r, dict):
                out.append(r)
            else:
                bad += 1
    return out, bad


def _finite(v):
    """A JSON number for the page: NaN/inf (old files wrote bare NaN) -> None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def columns(records: Sequence[Mapping], key: str = "step") -> dict[str, list]:
    """Step records as columns (``{"step": [...], "reward": [...], ...}``) of their numeric fields, sorted by
    ``key``; a field missing from a record is None there."""
    records = sorted((r for r in records if isinstance(r.get(key), int)), key=lambda r: r[key])
    names: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) or v is None:
                names.setdefault(k, None)
    return {k: [_finite(r.get(k)) for r in records] for k in names}


def metrics(mode_dir: str) -> dict:
    recs, bad = read_jsonl(os.path.join(mode_dir, "metrics.jsonl"))
    return {"columns": columns(recs), "malformed_lines": bad}


def evals(mode_dir: str) -> dict:
    """Held-out eval per version (eval.jsonl), and per task per version from the episodes
    (``tasks[task][version] = [scored episodes, passed (score >= 1), mean score, failed episodes]``)."""
    root = os.path.join(mode_dir, "eval")
    recs, bad = read_jsonl(os.path.join(root, "eval.jsonl"))
    per_task: dict[str, dict[int, list]] = collections.defaultdict(dict)
    versions = []
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            if not (name.startswith("v") and name[1:].isdigit()):
                continue
            eps, _ = read_jsonl(os.path.join(root, name, "episodes.jsonl"))
            if not eps:
                continue
            v = int(name[1:])
            versions.append(v)
            by: dict[str, list] = collections.defaultdict(list)
            for e in eps:
                by[str(e.get("task_id"))].append(e)
            for task, es in by.items():
                scores = [float(e["score"]) for e in es if isinstance(e.get("score"), (int, float))]
                per_task[task][v] = [len(scores), sum(s >= 1.0 for s in scores),
                                     sum(scores) / len(scores) if scores else None, len(es) - len(scores)]
    return {"columns": columns(recs), "malformed_lines": bad, "versions": versions,
            "tasks": {t: {str(v): x for v, x in d.items()} for t, d in sorted(per_task.items())}}


def attempts(mode_dir: str) -> dict:
    """Each attempt's head and status, and the run's role timeline laid end to end (``rl.attempts``)."""
    docs = attempts_lib.read_all(mode_dir)
    segments, ends, restarts, total = attempts_lib.whole_timeline(docs)
    heads = [{k: d.get(k) for k in ("attempt", "status", "error", "first_step", "started_unix", "updated_unix",
                                    "duration_s", "setup_s", "n_cells", "pid", "phase")} for d in docs]
    n_cells = max((int(d.get("n_cells") or 0) for d in docs), default=0)
    return {"attempts": heads, "n_cells": n_cells, "total_s": total,
            "segments": [[c, round(t0, 3), round(t1, 3), r] for c, t0, t1, r in segments],
            "step_ends": [[s, round(t, 3)] for s, t in ends],
            "restarts": [[round(t, 3), a, s] for t, a, s in restarts]}


def summary(mode_dir: str) -> dict | None:
    path = os.path.join(mode_dir, "summary.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_state(att: Mapping, has_summary: bool) -> dict:
    """How the run stands: running, finished, failed, stopped or killed (the newest attempt says), with
    its error line."""
    last = att["attempts"][-1] if att["attempts"] else None
    if last is None:
        status = "finished" if has_summary else "unknown"
        return {"status": status, "error": None, "attempts": 0}
    return {"status": last["status"], "error": last.get("error"), "attempts": len(att["attempts"]),
            "first_step": last.get("first_step"), "updated_unix": last.get("updated_unix")}


def status_table(rows: Iterable[Mapping]) -> dict:
    """Per step (the step that trained or dropped each rollout; "pending" and "running" for the others):
    counts by status, and the top failure reasons with their count and an example rollout."""
    per: dict[str, dict] = {}
    for r in rows:
        key = str(r["step"]) if r.get("step") is not None else r.get("state") or "pending"
        d = per.setdefault(key, {"statuses": collections.Counter(), "reasons": collections.Counter(), "example": {}})
        d["statuses"][r.get("status") or "running"] += 1
        if r.get("reason"):
            d["reasons"][r["reason"]] += 1
            d["example"].setdefault(r["reason"], r["id"])
    out = {}
    for key, d in per.items():
        out[key] = {"statuses": dict(d["statuses"]),
                    "reasons": [[reason, n, d["example"][reason]] for reason, n in d["reasons"].most_common(TOP_REASONS)]}
    return out


def task_table(rows: Iterable[Mapping]) -> dict:
    """Training rollouts per task per sampling version (the oldest version of its calls):
    ``{task: {version: [scored, passed (score >= 1), mean score, failed]}}``; a task drawn at several
    versions shows whether it got better."""
    acc: dict[str, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0, 0]))
    for r in rows:
        v = r.get("version_min")
        if v is None or r.get("status") in (None, "running"):
            continue
        cell = acc[str(r.get("task"))][int(v)]
        if isinstance(r.get("score"), (int, float)):
            cell[0] += 1
            cell[1] += r["score"] >= 1.0
            cell[2] += float(r["score"])
        else:
            cell[3] += 1
    return {t: {str(v): [c[0], c[1], c[2] / c[0] if c[0] else None, c[3]] for v, c in sorted(d.items())}
            for t, d in sorted(acc.items())}


def read_log_under(mode_dir: str, max_bytes: int) -> Any:
    """A reader of harness logs for ``rollouts._log``: a log under the run's workdir (any path the
    outcome names, if it is under ``mode_dir``), its start and end up to ``max_bytes``; None if unreadable."""
    root = os.path.realpath(mode_dir)

    def read(path: str) -> str | None:
        real = os.path.realpath(path)
        if not real.startswith(root + os.sep) or not os.path.isfile(real):
            return None
        try:
            size = os.path.getsize(real)
            with open(real, "rb") as f:
                if size <= max_bytes:
                    return f.read().decode("utf-8", "replace")
                head = f.read(max_bytes // 2).decode("utf-8", "replace")
                f.seek(size - max_bytes // 2)
                tail = f.read().decode("utf-8", "replace")
            return f"{head}\n[... {size - max_bytes} bytes not shown ...]\n{tail}"
        except OSError:
            return None

    return read
