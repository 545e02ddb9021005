"""Tasks from a file: JSONL, one task a line, graded in a sandbox (family ``dataset``).

A line::

    {"id": "fix-add",                              # unique in the file: [A-Za-z0-9_.-]
     "instruction": "calc.py has a bug in add(a, b). Fix it.",   # the text shown to the agent
     "files": {"calc.py": "..."},                  # optional, laid into the workspace
     "repo": "repos/calc" | {"path": "repos/calc", "commit": "3f2c1ab"},  # optional, copied in first
     "grader": <one of the verdict modes below>,
     "fail_to_pass": ["tests/test_calc.py::test_add"], "pass_to_pass": [...],  # per-test mode
     "solution_paths": ["calc.py", "src/**/*.py"],  # optional: what of the policy's work is graded
     "timeout_s": 300,                             # optional: the rollout's deadline
     "split": "train" | "eval",                    # optional, default train
     "metadata": {"solution": ..., "untouched_may_pass": false, ...}}  # optional, any JSON object

``files`` and ``repo`` are optional (an empty workspace is allowed); relative ``repo`` paths
are relative to the file; ``repo`` with a ``commit`` is cloned and checked out at it (a local
git repository: nothing is fetched from a network).

Verdict modes (``verdict_command`` and ``verdict_pytest`` say exactly how each scores):

  per-test   ``fail_to_pass`` / ``pass_to_pass`` (pytest ids: file, file::test, file::Class::test,
             a parametrized id, a directory): gyre runs pytest with its own plugin and reads
             each named test's outcome from it; skipped, errored, missing = failed. ``grader``
             is then optional and may only give ``files`` (the hidden tests), ``timeout_s``,
             ``ro_paths`` and ``pytest_plugins`` (installed plugins to load: autoload is off). Score: the fraction of fail_to_pass that pass if every
             pass_to_pass passes, else 0. Recommended for pytest suites (SWE-bench's lists
             map onto these fields).
  calls      ``grader: {"calls": [{"call": "fizz:fizzbuzz", "args": [15], "expected": "FizzBuzz"},
             ...]}``: each function is called with its arguments in a sandboxed subprocess
             (``call_checks``) and the returned JSON value compared, types included, in gyre's
             grader process: the expected values never reach the sandbox. Score: the fraction
             right. The sound choice for functions with hidden expected answers.
  command    ``grader: "CMD"`` or ``{"command": CMD, "files": {...}, "timeout_s": 60,
             "verdict": "exit_code" | "file", "ro_paths": [...]}``: ``bash -c CMD`` in the
             graded tree. ``exit_code``: exit 0 scores 1, anything else 0. ``file`` (the
             default when CMD or a hidden file mentions ``GYRE_VERDICT``): the command writes
             ``{"score": x}`` to ``$GYRE_VERDICT`` (partial credit) and exits 0; a non-zero
             exit is 0 whatever was written. Stdout is never a score.

What crosses from the workspace to the grader (``graded_tree``, ``tree_rules``): the graded
tree is built from the task's own ``files``/``repo``, never from the workspace. Then the
policy's changes (new, changed and deleted files) are laid on it where ``solution_paths``
allows (default: every path), except, always: runner configuration (``conftest.py``,
``*.ini``, ``pyproject.toml``, ``setup.cfg``, ``pytest.toml``, ``*.pth``,
``sitecustomize.py``, ``usercustomize.py``), bytecode (``__pycache__``, ``*.pyc``, new
``*.so``), new modules shadowing the standard library, the test tools or an installed
package, ``.git``, and the task's protected paths (hidden files, the named tests' files,
shipped files the grader command runs); with the default solution paths also test files
(``test*.py``, ``*_test.py``). Symlinks never cross. The hidden ``grader.files`` are laid
last and are read-only to graded code. What was refused is counted per rollout (the audit).

What a grader sees: ``grader_sandbox`` (the graded tree at /workspace, the run's Python with
its packages, ``grader.ro_paths`` and ``config.task.grader_ro_paths`` read-only, no network).

``metadata.solution`` (used by ``--check_tasks``, never shown to the agent): a shell command
run in the workspace's sandbox, ``{"command": ...}``, ``{"files": {path: content}}`` or
``{"patch": "unified diff"}`` (``git apply``). It must score 1; the untouched workspace must
score below 1 unless ``metadata.untouched_may_pass`` is true.

A malformed line stops the run before it starts, naming the file, the line and the field
(:class:`TaskFileError`); an id used twice names both lines.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tasks import FAMILIES
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tool_schemas import FINISH, RUN_TESTS, TOOL_NAMES
from gyre_jax.agents.tree_rules import check_glob, test_file_of
from gyre_jax.agents.verdict_command import VERDICT_ENV, VERDICT_MODES
from gyre_jax.serving.identity import check_id

FAMILY = "dataset"
GRADER = "gyre_jax.agents.tasks.dataset:grade"
SPLITS = ("train", "eval")
FIELDS = ("id", "instruction", "files", "repo", "grader", "timeout_s", "split", "metadata", "solution_paths",
          "fail_to_pass", "pass_to_pass")
GRADER_FIELDS = ("command", "files", "timeout_s", "verdict", "ro_paths", "calls")
CALL_FIELDS = ("call", "args", "expected")
CALL_TIMEOUT_S = 10.0  # per call of the calls mode (the grader's timeout_s if lower)
TESTS_GRADER_FIELDS = ("files", "timeout_s", "ro_paths", "pytest_plugins")  # per-test mode: gyre runs pytest itself
SOLUTION_KINDS = ("command", "files", "patch")
DEFAULT_GRADER_TIMEOUT_S = 60.0
# The built-in harness's tools for file tasks: every workspace tool (no task suite: run_tests is a family's).
TOOLS = tuple(n for n in TOOL_NAMES if n != RUN_TESTS)
SYSTEM_PROMPT = ("You are a coding agent working in a workspace directory. Act only through tools. "
                 f"Call {FINISH} when the task is done.")
MAX_LINE_BYTES = 64 << 20


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


def _grader(obj: dict, err_at) -> tuple[dict, dict[str, str]]:
    """(grader params, hidden files) of a line: the per-test mode when it names tests, else a command."""
    tests = {k: _test_ids(obj[k], err_at(k)) for k in ("fail_to_pass", "pass_to_pass") if k in obj}
    grader = obj.get("grader", {})
    gerr = err_at("grader")
    if isinstance(grader, str):
        grader = {"command": grader}
    if not isinstance(grader, dict):
        gerr('must be a command string or {"command": ..., "files": {...}, "timeout_s": ...}')
    known = TESTS_GRADER_FIELDS if tests else GRADER_FIELDS
    bad = sorted(set(grader) - set(known))
    if bad:
        gerr(f"unknown field {bad[0]!r}; known: {', '.join(known)}" + (
            " (fail_to_pass/pass_to_pass: gyre runs pytest on the named tests; give no command)" if tests else ""))
    files = _files(grader.get("files", {}), err_at("grader.files"))
    ro = grader.get("ro_paths", [])
    if not isinstance(ro, list) or not all(isinstance(x, str) and x.startswith("/") for x in ro):
        err_at("grader.ro_paths")(f"must be a list of absolute host paths, got {ro!r}")
    params: dict[str, Any] = {"grader_timeout_s": _seconds(grader.get("timeout_s", DEFAULT_GRADER_TIMEOUT_S),
                                                           err_at("grader.timeout_s")), "grader_ro_paths": ro}
    if tests:
        if not any(tests.values()):
            err_at("fail_to_pass")("fail_to_pass and pass_to_pass name no test")
        plugins = grader.get("pytest_plugins", [])
        if not isinstance(plugins, list) or not all(isinstance(x, str) and x and not x.startswith("-")
                                                    and not any(c.isspace() for c in x) for x in plugins):
            err_at("grader.pytest_plugins")(f"must be a list of pytest plugin names, got {plugins!r}")
        return {**params, "grader_mode": "tests", "fail_to_pass": tests.get("fail_to_pass", []),
                "pass_to_pass": tests.get("pass_to_pass", []), "pytest_plugins": plugins}, files
    if "calls" in grader:
        if "command" in grader or "verdict" in grader:
            gerr("give either calls or a command (with its verdict), not both")
        return {**params, "grader_mode": "calls", "grader_calls": _calls(grader["calls"], err_at("grader.calls"))}, \
            files
    command = grader.get("command")
    if not isinstance(command, str) or not command.strip() or "\0" in command:
        gerr("command must be a non-empty string")
    verdict = grader.get("verdict") or ("file" if VERDICT_ENV in command or any(
        VERDICT_ENV in c for c in files.values()) else "exit_code")
    if verdict not in VERDICT_MODES:
        err_at("grader.verdict")(f"must be one of {VERDICT_MODES}, got {verdict!r}")
    return {**params, "grader_mode": "command", "grader_command": command, "grader_verdict": verdict}, files


def _calls(value: Any, err) -> list[dict]:
    if not isinstance(value, list) or not value:
        err('must be a non-empty list of {"call": "module:function", "args": [...], "expected": ...}')
    for i, c in enumerate(value):
        if not isinstance(c, dict) or set(c) != set(CALL_FIELDS):
            err(f"[{i}] must have exactly the fields {CALL_FIELDS}, got {c!r}"[:300])
        module, _, fn = c["call"].partition(":") if isinstance(c["call"], str) else ("", "", "")
        if not fn.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
            err(f"[{i}].call must be 'module:function' (e.g. 'fizz:fizzbuzz'), got {c['call']!r}")
        if not isinstance(c["args"], list):
            err(f"[{i}].args must be a list of JSON arguments, got {c['args']!r}")
    return [dict(c) for c in value]


def _test_ids(value: Any, err) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
        err(f"must be a list of pytest ids (e.g. 'tests/test_x.py::test_y'), got {value!r}")
    for t in value:
        _rel_path(test_file_of(t), err)
    return list(value)


def _metadata(value: Any, err_at) -> dict:
    if not isinstance(value, dict):
        err_at("metadata")(f"must be an object, got {type(value).__name__}")
    sol = value.get("solution")
    err = err_at("metadata.solution")
    if isinstance(sol, dict):
        kinds = [k for k in SOLUTION_KINDS if k in sol]
        if len(kinds) != 1 or set(sol) != set(kinds):
            err(f"must be a command string or an object with exactly one of {SOLUTION_KINDS}, got {sorted(sol)}")
        if kinds[0] == "files":
            _files(sol["files"], err)
        elif not isinstance(sol[kinds[0]], str) or not sol[kinds[0]].strip():
            err(f"{kinds[0]} must be a non-empty string")
    elif sol is not None and (not isinstance(sol, str) or not sol.strip()):
        err("must be a command string or an object ({\"command\"}, {\"files\"} or {\"patch\"})")
    if not isinstance(value.get("untouched_may_pass", False), bool):
        err_at("metadata.untouched_may_pass")("must be true or false")
    return value


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
    for need in ("id", "instruction"):
        if need not in obj:
            raise TaskFileError(path, line, need, "missing (required: id, instruction, and grader or fail_to_pass)")
    if "grader" not in obj and "fail_to_pass" not in obj and "pass_to_pass" not in obj:
        raise TaskFileError(path, line, "grader", "missing: give a grader command or fail_to_pass/pass_to_pass")
    try:
        task_id = check_id(obj["id"], "id")
    except ValueError as e:
        raise TaskFileError(path, line, "id", str(e)) from None
    instruction = obj["instruction"]
    if not isinstance(instruction, str) or not instruction.strip() or "\0" in instruction:
        raise TaskFileError(path, line, "instruction", "must be a non-empty string")
    files = _files(obj.get("files", {}), err_at("files"))
    repo, commit = _repo(obj["repo"], base, err_at("repo")) if obj.get("repo") else ("", "")
    params, hidden = _grader(obj, err_at)
    solution_paths = obj.get("solution_paths", [])
    if not isinstance(solution_paths, list):
        err_at("solution_paths")(f"must be a list of globs, got {solution_paths!r}")
    for g in solution_paths:
        try:
            check_glob(g)
        except ValueError as e:
            err_at("solution_paths")(str(e))
    deadline = _seconds(obj["timeout_s"], err_at("timeout_s")) if "timeout_s" in obj else None
    split = obj.get("split", "train")
    if split not in SPLITS:
        raise TaskFileError(path, line, "split", f"must be one of {SPLITS}, got {split!r}")
    metadata = _metadata(obj.get("metadata", {}), err_at)
    task = Task(task_id=task_id, family=FAMILY, prompt=instruction, grader=GRADER, system_prompt=SYSTEM_PROMPT,
                tools=TOOLS, setup_files=files, repo=repo, repo_commit=commit, deadline_s=deadline,
                metadata=metadata, params=params, hidden_files=hidden, solution_paths=tuple(solution_paths))
    return task, split


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


@FAMILIES.register(FAMILY, generated=False, summary="tasks read from a task set (config.task.dataset)")
def grade(task: Task, tree: Path) -> Grade:
    """Score the graded tree ``tree`` (``graded_tree`` built it; hidden files are in it) by the
    task's verdict mode (module docstring). Every failure of the graded code is a score of 0
    with its reason; ``details['grader_fault']`` says when the grader itself looks broken."""
    from gyre_jax.agents import verdict_command, verdict_pytest
    from gyre_jax.agents.graded_tree import protection

    p = task.params
    timeout = grader_timeout_s(task)
    if p.get("grader_mode") == "calls":
        from gyre_jax.agents.call_checks import grade_calls

        return grade_calls(tree, p["grader_calls"], min(timeout, CALL_TIMEOUT_S), total_s=timeout)
    command = p.get("grader_command", "")
    shipped = [str(f.relative_to(tree)) for f in tree.rglob("*") if f.is_file() and not f.is_symlink()] \
        if command else []
    paths, names = protection(task, shipped)
    read_only = sorted(paths | {r for r in shipped if r.rsplit("/", 1)[-1] in names})
    ro = list(p.get("grader_ro_paths", ()))
    if p.get("grader_mode") == "tests":
        return verdict_pytest.grade(tree, fail_to_pass=p["fail_to_pass"], pass_to_pass=p["pass_to_pass"],
                                    timeout_s=timeout, read_only=read_only, extra_ro_paths=ro,
                                    plugins=p.get("pytest_plugins", ()))
    return verdict_command.grade(command, tree, timeout_s=timeout, mode=p.get("grader_verdict", "exit_code"),
                                 read_only=read_only, extra_ro_paths=ro)
