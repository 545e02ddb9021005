"""Where a run's tasks come from: one small interface, registered by name.

A ``TaskSource`` answers three questions: the task of the run's g-th group
(``train_task(g)``), the held-out tasks (``eval_tasks``) and demonstration tasks for the
supervised warm start (``demo_tasks``; a source without scripted solutions raises
``LookupError``). Two are registered:

  family   a generated family (``gyre_jax.agents.tasks``): group g gets seed
           ``seed * 1_000_003 + g``, eval seeds ``2**29 + s``, demonstrations ``2**30 + s``
           (three disjoint streams).
  dataset  a JSONL task file (``gyre_jax.agents.tasks.dataset``): its ``split=train`` tasks
           read through grain (``MapDataset.source(...).shuffle(seed).repeat()``: a fresh
           order every epoch) by random access at the group's number, so the data position
           IS the group counter the trajectory store already keeps durably: a resumed run
           continues with exactly the tasks it would have drawn; eval = the ``split=eval``
           lines plus an optional second file.

Adding a source: a class with ``kind``, the three methods and ``describe``, registered with
``@TASK_SOURCES.register(kind, summary=...)`` (``gyre_jax.registry``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

from gyre_jax.agents.tasks import FAMILIES
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.formats import TASK_FORMATS
from gyre_jax.registry import Registry, options_field, resolve_options


class TaskSource(Protocol):
    kind: ClassVar[str]

    def train_task(self, index: int) -> Task: ...

    def eval_tasks(self, limit: int) -> list[Task]: ...

    def demo_tasks(self, n: int) -> list[Task]: ...

    def describe(self) -> str: ...


TASK_SOURCES = Registry("task source", "task")


def make_source(kind: str, **kwargs) -> TaskSource:
    return TASK_SOURCES.get(kind).obj(**kwargs)


# Disjoint seed streams of generated families.
TRAIN_SEED_STRIDE = 1_000_003
EVAL_SEED_BASE = 2**29
DEMO_SEED_BASE = 2**30


@TASK_SOURCES.register("family", summary="a generated family: three disjoint seed streams (train, eval, demos)")
@dataclasses.dataclass(frozen=True)
class FamilySource:
    kind: ClassVar[str] = "family"
    family: str
    seed: int = 0
    options: Any = None  # the family's options (None: its defaults)

    def _make(self, seed: int) -> Task:
        from gyre_jax.agents.tasks import make_task  # families load on first use

        return make_task(self.family, seed % (2**31), self.options)

    def train_task(self, index: int) -> Task:
        return self._make(self.seed * TRAIN_SEED_STRIDE + index)

    def eval_tasks(self, limit: int) -> list[Task]:
        return [self._make(EVAL_SEED_BASE + s) for s in range(limit)]

    def demo_tasks(self, n: int) -> list[Task]:
        return [self._make(DEMO_SEED_BASE + s) for s in range(n)]

    def describe(self) -> str:
        return f"family {self.family}"


@TASK_SOURCES.register("dataset", summary="a task set on disk (task.dataset) in a task format (task.format)")
class DatasetSource:
    kind: ClassVar[str] = "dataset"

    def __init__(self, path: str, eval_path: str = "", seed: int = 0, format: str = "jsonl", options: Any = None):
        import grain

        from gyre_jax.agents.tasks.dataset import TaskFileError
        from gyre_jax.agents.tasks.formats import load_tasks

        self.path, self.eval_path, self.seed = path, eval_path, seed
        rows = load_tasks(path, format, options)
        self.train = [t for t, split in rows if split == "train"]
        self.eval = [t for t, split in rows if split == "eval"]
        if eval_path:
            extra = [t for t, _ in load_tasks(eval_path, format, options)]
            ids = {t.task_id for t, _ in rows}
            clash = [t.task_id for t in extra if t.task_id in ids]
            if clash:
                raise TaskFileError(eval_path, None, "id", f"{clash[0]!r} is also a task of {path}")
            self.eval += extra
        if not self.train:
            raise TaskFileError(path, None, "split", "no task has split 'train' (the run needs tasks to train on)")
        self._ds = grain.MapDataset.source(self.train).shuffle(seed=seed).repeat()

    def train_task(self, index: int) -> Task:
        return self._ds[index]

    def eval_tasks(self, limit: int) -> list[Task]:
        return self.eval[:limit]

    def demo_tasks(self, n: int) -> list[Task]:
        raise LookupError(f"{self.path}: tasks from a file carry no scripted demonstrations")

    def describe(self) -> str:
        return (f"dataset {self.path} ({len(self.train)} train, {len(self.eval)} eval tasks"
                f"{', eval file ' + self.eval_path if self.eval_path else ''})")



@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The RL run's task section (``config.task``): a generated family, or a task set on disk."""

    SECTION: ClassVar[str] = "task"
    family: str = "tiny"  # a task family (gyre_jax.agents.tasks; python -m gyre_jax.plugins lists them)
    family_options: Any = options_field(FAMILIES, "family")  # --config.task.family_options.FAMILY.OPTION=v
    # A task set (a file, or a directory for formats that are one) in `format`; set, it replaces `family`.
    # eval_dataset: a second set of held-out tasks (besides the first one's split=eval tasks).
    dataset: str = ""
    eval_dataset: str = ""
    format: str = "jsonl"  # a task format (gyre_jax.agents.tasks.formats)
    format_options: Any = options_field(TASK_FORMATS, "format")

    def __post_init__(self):
        resolve_options(self)
        if self.eval_dataset and not self.dataset:
            raise ValueError("TaskConfig.eval_dataset needs config.task.dataset (the training tasks' set)")

    def source(self, seed: int) -> TaskSource:
        """The run's TaskSource: the task set's, else the family's."""
        if self.dataset:
            return make_source("dataset", path=self.dataset, eval_path=self.eval_dataset, seed=seed,
                               format=self.format, options=self.format_options)
        return make_source("family", family=self.family, seed=seed, options=self.family_options)
