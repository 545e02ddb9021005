"""Grading a workspace in a subprocess with a time limit.

The grader never reads the live workspace: ``snapshot_workspace`` copies its regular files
and directories (no symlinks, fifos or devices: nothing the agent made can point the grader
elsewhere or block it) after the rollout's last command ended. Nor does a grader see that
copy: ``grader_main`` builds the graded tree from the task's own files and lays on it only
what the policy may change (``graded_tree``, ``tree_rules``), and every grader of every family
reads that tree. It runs outside the agent's sandbox from the trainer's own code (``python
-P``: the current directory is not on its import path), with the task (expected answers
included) on stdin, so nothing the agent could write is code or data the grader trusts.
Graders that run agent code do it in a sandbox of their own (``grader_sandbox``, told which
kind by ``GYRE_GRADER_SANDBOX``), whose failures on the policy's tree are scores of 0.

``run_grader`` starts ``python -P -m gyre_jax.agents.grader_main --workspace DIR`` with the
task's JSON on stdin; the grader prints one line ``GYRE-GRADE {"score", "details"}``.
Anything else (a crash of gyre's grader process, a non-zero exit, no or malformed result
line, a score outside [0, 1], running past the time limit) is a verifier failure:
``ok=False`` with the reason, and the rollout's status becomes ``verifier_error``, never a
score of 0 (graded code cannot cause one: what it does ends in the sandboxed command).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gyre_jax.agents.scoring import RESULT_PREFIX
from gyre_jax.agents.sparse_copy import copy_extents
from gyre_jax.agents.tasks.base import Task

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


SNAPSHOT_MAX_DEPTH = 64  # directory levels copied (deeper ones are skipped)
# bytes of a path relative to the workspace: longer ones are skipped, so any copy of the
# snapshot (a grader's, the workspace shown after a tmpfs) stays under PATH_MAX (4096)
SNAPSHOT_MAX_PATH = 1024
SKIP_REASONS = ("too_deep", "path_too_long", "not_regular", "over_bytes", "over_entries", "unreadable")


def snapshot_workspace(src: str | os.PathLike, dst: str | os.PathLike, *, max_bytes: int,
                       max_entries: int = 65536, exist_ok: bool = False) -> dict:
    """Copy ``src``'s directories and regular files (at most ``max_bytes`` of data and
    ``max_entries`` in all, ``SNAPSHOT_MAX_DEPTH`` levels, ``SNAPSHOT_MAX_PATH`` bytes of
    path) to ``dst``, owned by us and not writable by others; returns what was copied and,
    by reason, what was skipped. Iterative: no tree the agent builds can exhaust it.

    Whatever cannot be copied (too deep, unreadable, a symlink loop, a fifo) is skipped and
    counted, never an error: a crafted workspace gets the score of what it holds. Sparse
    files are copied sparse and counted by their data (a 1 TiB file of holes costs the
    host nothing), so ``bytes`` is what the copy allocates, not apparent sizes. ``exist_ok``:
    ``dst`` may exist already (empty: an unmounted workspace gets what was graded)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=exist_ok)
    os.chmod(dst, 0o755)
    stats: dict[str, Any] = {"files": 0, "bytes": 0, "apparent_bytes": 0, "skipped": 0, "truncated": False,
             "skipped_by_reason": dict.fromkeys(SKIP_REASONS, 0)}

    def skip(reason: str) -> None:
        stats["skipped"] += 1
        stats["skipped_by_reason"][reason] += 1
        if reason in ("too_deep", "over_bytes", "over_entries", "path_too_long"):
            stats["truncated"] = True

    stack, entries = [(src, dst, 0, 0)], 0
    while stack:
        s, d, depth, rel_len = stack.pop()
        try:
            listing = sorted(os.scandir(s), key=lambda e: e.name)
        except OSError:
            skip("unreadable")
            continue
        for e in listing:
            entries += 1
            if entries > max_entries:
                skip("over_entries")
                continue
            rel = rel_len + 1 + len(os.fsencode(e.name))
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth + 1 > SNAPSHOT_MAX_DEPTH:
                        skip("too_deep")
                    elif rel > SNAPSHOT_MAX_PATH:
                        skip("path_too_long")
                    else:
                        (d / e.name).mkdir(mode=0o755)
                        stack.append((Path(e.path), d / e.name, depth + 1, rel))
                elif not e.is_file(follow_symlinks=False):  # symlinks, fifos, sockets, devices
                    skip("not_regular")
                elif rel > SNAPSHOT_MAX_PATH:
                    skip("path_too_long")
                else:
                    skip_reason = _copy_file(e, d / e.name, max_bytes - stats["bytes"], stats)
                    if skip_reason:
                        skip(skip_reason)
            except OSError:  # vanished, unreadable, a name the destination refuses
                skip("unreadable")
    return stats


def _copy_file(entry: os.DirEntry, dst: Path, budget: int, stats: dict) -> str | None:
    """Copy one regular file sparse (its data extents only) within ``budget`` bytes of data;
    returns why it was skipped, or None."""
    st = entry.stat(follow_symlinks=False)
    if min(st.st_size, st.st_blocks * 512) > budget:  # allocated bytes: holes are free
        return "over_bytes"
    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            copied = copy_extents(fd, out, st.st_size, budget)
            os.ftruncate(out, st.st_size)  # trailing holes; never more than was counted
        finally:
            os.close(out)
    finally:
        os.close(fd)
    if copied is None:  # more data than the file's blocks said (it grew, or no SEEK_DATA): not half of it
        os.unlink(dst)
        return "over_bytes"
    stats["files"] += 1
    stats["bytes"] += copied
    stats["apparent_bytes"] += st.st_size
    return None


def grader_sandbox_env(kind: str, limits, image: str | None = None, ro_paths=()) -> dict[str, str]:
    """The GYRE_GRADER_SANDBOX variable: how graders confine the agent code they run
    (``ro_paths``: host paths every graded command sees read-only, config.task.grader_ro_paths)."""
    from gyre_jax.agents import sandbox
    return {sandbox.GRADER_SANDBOX_ENV: json.dumps({"kind": kind, "limits": dataclasses.asdict(limits), "image": image,
                                                    "seccomp": sandbox.seccomp_refused() is None,
                                                    "ro_paths": list(ro_paths)})}


def subprocess_env() -> dict[str, str]:
    """The environment for grader / check subprocesses: gyre_jax importable even when not
    pip-installed, and no .pyc files written into graded workspaces."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@dataclasses.dataclass(frozen=True)
class GraderOutcome:
    ok: bool  # False: the verifier failed; score is None and error says why
    score: float | None
    details: dict[str, Any]
    error: str | None
    wall_time_s: float


def parse_grader_output(stdout: str, returncode: int, stderr: str) -> tuple[float | None, dict, str | None]:
    """(score, details, error) from a grader process's output; error None when valid."""
    tail = stderr.strip()[-800:]
    if returncode != 0:
        return None, {}, f"grader exited with code {returncode}: {tail}"
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if len(lines) != 1:
        return None, {}, f"grader printed {len(lines)} result lines (want 1); stderr: {tail}"
    try:
        data = json.loads(lines[0][len(RESULT_PREFIX):])
        score, details = data["score"], data["details"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return None, {}, f"grader result line is malformed ({type(e).__name__}: {e})"
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score) \
            or not 0.0 <= score <= 1.0:
        return None, {}, f"grader score {score!r} is not a number in [0, 1]"
    if not isinstance(details, dict):
        return None, {}, f"grader details must be an object, got {type(details).__name__}"
    return float(score), details, None


# Of a grading subprocess's time limit, kept back from its own budget (``grader_main --budget_s``): its
# interpreter's start and its result line, on a loaded host.
GRADER_MARGIN_S = 15.0
GRADER_STDOUT_TAIL = 1 << 20  # of the grader's stdout kept: its result line is last and bounded (grader_main)
GRADER_STDERR_BYTES = 8192  # head + tail of the grader's stderr kept, for the error


async def run_grader(task: Task, workspace: str | os.PathLike, *, timeout_s: float,
                     env: dict[str, str] | None = None, bases: str | os.PathLike | None = None,
                     carry_deletions: bool = True) -> GraderOutcome:
    """Grade ``workspace`` (a snapshot, see above); ``env``: extra variables (the grader sandbox);
    ``bases``: where the tasks' own trees are cached; ``carry_deletions=False``: the snapshot was
    truncated (a file missing from it is not one the policy deleted).

    The grader's output streams into bounded captures (a grader echoing what agent code
    printed cannot fill the trainer's memory) and its details are cut to the record bounds."""
    from gyre_jax.agents.capture import BoundedCapture, bound_json, bound_text, drain_async

    t0 = time.monotonic()
    extra = [*(["--bases", str(bases)] if bases is not None else []), *([] if carry_deletions else ["--keep_deleted"]),
             "--budget_s", f"{max(timeout_s / 2, timeout_s - GRADER_MARGIN_S):.3f}"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "gyre_jax.agents.grader_main", "--workspace", str(Path(workspace).resolve()), *extra,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**subprocess_env(), **(env or {})}, cwd="/", start_new_session=True)  # own group: a kill takes its check runners too
    out, err = BoundedCapture(head=4096, tail=GRADER_STDOUT_TAIL), BoundedCapture(
        head=GRADER_STDERR_BYTES // 2, tail=GRADER_STDERR_BYTES // 2)

    async def feed_stdin():
        try:
            proc.stdin.write(task.to_json().encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it exited without reading: its exit code says why
            pass

    io = asyncio.ensure_future(asyncio.gather(feed_stdin(), drain_async(proc.stdout, out),
                                              drain_async(proc.stderr, err)))
    # Retrieved whatever ends it: a run closing mid-grading cancels the readers themselves, and the
    # gather's CancelledError then printed "exception was never retrieved" at exit.
    io.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        await asyncio.wait_for(asyncio.shield(io), timeout_s)
        await asyncio.wait_for(proc.wait(), max(1.0, timeout_s - (time.monotonic() - t0)))
    except TimeoutError:
        _kill_group(proc)
        io.cancel()
        await proc.wait()
        return GraderOutcome(False, None, {}, f"grader timed out after {timeout_s:g} s", time.monotonic() - t0)
    except BaseException:  # cancelled (e.g. the harness shuts down): leave no grader behind
        _kill_group(proc)
        io.cancel()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except BaseException:
            pass
        raise
    returncode = proc.returncode if proc.returncode is not None else -1  # waited for above: always set
    score, details, error = parse_grader_output(out.tail_text(), returncode, err.text())
    return GraderOutcome(error is None, score, bound_json(details), None if error is None else bound_text(error),
                         time.monotonic() - t0)


def _kill_group(proc) -> None:
    if proc.returncode is not None:  # reaped: its pid (= group id) may already be reused
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def grade_in_process(task: Task, workspace: str | os.PathLike):
    """Grade ``workspace`` in this process (tests and demos): the graded tree is built as the
    grader subprocess builds it; returns the task grader's scoring.Grade."""
    from gyre_jax.agents.grader_main import grade_snapshot
    return grade_snapshot(task, Path(workspace))
