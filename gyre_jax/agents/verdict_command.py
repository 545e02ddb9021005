"""A command grader's verdict: its exit status, or what it writes to ``$GYRE_VERDICT``.

The command (``bash -c COMMAND``) runs in the grader sandbox (``grader_sandbox``) on the graded
tree. Its verdict:

  * a non-zero exit, a death by signal or running past ``timeout_s`` scores 0, whatever it
    printed or wrote (graded code that crashes or hangs its checker fails it);
  * exit 0, verdict mode ``file``: the JSON object the command wrote to ``$GYRE_VERDICT``:
    ``{"score": x}`` (0 <= x <= 1) is the score; nothing, garbage or ``{"error": "..."}``
    scores 0 (the error is kept as a grader fault: ``--check_tasks`` names it);
  * exit 0, verdict mode ``exit_code``: 1.0.

``$GYRE_VERDICT`` is ``/dev/fd/N``, a descriptor of a file outside every sandbox that only the
command's process tree holds: no path in the graded tree or anywhere else in the sandbox
leads to it, so nothing written into the tree, printed, or left by a background process
before the command started can be the verdict. Stdout is a log, never a score: a
``{"score": ...}`` line on it is flagged as a grader fault (graded code can print the same line).

What this cannot stop: code that runs INSIDE the checker's process (a checker that imports the
agent's module) or inherits the descriptor (a child started without closing it: bash passes
descriptors on) can write the verdict, exit 0 or print anything. The sound pattern is a checker
that runs agent code in a subprocess it never imports, with descriptors closed (Python's
``subprocess`` closes them by default), or the ``calls`` and per-test modes (README).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from gyre_jax.agents import grader_sandbox
from gyre_jax.agents.scoring import Grade

VERDICT_ENV = "GYRE_VERDICT"
VERDICT_MODES = ("exit_code", "file")
MAX_VERDICT_BYTES = 65536
OUTPUT_TAIL_BYTES = 4096
_SCORE_LINE = re.compile(r'^\s*\{\s*"(score|error)"\s*:')
# Output that says the grader itself cannot run, whatever tree it grades (--check_tasks names it).
_MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")
_RUNNER_BROKEN = re.compile(r"INTERNALERROR|ERROR: usage|ERROR: file or directory not found|no tests ran in")
_SYNTAX = re.compile(r'File "([^"]+)", line \d+.*\n(?:.*\n){0,6}?.*\b(SyntaxError|IndentationError)\b')


def grade(command: str, tree: Path, *, timeout_s: float, mode: str, read_only: Sequence[str],
          extra_ro_paths: Sequence[str] = ()) -> Grade:
    """Run ``command`` on ``tree`` and score it (module docstring)."""
    from gyre_jax.agents.capture import BoundedCapture, drain_thread

    with tempfile.TemporaryDirectory(prefix="gyre-verdict-") as tmp, open_verdict(tmp) as fd:
        capture = BoundedCapture(head=OUTPUT_TAIL_BYTES, tail=65536)
        env = {VERDICT_ENV: f"/dev/fd/{fd}"}
        with grader_sandbox.launch(tree, ["bash", "-c", command], writable=True, read_only=read_only,
                                   extra_ro_paths=extra_ro_paths, env=env) as launch:
            proc = subprocess.Popen(launch.argv, cwd=tree, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=launch.env,
                                    pass_fds=(fd,))
            reader = drain_thread(proc.stdout, capture)
            returncode = _wait(proc, timeout_s)
            reader.join(5.0)
        verdict = os.pread(fd, MAX_VERDICT_BYTES, 0)
    return decide(returncode, verdict, capture.tail_text(), mode=mode, output_bytes=capture.total, hidden=read_only)


@contextlib.contextmanager
def open_verdict(directory: str) -> Iterator[int]:
    """A descriptor (>= 10, above the sandbox wrappers' own) of a fresh file in ``directory`` (a
    private temporary directory): the sandboxed command reopens it as /dev/fd/N, as its own uid."""
    os.chmod(directory, 0o700)
    fd0 = os.open(os.path.join(directory, "verdict"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd0, 0o666)  # no path reaches it: only the descriptor
    fd = fcntl.fcntl(fd0, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd0)
    try:
        yield fd
    finally:
        os.close(fd)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return None


def decide(returncode: int | None, verdict: bytes, output: str, *, mode: str, output_bytes: int = 0,
           hidden: Sequence[str] = ()) -> Grade:
    """The score of one run (module docstring); ``details['grader_fault']``: why the grader
    itself looks broken (None: nothing says so)."""
    tail = output[-OUTPUT_TAIL_BYTES:]
    details: dict[str, Any] = {"exit_code": returncode, "verdict_mode": mode, "output_tail": tail,
                               "output_bytes": output_bytes, "grader_fault": None}
    if any(_SCORE_LINE.match(ln) for ln in output.splitlines()):
        details["grader_fault"] = ("the grader prints a score or error line on stdout; graded code can print "
                                   f"the same: write it to ${VERDICT_ENV} instead (grader.verdict='file')")
    if returncode is None:
        return Grade(0.0, {**details, "reason": "timeout", "timed_out": True})
    if returncode != 0:
        details["grader_fault"] = details["grader_fault"] or _fault(returncode, output, hidden)
        return Grade(0.0, {**details, "reason": f"exit {returncode}"})
    if mode == "exit_code":
        if verdict.strip():
            details["grader_fault"] = (f"the command wrote ${VERDICT_ENV} but the task's grader.verdict is "
                                       "'exit_code': set it to 'file'")
        return Grade(1.0, {**details, "reason": "exit 0", "exact": True})
    score, why = parse_verdict(verdict)
    if score is None:
        details["grader_fault"] = details["grader_fault"] or why
        return Grade(0.0, {**details, "reason": why})
    return Grade(score, {**details, "reason": "verdict", "exact": score == 1.0})


def parse_verdict(raw: bytes) -> tuple[float | None, str]:
    """(score, '') from a verdict file's bytes, or (None, why not)."""
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return None, f"the command exited 0 without writing ${VERDICT_ENV}"
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None, f"${VERDICT_ENV} is not JSON: {text[:200]!r}"
    if isinstance(obj, dict) and "error" in obj:
        return None, f"the grader reported an error: {str(obj['error'])[:500]}"
    s = obj.get("score") if isinstance(obj, dict) else None
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= 1:
        return None, f'${VERDICT_ENV} must hold {{"score": x}} with 0 <= x <= 1, got {text[:200]!r}'
    return float(s), ""


def _fault(returncode: int, output: str, hidden: Sequence[str] = ()) -> str | None:
    """Why a non-zero exit says the grader itself cannot run, not that the graded code failed
    (only signals no tree could cause: graded code's own crashes on an untouched tree are
    ordinary zeros; ``--check_tasks`` tells the rest apart with the task's solution)."""
    from gyre_jax.agents.tree_rules import shadowed_names

    if returncode in (126, 127):
        return f"the grader command could not run (exit {returncode}): {output.strip()[-300:]!r}"
    for m in _MISSING_MODULE.finditer(output):
        if m.group(1).split(".")[0] in shadowed_names():
            return (f"the grader's Python cannot import {m.group(1)!r} (exit {returncode}): give graders an "
                    "interpreter that has it (grader.ro_paths / config.task.grader_ro_paths)")
    for m in _SYNTAX.finditer(output):
        where = m.group(1).removeprefix("/workspace/")
        if where in hidden:
            return f"{m.group(2)} in the grader's own file {where} (exit {returncode})"
    broken = _RUNNER_BROKEN.search(output)
    if broken:
        return f"the test runner could not run the tests ({broken.group(0)!r}, exit {returncode})"
    return None
