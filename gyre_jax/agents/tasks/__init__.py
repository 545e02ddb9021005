"""Task families, by name: ``FAMILIES``, a ``gyre_jax.registry.Registry`` of the modules of this package.

A family is a module here (its name the family's) that declares ``FAMILY``, its options (a frozen
dataclass, ``--config.task.family_options.NAME.OPTION=v``) and registers its ``make_task(seed,
options=None, **values) -> Task`` with ``@FAMILIES.register(FAMILY, config=Options, summary=...,
generated=True)``. It also provides ``solution_turns(task)`` (the scripted ideal actions, for
demonstrations) and ``grade(task, workspace) -> Grade`` (run in the grader subprocess); a family
whose tasks offer ``run_tests`` also provides ``test_suite(task) -> test_suite.TestSuite``. The
``dataset`` family's tasks come from a file (``gyre_jax.agents.task_sources``): it registers its
``grade`` with ``generated=False``.

Families are imported on first use: the grader subprocess (one per rollout) imports only its
own family's module, not every family's dependencies.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Mapping

from gyre_jax.agents.tasks.base import DEFAULT_TOOLS, Task
from gyre_jax.registry import Registry

FAMILIES = Registry("task family", "task.family", package=__name__)


def family(name: str) -> types.ModuleType:
    """The family's module (imported now, alone, if it was not)."""
    module = sys.modules[FAMILIES.get(name).obj.__module__]
    if module.FAMILY != name:
        raise RuntimeError(f"task family module {module.__name__} declares FAMILY={module.FAMILY!r}, not {name!r}")
    return module


def family_options(name: str, options: Any, values: Mapping[str, Any]):
    """A family's options: ``options`` (its options instance) with ``values`` (field -> value) over it."""
    if options is None:
        return FAMILIES.get(name).make_config(values, where=f"task family {name}: ")
    return dataclasses.replace(options, **values) if values else options


def generated_families() -> list[str]:
    """Families whose tasks are generated from a seed (``make_task``); ``dataset`` reads them from a file."""
    return [e.name for e in FAMILIES.entries() if e.generated]


def make_task(family_name: str, seed: int, options: Any = None, **values) -> Task:
    return FAMILIES.get(family_name).obj(seed, options, **values)


def test_suite(task: Task):
    """The suite ``run_tests`` runs for ``task`` (None: its family has none)."""
    fn = getattr(family(task.family), "test_suite", None) if task.family in FAMILIES else None
    return fn(task) if fn is not None else None


test_suite.__test__ = False  # type: ignore[attr-defined]  # not a pytest test (pytest reads the attribute)


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    return family(task.family).solution_turns(task)


__all__ = ["DEFAULT_TOOLS", "FAMILIES", "Task", "family", "family_options", "generated_families", "make_task",
           "solution_turns", "test_suite"]
