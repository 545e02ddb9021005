"""Task formats: how a task set on disk becomes tasks (``--config.task.format=NAME``).

``TASK_FORMATS`` is a ``gyre_jax.registry.Registry``. A format is one function, ``load(path,
options) -> list[(Task, split)]`` (``split`` is ``"train"`` or ``"eval"``; a malformed input raises
``dataset.TaskFileError`` naming the file, line and field), its options a frozen dataclass beside it
(``--config.task.format_options.NAME.OPTION=v``), registered in a module of this package with
``@TASK_FORMATS.register(NAME, config=Options, summary=...)``. ``jsonl`` (``dataset.py``) is one task
per line.
"""
from __future__ import annotations

from typing import Any

from gyre_jax.agents.tasks.base import Task
from gyre_jax.registry import Registry

TASK_FORMATS = Registry("task format", "task.format", package="gyre_jax.agents.tasks")


def load_tasks(path: str, format: str = "jsonl", options: Any = None) -> list[tuple[Task, str]]:
    """Every task of ``path`` in ``format`` with its split."""
    entry = TASK_FORMATS.get(format)
    return entry.obj(path, entry.config() if options is None else entry.check_config(options, "task format: "))
