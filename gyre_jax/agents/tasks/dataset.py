"""Tasks from a file: JSONL, one task a line, graded by a command (family ``dataset``).

A line::

    {"id": "fizzbuzz-3",                          # unique in the file: [A-Za-z0-9_.-]
     "instruction": "Implement fizzbuzz(n) ...",  # the text shown to the agent
     "files": {"fizz.py": "def fizzbuzz(n):\\n    pass\\n"},   # laid into the workspace
     "repo": "repos/fizz" | {"path": "repos/fizz", "commit": "3f2c1ab"},  # optional, copied in first
     "grader": "python3 -m unittest -q test_fizz" |
               {"command": "...", "files": {"test_fizz.py": "..."}, "timeout_s": 60},
     "timeout_s": 300,                            # optional: the rollout's deadline
     "split": "train" | "eval",                   # optional, default train
     "metadata": {...}}                           # optional, any JSON object

``files`` and ``repo`` are optional (an empty workspace is allowed); relative ``repo`` paths
are relative to the file. ``repo`` with a ``commit`` is cloned and checked out at it (a
local git repository: nothing is fetched from a network).

Grading runs the command in a COPY of the finished workspace's snapshot, with the grader's
own ``files`` laid in only then (hidden tests: the agent never sees them and cannot edit
them), confined like the agent's commands (``sandbox.untrusted_command``: the copy
writable at /workspace, no network, rlimits). The score:

  * the last non-empty stdout line, if it is a JSON object ``{"score": x}`` with 0 <= x <= 1
    (partial credit); ``{"error": "..."}`` there declares a verifier failure;
  * else the exit code: 0 scores 1, any other 0, except 126/127 (the command could not run:
    the grader is broken, not the agent's work), which is a verifier failure;
  * running past ``timeout_s`` scores 0 (agent code that hangs its tests fails them: a
    verifier failure here would let a policy escape its reward by hanging).

A malformed line stops the run before it starts, naming the file, the line and the field
(:class:`TaskFileError`); an id used twice names both lines.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tasks import FAMILIES
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.formats import TASK_FORMATS
from gyre_jax.agents.tools import FINISH, TOOL_NAMES, RUN_TESTS
from gyre_jax.serving.identity import check_id

FAMILY = "dataset"
GRADER = "gyre_jax.agents.tasks.dataset:grade"
SPLITS = ("train", "eval")
FIELDS = ("id", "instruction", "files", "repo", "grader", "timeout_s", "split", "metadata")
GRADER_FIELDS = ("command", "files", "timeout_s")
DEFAULT_GRADER_TIMEOUT_S = 60.0
# The built-in harness's tools for file tasks: every workspace tool (no task suite: run_tests is a family's).
TOOLS = tuple(n for n in TOOL_NAMES if n != RUN_TESTS)
SYSTEM_PROMPT = ("You are a coding agent working in a workspace directory. Act only through tools. "
                 f"Call {FINISH} when the task is done.")
MAX_LINE_BYTES = 64 << 20
OUTPUT_TAIL_BYTES = 4096  # of the grader command's output kept in the grade's details


class TaskFileError(ValueError):
    """A task file that cannot be used, with where: ``path:line: field: problem``."""

    def __init__(self, path: str, line: int | None, field: str | None, problem: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {field + ': ' if field else ''}{problem}")
        self.path, self.line, self.field, self.problem = path, line, field, problem


def _rel_path(value: Any, err) -> str:
    if not isinstance(value, str) or not value or value.startswith("/") or "\0" in value \
            or ".." in value.split("/"):
        err(f"{value!r} must be a relative path inside the workspace (no leading '/', no '..')")
    return value


def _files(value: Any, err) -> dict[str, str]:
    if not isinstance(value, dict):
        err(f"must be an object of relative path -> file content, got {type(value).__name__}")
    out = {}
    for path, content in value.items():
        _rel_path(path, err)
        if not isinstance(content, str):
            err(f"{path!r}: content must be a string, got {type(content).__name__}")
        out[path] = content
    return out


def _seconds(value: Any, err) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        err(f"must be a positive number of seconds, got {value!r}")
    return float(value)


def _repo(value: Any, base: Path, err) -> tuple[str, str]:
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, dict) or set(value) - {"path", "commit"} or not isinstance(value.get("path"), str):
        err('must be a path or {"path": ..., "commit": ...}')
    path = (base / value["path"]).resolve()
    commit = value.get("commit") or ""
    if not isinstance(commit, str):
        err(f"commit must be a string, got {commit!r}")
    if not path.is_dir():
        err(f"{path} is not a directory")
    if commit:
        r = subprocess.run(["git", "-C", str(path), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            err(f"{path} has no commit {commit!r} (git rev-parse failed)")
    return str(path), commit


def parse_line(obj: Any, *, path: str, line: int, base: Path) -> tuple[Task, str]:
    """(Task, split) of one decoded line; TaskFileError naming the field otherwise."""
    def err_at(field):
        def err(problem):
            raise TaskFileError(path, line, field, problem)
        return err

    if not isinstance(obj, dict):
        raise TaskFileError(path, line, None, f"a task is a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise TaskFileError(path, line, unknown[0], f"unknown field; known: {', '.join(FIELDS)} (put extra data "
                                                    "in metadata)")
    for need in ("id", "instruction", "grader"):
        if need not in obj:
            raise TaskFileError(path, line, need, "missing (required: id, instruction, grader)")
    try:
        task_id = check_id(obj["id"], "id")
    except ValueError as e:
        raise TaskFileError(path, line, "id", str(e)) from None
    instruction = obj["instruction"]
    if not isinstance(instruction, str) or not instruction.strip() or "\0" in instruction:
        raise TaskFileError(path, line, "instruction", "must be a non-empty string")
    files = _files(obj.get("files", {}), err_at("files"))
    repo, commit = _repo(obj["repo"], base, err_at("repo")) if obj.get("repo") else ("", "")
    grader = obj["grader"]
    gerr = err_at("grader")
    if isinstance(grader, str):
        grader = {"command": grader}
    if not isinstance(grader, dict):
        gerr('must be a command string or {"command": ..., "files": {...}, "timeout_s": ...}')
    bad = sorted(set(grader) - set(GRADER_FIELDS))
    if bad:
        gerr(f"unknown field {bad[0]!r}; known: {', '.join(GRADER_FIELDS)}")
    command = grader.get("command")
    if not isinstance(command, str) or not command.strip() or "\0" in command:
        gerr("command must be a non-empty string")
    grader_files = _files(grader.get("files", {}), err_at("grader.files"))
    grader_timeout = _seconds(grader.get("timeout_s", DEFAULT_GRADER_TIMEOUT_S), err_at("grader.timeout_s"))
    deadline = _seconds(obj["timeout_s"], err_at("timeout_s")) if "timeout_s" in obj else None
    split = obj.get("split", "train")
    if split not in SPLITS:
        raise TaskFileError(path, line, "split", f"must be one of {SPLITS}, got {split!r}")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise TaskFileError(path, line, "metadata", f"must be an object, got {type(metadata).__name__}")
    task = Task(task_id=task_id, family=FAMILY, prompt=instruction, grader=GRADER, system_prompt=SYSTEM_PROMPT,
                tools=TOOLS, setup_files=files, repo=repo, repo_commit=commit, deadline_s=deadline,
                metadata=metadata,
                params={"grader_command": command, "grader_files": grader_files, "grader_timeout_s": grader_timeout})
    return task, split


@TASK_FORMATS.register("jsonl", summary="one JSON task a line: id, instruction, files/repo, grader, split, ...")
def load_task_file(path: str | os.PathLike, options: Any = None) -> list[tuple[Task, str]]:
    """Every task of a JSONL file with its split, in file order; TaskFileError on the first
    malformed line (blank lines and lines starting with '#' are skipped). No options."""
    p = Path(path)
    name = str(path)
    if not p.is_file():
        raise TaskFileError(name, None, None, "no such file")
    out: list[tuple[Task, str]] = []
    seen: dict[str, int] = {}
    with open(p, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise TaskFileError(name, line_no, None, f"line of {len(raw)} bytes is over {MAX_LINE_BYTES}")
            text = raw.decode("utf-8", errors="strict") if raw.strip() else ""
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TaskFileError(name, line_no, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
            task, split = parse_line(obj, path=name, line=line_no, base=p.parent.resolve())
            if task.task_id in seen:
                raise TaskFileError(name, line_no, "id", f"{task.task_id!r} is already used on line "
                                                         f"{seen[task.task_id]}")
            seen[task.task_id] = line_no
            out.append((task, split))
    if not out:
        raise TaskFileError(name, None, None, "holds no task")
    return out


def grader_timeout_s(task: Task) -> float:
    """How long the grader command may run (the grading subprocess gets a margin above it)."""
    return float(task.params.get("grader_timeout_s", DEFAULT_GRADER_TIMEOUT_S))


def solution_turns(task: Task):
    raise LookupError(f"task {task.task_id}: tasks from a file carry no scripted demonstration (set sft.steps=0, "
                      "or warm-start from a checkpoint with model.hf_path)")


def score_from_output(stdout_tail: str, returncode: int | None) -> tuple[float | None, dict, str | None]:
    """(score, details, verifier error) from the command's output tail and exit code (None: timed out)."""
    lines = [ln.strip() for ln in stdout_tail.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if last.startswith("{"):
        try:
            obj = json.loads(last)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and "error" in obj:
            return None, {}, f"grader command reported an error: {str(obj['error'])[:500]}"
        if isinstance(obj, dict) and "score" in obj:
            s = obj["score"]
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= 1:
                return None, {}, f"grader command printed score {s!r}, not a number in [0, 1]"
            return float(s), {"exit_code": returncode, "scored_by": "score line"}, None
    if returncode is None:
        return 0.0, {"timed_out": True, "scored_by": "timeout"}, None
    if returncode in (126, 127):
        return None, {}, f"grader command could not run (exit code {returncode}): {stdout_tail[-300:]}"
    return (1.0 if returncode == 0 else 0.0), {"exit_code": returncode, "scored_by": "exit code"}, None


class VerifierError(RuntimeError):
    """The grader itself failed (raised in the grader subprocess: the rollout becomes verifier_error)."""


@FAMILIES.register(FAMILY, generated=False, summary="tasks read from a task file (config.task.dataset)")
def grade(task: Task, workspace: Path) -> Grade:
    """Run the task's grader command on a copy of ``workspace`` (a snapshot); see the module docstring."""
    from gyre_jax.agents.capture import BoundedCapture, drain_thread
    from gyre_jax.agents.graders import snapshot_workspace
    from gyre_jax.agents.sandbox import untrusted_command

    timeout = grader_timeout_s(task)
    with tempfile.TemporaryDirectory(prefix="gyre-grade-") as tmp:
        copy = Path(tmp) / "workspace"
        # the snapshot is bounded already; copying it the same way keeps sparse files sparse
        # and skips (not fails on) paths the longer temporary prefix cannot hold
        snapshot_workspace(workspace, copy, max_bytes=sys.maxsize, max_entries=sys.maxsize)
        for rel, content in task.params.get("grader_files", {}).items():
            dst = copy / rel
            if dst.is_symlink() or dst.is_dir():  # an agent's object where a hidden file goes: replace it
                shutil.rmtree(dst) if dst.is_dir() and not dst.is_symlink() else dst.unlink()
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(content)
        os.chmod(tmp, 0o755)
        capture = BoundedCapture(head=OUTPUT_TAIL_BYTES, tail=65536)
        with untrusted_command(copy, ["bash", "-c", task.params["grader_command"]], writable=True) as argv:
            proc = subprocess.Popen(argv, cwd=copy, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp,
                                         "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
            reader = drain_thread(proc.stdout, capture)
            try:
                returncode = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                returncode = None
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            reader.join(5.0)
    score, details, error = score_from_output(capture.tail_text(), returncode)
    if error is not None or score is None:  # score_from_output gives a score exactly when no error
        raise VerifierError(error or "grader command gave no score")
    tail = capture.tail_text(OUTPUT_TAIL_BYTES)
    return Grade(score, {**details, "output_tail": tail, "output_bytes": capture.total,
                         "exact": score == 1.0})
