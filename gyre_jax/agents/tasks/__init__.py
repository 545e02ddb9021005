"""Task families, by name. Each family module provides ``make_task(seed, **kw) -> Task``,
``solution_turns(task)`` (the scripted ideal actions, for demonstrations) and
``grade(task, workspace) -> Grade`` (run in the grader subprocess)."""
from __future__ import annotations

import types

from gyre_jax.agents.tasks import repo_spec, tiny
from gyre_jax.agents.tasks.base import DEFAULT_TOOLS, Task

FAMILIES: dict[str, types.ModuleType] = {repo_spec.FAMILY: repo_spec, tiny.FAMILY: tiny}


def family(name: str) -> types.ModuleType:
    try:
        return FAMILIES[name]
    except KeyError:
        raise LookupError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}") from None


def make_task(family_name: str, seed: int, **kwargs) -> Task:
    return family(family_name).make_task(seed, **kwargs)


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    return family(task.family).solution_turns(task)


__all__ = ["DEFAULT_TOOLS", "FAMILIES", "Task", "family", "make_task", "solution_turns"]
