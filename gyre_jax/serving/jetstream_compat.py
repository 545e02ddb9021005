"""The one place gyre_jax imports JetStream (PyPI ``google-jetstream`` 0.2.2).

Import ``engine_api`` and ``orchestrator`` from here, never from ``jetstream``
directly, so the two fixes below are applied exactly once, before first use:

1. google-jetstream 0.2.2 (the last release; upstream archived the repository in
   Feb 2026) calls ``jax.tree_map``, which current JAX removed. Without the alias
   the orchestrator's generate thread dies with AttributeError (its JetThread then
   SIGKILLs the whole process).
2. ``jetstream.core.orchestrator`` sets the *root* logger to DEBUG and adds a
   stdout handler at import time; every generate step then logs two INFO lines
   from two threads. We undo both so JetStream logs only warnings, and the host
   program keeps its own logging setup.

JetStream imports seqio and therefore tensorflow (~5 s on 2 CPU cores), which is
why only ``gyre_jax.serving`` may import this module.
"""
from __future__ import annotations

import logging
import os

import jax

# (1) Compatibility shim: jetstream 0.2.2 predates jax.tree_map's removal.
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # tensorflow's C++ start-up banner

_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)

from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.utils import async_multifuture  # noqa: E402
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402

# (2) Restore the host's root logger; keep JetStream's own messages at WARNING.
for _h in list(_root.handlers):
    if _h not in _handlers:
        _root.removeHandler(_h)
_root.setLevel(_level)
logging.getLogger("jetstream").setLevel(logging.WARNING)

__all__ = ["async_multifuture", "engine_api", "orchestrator", "tokenizer_api", "tokenizer_pb2"]
