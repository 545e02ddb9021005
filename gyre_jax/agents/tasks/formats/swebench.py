"""SWE-bench-style JSONL as gyre tasks (format ``swebench``), graded by the named tests.

A line (SWE-bench's fields; Hugging Face's copies store the two test lists as JSON text, read either way)::

    {"instance_id": "calc__calc-1", "problem_statement": "add() returns a - b ...",
     "repo": "calc/calc", "base_commit": "3f2c1ab...",
     "patch": "diff --git a/calc.py ...",              # the reference fix (--check_tasks: it must score 1)
     "test_patch": "diff --git a/tests/test_calc.py ...",
     "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
     "hints_text": "", "created_at": "...", "version": "1.0", "environment_setup_commit": "3f2c1ab..."}

Mapped onto gyre's schema (``tasks/dataset.py``): ``id`` = instance_id, ``instruction`` =
problem_statement (+ hints_text with ``{"hints": true}``), ``repo`` = the local clone of ``repo``
checked out at ``base_commit`` (``options.repos``: a directory holding ``owner__name`` or
``owner/name`` clones or ``owner__name.bundle`` git bundles, default ``repos`` beside the file: nothing
is fetched), ``fail_to_pass`` /
``pass_to_pass`` = FAIL_TO_PASS / PASS_TO_PASS (pytest ids), and the test files the test_patch
adds or changes, as they are after applying it at base_commit, are the task's hidden grader files:
the agent works on the repository without them, and the grader lays them over its work (as
SWE-bench's harness resets the test files before it runs them). The score is the per-test verdict:
the fraction of FAIL_TO_PASS that pass if every PASS_TO_PASS passes, else 0 (skipped, errored or
missing tests fail). ``patch`` becomes ``metadata.solution``; ``split`` (a gyre extension) "eval"
holds a line out; created_at, version, hints_text and difficulty are kept in ``metadata.swebench``.

The environment (``options.environment``): SWE-bench grades each instance in its own image, built
for its repository at ``environment_setup_commit``. gyre does not build those: with the default
``docker`` a line is refused naming that field; ``host`` grades with the run's Python and whatever it
has installed (the repository's dependencies must be there: ``grader.ro_paths`` or
``config.task.grader_ro_paths`` for a separate environment), for repositories that need nothing else.
Any other field is refused, naming it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.dataset import MAX_LINE_BYTES, TaskFileError, parse_line
from gyre_jax.agents.tasks.formats.registry import TASK_FORMATS

REQUIRED = ("instance_id", "problem_statement", "repo", "base_commit", "test_patch")
KNOWN = REQUIRED + ("patch", "FAIL_TO_PASS", "PASS_TO_PASS", "hints_text", "created_at", "version",
                    "environment_setup_commit", "difficulty", "split")
KEPT = ("created_at", "version", "difficulty", "environment_setup_commit")
ENVIRONMENTS = ("docker", "host")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    repos: str = ""  # where the clones are ("owner__name" or "owner/name"); "" = repos/ beside the file
    environment: str = "docker"  # docker | host (module docstring)
    hints: bool = False  # append hints_text to the instruction
    grader_timeout_s: float = 600.0  # per grading run of the named tests

    def __post_init__(self):
        if self.environment not in ENVIRONMENTS:
            raise ValueError(f"config.task.dataset_options: environment={self.environment!r}; known: {ENVIRONMENTS}")


def detect(path: str) -> bool:
    """A JSONL file whose first task line has instance_id and problem_statement."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip() and not raw.lstrip().startswith(b"#"):
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(obj, dict) and "instance_id" in obj and "problem_statement" in obj
    return False


def load(path: str, opts: Options) -> list[tuple[Task, str]]:
    repos = opts.repos or os.path.join(os.path.dirname(os.path.abspath(path)), "repos")
    out: list[tuple[Task, str]] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise TaskFileError(path, n, None, f"line of {len(raw)} bytes is over {MAX_LINE_BYTES}")
            if not raw.strip() or raw.lstrip().startswith(b"#"):
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise TaskFileError(path, n, None, f"not valid JSON ({e})") from None
            task, split = parse_line(instance_line(obj, path, n, repos, opts), path=path, line=n,
                                     base=Path(path).parent.resolve())
            if task.task_id in seen:
                raise TaskFileError(path, n, "instance_id", f"{task.task_id!r} is already used on line "
                                                            f"{seen[task.task_id]}")
            seen[task.task_id] = n
            out.append((task, split))
    if not out:
        raise TaskFileError(path, None, None, "holds no instance")
    return out


def _tests(value: Any, err) -> list[str]:
    if isinstance(value, str):  # the Hugging Face datasets' JSON text
        try:
            value = json.loads(value)
        except ValueError:
            err(f"must be a list of test ids (or its JSON text), got {value[:80]!r}")
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        err(f"must be a list of test ids, got {value!r}"[:200])
    return list(value)


def instance_line(obj: Any, path: str, n: int, repos: str, opts: Options) -> dict[str, Any]:
    """The gyre JSONL line of one SWE-bench instance (module docstring)."""
    def err_at(field):
        def err(problem):
            raise TaskFileError(path, n, field, problem)
        return err

    if not isinstance(obj, dict):
        raise TaskFileError(path, n, None, f"an instance is a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KNOWN))
    if unknown:
        err_at(unknown[0])(f"not a SWE-bench field gyre reads; known: {', '.join(KNOWN)}")
    for k in REQUIRED:
        if not isinstance(obj.get(k), str) or not obj[k].strip():
            err_at(k)("missing or not a non-empty string")
    if opts.environment == "docker":
        err_at("environment_setup_commit" if obj.get("environment_setup_commit") else "repo")(
            "SWE-bench grades each instance in its own environment image; gyre does not build those. To grade "
            "with this run's Python and what it has installed: --config.task.dataset_options="
            "'{\"environment\": \"host\"}'")
    f2p = _tests(obj.get("FAIL_TO_PASS", []), err_at("FAIL_TO_PASS"))
    p2p = _tests(obj.get("PASS_TO_PASS", []), err_at("PASS_TO_PASS"))
    repo_dir = _clone_of(obj["repo"], repos, err_at("repo"))
    hidden = test_files(repo_dir, obj["base_commit"], obj["test_patch"], err_at("test_patch"))
    instruction = obj["problem_statement"]
    if opts.hints and obj.get("hints_text"):
        instruction += "\n\nHints:\n" + str(obj["hints_text"])
    line: dict[str, Any] = {
        "id": obj["instance_id"], "instruction": instruction,
        "repo": {"path": repo_dir, "commit": obj["base_commit"]},
        "fail_to_pass": f2p, "pass_to_pass": p2p,
        "grader": {"files": hidden, "timeout_s": float(opts.grader_timeout_s)},
        "metadata": {"swebench": {"repo": obj["repo"], **{k: obj[k] for k in KEPT if k in obj}}},
    }
    if obj.get("hints_text") and not opts.hints:
        line["metadata"]["swebench"]["hints_text"] = obj["hints_text"]
    if obj.get("patch"):
        line["metadata"]["solution"] = {"patch": obj["patch"]}
    if "split" in obj:
        line["split"] = obj["split"]
    return line


def _clone_of(repo: str, repos: str, err) -> str:
    """The local clone of ``repo``: ``owner__name`` or ``owner/name`` under ``repos``, or a git bundle
    ``owner__name.bundle`` there (cloned once, bare, into the user's cache: a task set can ship its
    repositories as bundles)."""
    tried = [os.path.join(repos, repo.replace("/", "__")), os.path.join(repos, repo)]
    for d in tried:
        if os.path.isdir(os.path.join(d, ".git")) or os.path.isfile(os.path.join(d, "HEAD")):
            return os.path.abspath(d)
    bundle = tried[0] + ".bundle"
    if os.path.isfile(bundle):
        return _from_bundle(bundle, err)
    err(f"{repo!r}: no local clone at {' or '.join(tried)} and no {bundle} (gyre fetches nothing: clone it there, "
        "or set dataset_options' repos)")
    raise AssertionError("unreachable")


def _from_bundle(bundle: str, err) -> str:
    with open(bundle, "rb") as f:
        key = hashlib.sha1(f.read()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gyre_jax", "swebench")
    dest = os.path.join(cache, f"{os.path.basename(bundle)[:-len('.bundle')]}-{key}.git")
    if os.path.isfile(os.path.join(dest, "HEAD")):
        return dest
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".clone-", dir=cache)
    r = subprocess.run(["git", "clone", "--quiet", "--bare", bundle, os.path.join(tmp, "repo.git")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        err(f"cloning {bundle} failed: {r.stderr.strip()[-300:]}")
    try:
        os.rename(os.path.join(tmp, "repo.git"), dest)
    except OSError:  # another process cloned it first
        if not os.path.isfile(os.path.join(dest, "HEAD")):
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def test_files(repo: str, commit: str, patch: str, err) -> dict[str, str]:
    """The files ``patch`` adds or changes, as they are after applying it at ``commit`` (path -> text).

    Applied to a scratch index with a scratch object directory: the clone is only read."""
    with tempfile.TemporaryDirectory(prefix="gyre-swebench-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index"),
               "GIT_OBJECT_DIRECTORY": os.path.join(tmp, "objects"),
               "GIT_ALTERNATE_OBJECT_DIRECTORIES": _objects_dir(repo), "GIT_TERMINAL_PROMPT": "0"}
        os.makedirs(env["GIT_OBJECT_DIRECTORY"])
        patch_file = os.path.join(tmp, "test.patch")
        with open(patch_file, "w") as f:
            f.write(patch if patch.endswith("\n") else patch + "\n")

        def git(*args):
            r = subprocess.run(["git", "-c", "safe.directory=*", "-C", repo, *args], capture_output=True, text=True,
                               env=env, timeout=120)
            if r.returncode != 0:
                err(f"git {args[0]} failed at {commit[:12]}: {(r.stderr or r.stdout).strip()[-300:]}")
            return r.stdout

        git("read-tree", commit)
        git("apply", "--cached", "--whitespace=nowarn", patch_file)
        out = {}
        for row in git("diff", "--cached", "--name-status", "--no-renames", commit).splitlines():
            status, _, name = row.partition("\t")
            if status.startswith("D"):
                err(f"deletes {name}: a test patch that deletes files is not supported")
            blob = subprocess.run(["git", "-c", "safe.directory=*", "-C", repo, "show", f":{name}"],
                                  capture_output=True, env=env, timeout=60)
            try:
                out[name] = blob.stdout.decode("utf-8")
            except UnicodeDecodeError:
                err(f"{name} is not UTF-8 text (gyre carries a task's files as text)")
        if not out:
            err("changes no file")
        return out


def _objects_dir(repo: str) -> str:
    for d in (os.path.join(repo, ".git", "objects"), os.path.join(repo, "objects")):
        if os.path.isdir(d):
            return os.path.abspath(d)
    return os.path.join(repo, ".git", "objects")


TASK_FORMATS.register("swebench", config=Options, detect=detect,
                      summary="SWE-bench-style JSONL (instance_id, problem_statement, repo + base_commit, "
                              "test_patch, FAIL_TO_PASS, PASS_TO_PASS)")(load)
