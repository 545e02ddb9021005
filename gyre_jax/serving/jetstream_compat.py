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

Only ``gyre_jax.serving`` may import this module (JetStream pulls in grpc and
prometheus; with (3) below, not seqio or TensorFlow).
"""
from __future__ import annotations

import logging
import os

import jax

# (1) Compatibility shim: jetstream 0.2.2 predates jax.tree_map's removal.
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map  # type: ignore[attr-defined]  # the shim adds what jax 0.10 removed

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # tensorflow's C++ start-up banner

_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)


class _NotLoaded:
    """Stands in for seqio's vocabularies in JetStream's token_utils (see ``_without_seqio``)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("gyre_jax imports JetStream without seqio: JetStream's SentencePiece vocabularies "
                           "are not available (gyre_jax tokenizes with its own tokenizers)")


def _without_seqio():
    """(3) JetStream's token_utils imports seqio only for SentencePiece vocabularies (its load_vocab and type
    hints), and seqio imports TensorFlow: ~5 s and ~1 GB per process, and a screen of TF/CUDA notices
    on a CPU machine that no log level silences. We never use that path, so during JetStream's import
    ``seqio.vocabularies`` is a stand-in; it is taken out of sys.modules right after, so anything that
    later imports seqio gets the real one. If seqio is already loaded, the real one is used."""
    import sys
    import types

    if "seqio" in sys.modules:
        return {}
    pkg, voc = types.ModuleType("seqio"), types.ModuleType("seqio.vocabularies")
    voc.Vocabulary = type("Vocabulary", (_NotLoaded,), {})
    voc.SentencePieceVocabulary = type("SentencePieceVocabulary", (_NotLoaded,), {})
    pkg.vocabularies = voc
    stubs = {"seqio": pkg, "seqio.vocabularies": voc}
    sys.modules.update(stubs)
    return stubs


def _drop(stubs) -> None:
    import sys

    for name, mod in stubs.items():
        if sys.modules.get(name) is mod:
            del sys.modules[name]


_stubs = _without_seqio()
try:
    from jetstream.core import orchestrator  # noqa: E402
    from jetstream.core.utils import async_multifuture  # noqa: E402
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402
finally:
    _drop(_stubs)

# (2) Restore the host's root logger; keep JetStream's own messages at WARNING.
for _h in list(_root.handlers):
    if _h not in _handlers:
        _root.removeHandler(_h)
_root.setLevel(_level)
logging.getLogger("jetstream").setLevel(logging.WARNING)

__all__ = ["async_multifuture", "engine_api", "orchestrator", "tokenizer_api", "tokenizer_pb2"]
