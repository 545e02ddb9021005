"""Task families, by name. Each family module provides ``make_task(seed, **kw) -> Task``
(except ``dataset``, whose tasks come from a file: ``gyre_jax.agents.task_sources``),
``solution_turns(task)`` (the scripted ideal actions, for demonstrations) and
``grade(task, workspace) -> Grade`` (run in the grader subprocess); a family whose tasks
offer ``run_tests`` also provides ``test_suite(task) -> test_suite.TestSuite``."""
from __future__ import annotations

import importlib
import types

from gyre_jax.agents.tasks.base import DEFAULT_TOOLS, Task

# Family name -> module, imported on first use: the grader subprocess (one per rollout)
# then imports only its own family, not every family's dependencies.
FAMILIES: dict[str, str] = {"dataset": "gyre_jax.agents.tasks.dataset", "repo_spec": "gyre_jax.agents.tasks.repo_spec",
                            "tiny": "gyre_jax.agents.tasks.tiny", "tiny_tests": "gyre_jax.agents.tasks.tiny_tests",
                            "tiny_agent": "gyre_jax.agents.tasks.tiny_agent"}

# Families whose tasks are generated from a seed (make_task); "dataset" reads them from a file.
GENERATED: tuple[str, ...] = tuple(f for f in FAMILIES if f != "dataset")


def family(name: str) -> types.ModuleType:
    try:
        module = importlib.import_module(FAMILIES[name])
    except KeyError:
        raise LookupError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}") from None
    if module.FAMILY != name:
        raise RuntimeError(f"task family module {module.__name__} declares FAMILY={module.FAMILY!r}, not {name!r}")
    return module


def make_task(family_name: str, seed: int, **kwargs) -> Task:
    return family(family_name).make_task(seed, **kwargs)


def test_suite(task: Task):
    """The suite ``run_tests`` runs for ``task`` (None: its family has none)."""
    fn = getattr(family(task.family), "test_suite", None) if task.family in FAMILIES else None
    return fn(task) if fn is not None else None


test_suite.__test__ = False  # type: ignore[attr-defined]  # not a pytest test (pytest reads the attribute)


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    return family(task.family).solution_turns(task)


__all__ = ["DEFAULT_TOOLS", "FAMILIES", "GENERATED", "Task", "family", "make_task", "solution_turns", "test_suite"]
