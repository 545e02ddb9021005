"""Task sets in the formats teams already have, read as gyre tasks (``--config.task.dataset=PATH``).

  jsonl     gyre's own JSONL (``tasks/dataset.py``): a ``.jsonl`` file whose lines have ``id``
  swebench  SWE-bench-style JSONL: lines with ``instance_id`` and ``problem_statement`` (``swebench.py``)
  harbor    Harbor task directories: a directory holding ``task.toml``, or one whose subdirectories do
            (``harbor.py``; the format Harbor, NeMo-Gym, verifiers, SkyRL, TRL and rLLM read)

The format is read from the path (``detect``), or named: ``--config.task.dataset_options='{"format":
"swebench", ...}'``; the other keys of that JSON object are the format's own options (its ``Options``
dataclass; an unknown one is refused naming the known). Every format is translated into lines of
gyre's JSONL schema and parsed by ``dataset.parse_line``: one grading path for all of them (the clean
graded tree, the verdict modes, ``--check_tasks``), and one place a task's fields are validated.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.dataset import TaskFileError
from gyre_jax.agents.tasks.formats import (  # noqa: F401  (they register themselves; others are found by name)
    harbor,
    jsonl,  # noqa: F401  (registers "jsonl", gyre's own, first)
    swebench,
)
from gyre_jax.agents.tasks.formats.registry import TASK_FORMATS


def parse_options(value: str | Mapping[str, Any] | None, where: str = "config.task.dataset_options") -> dict:
    """The options as a dict (JSON text on the command line, or a mapping)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be a JSON object, got {type(value).__name__}")
    return dict(value)


def detect(path: str) -> str:
    """The format of ``path`` (TaskFileError when none reads it)."""
    for fmt in TASK_FORMATS.entries():
        if fmt.name != "jsonl" and fmt.detect(path):
            return fmt.name
    if os.path.isfile(path):
        return "jsonl"
    raise TaskFileError(path, None, None, "no such file, and not a directory of Harbor tasks (task.toml)"
                        if not os.path.exists(path) else "not a task file (.jsonl) or a Harbor task directory")


def load_task_set(path: str, options: str | Mapping[str, Any] | None = None) -> list[tuple[Task, str]]:
    """Every task of the set at ``path`` with its split, in the set's order (module docstring)."""
    opts = parse_options(options)
    name = opts.pop("format", None) or detect(path)
    try:
        fmt = TASK_FORMATS.get(name)
    except LookupError as e:
        raise ValueError(f"config.task.dataset_options: {e}") from None
    unknown = sorted(set(opts) - set(fmt.options()))
    if unknown:
        raise ValueError(f"config.task.dataset_options: {unknown[0]!r} is not an option of the {name} format; its "
                         f"options: {sorted(fmt.options()) or 'none'} (and 'format')")
    return fmt.obj(path, fmt.config(**opts))


__all__ = ["TASK_FORMATS", "detect", "harbor", "load_task_set", "parse_options",
           "swebench"]
