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

Adding a source: a class with ``kind``, the three methods and ``describe``, registered with
``@TASK_SOURCES.register(kind, summary=...)`` (``gyre_jax.registry``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, ClassVar, Protocol

from gyre_jax.agents.tasks import FAMILIES
from gyre_jax.agents.tasks.base import Task
from gyre_jax.registry import Registry, options_field, resolve_options

log = logging.getLogger(__name__)


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


@TASK_SOURCES.register("dataset", summary="a task set on disk (task.dataset) (its format read from the path or task.dataset_options)")
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



TASK_CHECKS = ("start", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The RL run's task section (``config.task``): a generated family, or a task set on disk."""

    SECTION: ClassVar[str] = "task"
    family: str = "tiny"  # a task family (gyre_jax.agents.tasks; python -m gyre_jax.plugins lists them)
    family_options: Any = options_field(FAMILIES, "family")  # --config.task.family_options.FAMILY.OPTION=v
    # A task set instead of a family: gyre or SWE-bench JSONL, a directory of Harbor tasks (the format is read
    # from the path, or named in dataset_options); eval_dataset: a second set of held-out tasks (besides the
    # first one's split=eval tasks).
    dataset: str = ""
    eval_dataset: str = ""
    # The task set's format and options, JSON text (gyre_jax.agents.tasks.formats), e.g. '{"environment": "host"}'
    # runs Harbor or SWE-bench tasks on this host's toolchain (no per-task image).
    dataset_options: str = ""
    # Check every task's grader at start (gyre_jax.rl.task_gate; --check_tasks prints the same): "start" (task
    # files; a generated family's graders are gyre's own) or "off". A broken task stops the run with one error:
    # line, unless skip_broken drops it (counted in the log and summary).
    check: str = "start"
    skip_broken: bool = False
    # Host paths every graded command sees read-only besides the run's Python (comma-separated), e.g. a
    # toolchain its tests need (gyre_jax.agents.grader_sandbox).
    grader_ro_paths: str = ""

    def __post_init__(self):
        resolve_options(self)
        if self.eval_dataset and not self.dataset:
            raise ValueError("TaskConfig.eval_dataset needs config.task.dataset (the training tasks' set)")
        if self.check not in TASK_CHECKS:
            raise ValueError(f"TaskConfig.check must be one of {TASK_CHECKS}, got {self.check!r}")
        for p in self.grader_ro_path_list:
            if not os.path.isabs(p):
                raise ValueError(f"TaskConfig.grader_ro_paths: {p!r} is not an absolute path")
        if self.dataset_options:
            from gyre_jax.agents.tasks.formats import parse_options  # light: no format is read here

            parse_options(self.dataset_options)

    @property
    def grader_ro_path_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.grader_ro_paths.split(",") if p.strip())

    def source(self, seed: int) -> TaskSource:
        """The run's TaskSource: the task set's, else the family's."""
        if self.dataset:
            return make_source("dataset", path=self.dataset, eval_path=self.eval_dataset, seed=seed,
                               options=self.dataset_options)
        return make_source("family", family=self.family, seed=seed, options=self.family_options)
