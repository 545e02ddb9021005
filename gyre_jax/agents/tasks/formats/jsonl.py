"""Format ``jsonl``: gyre's own task file (``tasks/dataset.py`` reads it; no options)."""
from __future__ import annotations

import dataclasses
import os

from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.formats.registry import TASK_FORMATS


@dataclasses.dataclass(frozen=True)
class NoOptions:
    pass


def load(path: str, _: NoOptions) -> list[tuple[Task, str]]:
    from gyre_jax.agents.tasks.dataset import load_task_file

    return load_task_file(path)


TASK_FORMATS.register("jsonl", config=NoOptions, detect=os.path.isfile,
                      summary="gyre's JSONL task file")(load)
