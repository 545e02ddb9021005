"""Where a run's tasks come from: one small interface, registered by name.

A ``TaskSource`` answers three questions: the task of the run's g-th group
(``train_task(g)``), the held-out tasks (``eval_tasks``) and demonstration tasks for the
supervised warm start (``demo_tasks``; a source without scripted solutions raises
``LookupError``). Two are registered:

  family   a generated family (``gyre_jax.agents.tasks``): group g gets seed
           ``seed * 1_000_003 + g``, eval seeds ``2**29 + s``, demonstrations ``2**30 + s``
           (three disjoint streams).
  dataset  a task set (``gyre_jax.agents.tasks.formats``: a gyre JSONL file, SWE-bench-style JSONL or
           Harbor task directories, each read as ``gyre_jax.agents.tasks.dataset`` tasks): its ``split=train`` tasks
           read through grain (``MapDataset.source(...).shuffle(seed).repeat()``: a fresh
           order every epoch) by random access at the group's number, so the data position
           IS the group counter the trajectory store already keeps durably: a resumed run
           continues with exactly the tasks it would have drawn; eval = the ``split=eval``
           lines plus an optional second file.

Adding a source: a class with ``kind``, the three methods and ``describe``, then
``register_source``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, ClassVar, Protocol

from gyre_jax.agents.tasks.base import Task

log = logging.getLogger(__name__)


class TaskSource(Protocol):
    kind: ClassVar[str]

    def train_task(self, index: int) -> Task: ...

    def eval_tasks(self, limit: int) -> list[Task]: ...

    def demo_tasks(self, n: int) -> list[Task]: ...

    def describe(self) -> str: ...


SOURCES: dict[str, Callable[..., TaskSource]] = {}


def register_source(kind: str, factory: Callable[..., TaskSource]) -> None:
    if kind in SOURCES:
        raise ValueError(f"task source {kind!r} is already registered")
    SOURCES[kind] = factory


def make_source(kind: str, **kwargs) -> TaskSource:
    try:
        factory = SOURCES[kind]
    except KeyError:
        raise LookupError(f"unknown task source {kind!r}; known: {sorted(SOURCES)}") from None
    return factory(**kwargs)


# Disjoint seed streams of generated families.
TRAIN_SEED_STRIDE = 1_000_003
EVAL_SEED_BASE = 2**29
DEMO_SEED_BASE = 2**30


@dataclasses.dataclass(frozen=True)
class FamilySource:
    kind: ClassVar[str] = "family"
    family: str
    seed: int = 0
    kwargs: dict = dataclasses.field(default_factory=dict)

    def _make(self, seed: int) -> Task:
        from gyre_jax.agents.tasks import make_task  # families load on first use

        return make_task(self.family, seed % (2**31), **self.kwargs)

    def train_task(self, index: int) -> Task:
        return self._make(self.seed * TRAIN_SEED_STRIDE + index)

    def eval_tasks(self, limit: int) -> list[Task]:
        return [self._make(EVAL_SEED_BASE + s) for s in range(limit)]

    def demo_tasks(self, n: int) -> list[Task]:
        return [self._make(DEMO_SEED_BASE + s) for s in range(n)]

    def describe(self) -> str:
        return f"family {self.family}"


class DatasetSource:
    kind: ClassVar[str] = "dataset"

    def __init__(self, path: str, eval_path: str = "", seed: int = 0, options: str = ""):
        """``options``: the task set's format and its options (``tasks/formats``: gyre JSONL, SWE-bench
        JSONL, Harbor directories; JSON text, e.g. '{"environment": "host"}')."""
        import grain

        from gyre_jax.agents.tasks.dataset import TaskFileError
        from gyre_jax.agents.tasks.formats import load_task_set

        self.path, self.eval_path, self.seed = path, eval_path, seed
        rows = load_task_set(path, options)
        self.train = [t for t, split in rows if split == "train"]
        self.eval = [t for t, split in rows if split == "eval"]
        if eval_path:
            extra = [t for t, _ in load_task_set(eval_path, options)]
            ids = {t.task_id for t, _ in rows}
            clash = [t.task_id for t in extra if t.task_id in ids]
            if clash:
                raise TaskFileError(eval_path, None, "id", f"{clash[0]!r} is also a task of {path}")
            self.eval += extra
        if not self.train:
            raise TaskFileError(path, None, "split", "no task has split 'train' (the run needs tasks to train on)")
        self.excluded: tuple[str, ...] = ()
        self._ds = grain.MapDataset.source(self.train).shuffle(seed=seed).repeat()

    def all_tasks(self) -> list[Task]:
        return self.train + self.eval

    def exclude(self, task_ids) -> None:
        """Drop these tasks (broken graders the run was told to skip) before the first draw: the
        order is then the remaining tasks' (the same set again on resume: the check is cached)."""
        import grain

        drop = set(task_ids)
        self.excluded = tuple(sorted(drop))
        self.train = [t for t in self.train if t.task_id not in drop]
        self.eval = [t for t in self.eval if t.task_id not in drop]
        if not self.train:
            raise LookupError(f"{self.path}: every train task was excluded (broken graders): nothing to train on")
        self._ds = grain.MapDataset.source(self.train).shuffle(seed=self.seed).repeat()

    def train_task(self, index: int) -> Task:
        return self._ds[index]

    def eval_tasks(self, limit: int) -> list[Task]:
        """The first ``limit`` held-out tasks. Asked for more than the file holds, every one of them, and a
        warning naming both numbers: ``eval.tasks`` is a cap (a run's evals compare versions on one fixed set,
        whatever its size), and a run must not fail at its first eval for a file that shrank; but it must
        not read as ``limit`` tasks either (eval.jsonl's ``eval/tasks`` says how many were run)."""
        if 0 < len(self.eval) < limit:  # none at all: the config check refuses the eval
            log.warning("config.eval.tasks=%d but %s holds %d held-out task(s): evaluating all %d", limit,
                        self.eval_path or self.path, len(self.eval), len(self.eval))
        return self.eval[:limit]

    def demo_tasks(self, n: int) -> list[Task]:
        raise LookupError(f"{self.path}: tasks from a file carry no scripted demonstrations")

    def describe(self) -> str:
        return (f"dataset {self.path} ({len(self.train)} train, {len(self.eval)} eval tasks"
                f"{', eval file ' + self.eval_path if self.eval_path else ''}"
                f"{f', {len(self.excluded)} broken tasks skipped' if self.excluded else ''})")


register_source(FamilySource.kind, FamilySource)
register_source(DatasetSource.kind, DatasetSource)
