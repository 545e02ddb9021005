"""A harness written in Python: ``module:function``, ``await function(task, client)``.

The function gets an :class:`~gyre_jax.agents.harnesses.EpisodeTask` and a
:class:`~gyre_jax.agents.harnesses.ClientConfig` and returns None or a dict of counters.
A minimal one with the OpenAI SDK::

    async def solve(task, client):
        from openai import AsyncOpenAI
        llm = AsyncOpenAI(base_url=client.openai_base_url, api_key=client.api_key)
        reply = await llm.chat.completions.create(model=client.model, messages=[
            {"role": "user", "content": task.instruction}])
        task.tools.write_file("answer.txt", reply.choices[0].message.content or "")

The function may declare ``solve.needs_commands = lambda task: False`` when it never runs a
command (the sandbox then sets up no uid or workspace tmpfs); the default is True.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import ClassVar

from gyre_jax.agents.harnesses import HARNESS_KINDS, Episode, HarnessResult
from gyre_jax.agents.tasks.base import Task

_ENTRY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def load_entry(entry: str):
    """The async function ``module:function`` names; ValueError/LookupError naming the problem."""
    if not isinstance(entry, str) or not _ENTRY_RE.fullmatch(entry):
        raise ValueError(f"harness entry must be 'module:function', got {entry!r}")
    module, _, name = entry.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise LookupError(f"harness entry {entry!r}: cannot import {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise LookupError(f"harness entry {entry!r}: {module} has no attribute {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"harness entry {entry!r} must be an async function (async def {name}(task, client))")
    return fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonOptions:
    """``--config.harness.kind_options.python.*``."""

    entry: str = ""  # "module:function", called as `await function(task, client)`


@HARNESS_KINDS.register("python", config=PythonOptions,
                        summary="an async Python function `module:function(task, client)` in the trainer's process")
class PythonHarness:
    kind: ClassVar[str] = "python"

    def __init__(self, options: PythonOptions, *, unix_socket: str | None = None):
        self.entry = options.entry
        self.fn = load_entry(options.entry)

    def needs_commands(self, task: Task) -> bool:
        fn = getattr(self.fn, "needs_commands", None)
        return bool(fn(task)) if callable(fn) else True

    async def run(self, episode: Episode) -> HarnessResult:
        out = await self.fn(episode.task, episode.client)
        if out is not None and not isinstance(out, dict):
            raise TypeError(f"harness {self.entry} returned {type(out).__name__}; want None or a dict of counters")
        counters = dict(out or {})
        return HarnessResult(finish_reason=str(counters.pop("finish_reason", "returned")), counters=counters)
