"""The task formats' registry (``formats/__init__.py`` says what each format is): one ``TaskFormat`` per
name. Its own module, below the formats that register themselves in it, so no import runs in a circle."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gyre_jax.agents.tasks.base import Task


@dataclasses.dataclass(frozen=True)
class TaskFormat:
    """One format: ``detect(path)`` says whether a path is in it; ``load(path, options)`` reads it."""

    name: str
    options: type  # a frozen dataclass: the format's options, with their defaults
    detect: Callable[[str], bool]
    load: Callable[[str, Any], list[tuple[Task, str]]]
    summary: str


FORMATS: dict[str, TaskFormat] = {}


def register_format(fmt: TaskFormat) -> TaskFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"task format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt
