"""The task formats' registry (``formats/__init__.py`` says what each format is): ``TASK_FORMATS``, a
``gyre_jax.registry.Registry`` whose entries are a format's ``load(path, options) -> [(Task, split)]``, its
options (a frozen dataclass) and its ``detect(path) -> bool`` (an extra). Its own module, below the formats
that register themselves in it, so no import runs in a circle; a format is found by its module's name in this
package (a new one is one file here, nothing to import it)."""
from __future__ import annotations

from gyre_jax.registry import Registry

TASK_FORMATS = Registry("task format", "task.dataset_options.format", package="gyre_jax.agents.tasks.formats")
