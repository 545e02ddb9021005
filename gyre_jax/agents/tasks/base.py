"""Task: one verifiable task instance, serializable to JSON for the grader subprocess."""
from __future__ import annotations

import dataclasses
import json
import re
import types
from typing import Any, Mapping

from gyre_jax.agents.tool_schemas import RUN_TESTS, TOOL_NAMES
from gyre_jax.agents.tree_rules import check_glob
from gyre_jax.serving.identity import check_id

# every tool, sub-agents included, but run_tests: only a family with a test suite offers it
DEFAULT_TOOLS = tuple(n for n in TOOL_NAMES if n != RUN_TESTS)
_GRADER_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    task_id: str
    family: str
    prompt: str  # the user message that states the task
    # "module:function" of the grader, called in a subprocess as fn(task, workspace_path)
    # and returning a scoring.Grade (see gyre_jax.agents.grader_main).
    grader: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # JSON; what the grader needs
    system_prompt: str | None = None  # None: the harness default
    tools: tuple[str, ...] = DEFAULT_TOOLS
    setup_files: Mapping[str, str] = dataclasses.field(default_factory=dict)  # written before the agent starts
    # A local directory or git repository copied into the workspace before ``setup_files``
    # (absolute; a task file's relative paths are resolved when it is read); with
    # ``repo_commit`` the repository is cloned and checked out at that commit.
    repo: str = ""
    repo_commit: str = ""
    deadline_s: float | None = None  # this task's rollout deadline; None: the harness's
    # Files only the grader sees, laid last into the graded tree (gyre_jax.agents.graded_tree).
    hidden_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Globs of the paths whose changes by the policy reach the grader (gyre_jax.agents.tree_rules);
    # empty: the files the task ships and new files, minus runner configuration, bytecode, etc.
    solution_paths: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # JSON; for harnesses and reports

    def __post_init__(self):
        check_id(self.task_id, "Task.task_id")
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ValueError(f"Task {self.task_id}: prompt must be a non-empty string")
        if not isinstance(self.grader, str) or not _GRADER_RE.fullmatch(self.grader):
            raise ValueError(f"Task {self.task_id}: grader must be 'module:function', got {self.grader!r}")
        object.__setattr__(self, "tools", tuple(self.tools))
        unknown = sorted(set(self.tools) - set(TOOL_NAMES))
        if unknown:
            raise ValueError(f"Task {self.task_id}: unknown tools {unknown}; known: {list(TOOL_NAMES)}")
        object.__setattr__(self, "solution_paths", tuple(self.solution_paths))
        for pattern in self.solution_paths:
            try:
                check_glob(pattern)
            except ValueError as e:
                raise ValueError(f"Task {self.task_id}: solution_paths: {e}") from None
        for name in ("params", "setup_files", "metadata", "hidden_files"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ValueError(f"Task {self.task_id}: {name} must be a mapping, got {type(value).__name__}")
            try:
                json.dumps(dict(value))
            except (TypeError, ValueError) as e:
                raise ValueError(f"Task {self.task_id}: {name} must be JSON-serializable ({e})") from None
            object.__setattr__(self, name, types.MappingProxyType(dict(value)))
        for name in ("setup_files", "hidden_files"):
            for path, content in getattr(self, name).items():
                if not isinstance(path, str) or not isinstance(content, str) or not path or path.startswith("/") \
                        or ".." in path.split("/") or "" in path.split("/"):
                    raise ValueError(f"Task {self.task_id}: {name} entry {path!r} must be a relative path -> str")
        if self.repo_commit and not self.repo:
            raise ValueError(f"Task {self.task_id}: repo_commit {self.repo_commit!r} needs a repo")
        if self.repo and not self.repo.startswith("/"):
            raise ValueError(f"Task {self.task_id}: repo must be an absolute path, got {self.repo!r}")
        if self.deadline_s is not None and (isinstance(self.deadline_s, bool) or not isinstance(self.deadline_s, (int, float))
                                            or not 0 < self.deadline_s < float("inf")):
            raise ValueError(f"Task {self.task_id}: deadline_s must be a positive number, got {self.deadline_s!r}")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["params"], d["setup_files"], d["tools"] = dict(self.params), dict(self.setup_files), list(self.tools)
        d["metadata"], d["hidden_files"] = dict(self.metadata), dict(self.hidden_files)
        d["solution_paths"] = list(self.solution_paths)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Task":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Task.from_dict: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Task":
        return cls.from_dict(json.loads(text))
