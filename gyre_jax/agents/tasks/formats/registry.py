"""The task formats' registry (``formats/__init__.py`` says what each format is): ``TASK_FORMATS``, a
``gyre_jax.registry.Registry`` whose entries are a format's ``load(path, options) -> [(Task, split)]``, its
options (a frozen dataclass) and its ``detect(path) -> bool`` (an extra). Its own module, below the formats
that register themselves in it, so no import runs in a circle."""
from __future__ import annotations

from gyre_jax.registry import Registry

TASK_FORMATS = Registry("task format", "task.dataset_options.format")
