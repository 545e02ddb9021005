"""Harnesses: what runs an agent on one task, behind one small interface, registered by name.

The rollout runner (``gyre_jax.agents.harness.run_rollout``) prepares the workspace and its
sandbox, issues the rollout's API key, calls ``await harness.run(episode)`` under the
rollout's deadline, then snapshots and grades the workspace. A harness only has to reach
the model as this rollout (``episode.client``: base URLs and the per-rollout key; the proxy
records every call under it) and act on ``episode.workspace``. Three kinds are registered:

  python   ``module:function``, called as ``await function(task, client)``: ``task`` an
           :class:`EpisodeTask` (id, instruction, metadata, the workspace path and its
           sandboxed tools), ``client`` a :class:`ClientConfig` (base URLs and the key for the
           OpenAI and Anthropic SDKs). It may return a dict of counters (calls, retries,
           compactions, ...), kept with the outcome. It runs in the trainer's process: it is
           the user's own (trusted) code; the commands it runs through ``task.tools`` are the
           policy's actions and run in the rollout's sandbox.
  builtin  the example agent (``gyre_jax.agents.agent:run_episode``) as a ``python`` harness.
  command  a shell command per rollout, run INSIDE the rollout's sandbox with the workspace
           as its working directory (its own commands are the policy's actions), reaching
           only the proxy (``gyre_jax.agents.harnesses.command``).

How a run ends is the runner's to record: the harness returning is a completed episode
(graded); the deadline is a timeout (graded for partial credit); ``InfraError`` (the model
could not answer) is ``infra_error``; :class:`HarnessFailed` (a command that exited non-zero,
crashed or could not start) or any other exception is ``infra_error`` when the policy had no
say in it (no model call was recorded, or the model server failed one of the rollout's
calls), else a score of 0 with its reason (``gyre_jax.agents.harness`` says why).

Adding a harness: a class with ``kind`` and ``async run(episode) -> HarnessResult``, then
``register_harness``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Protocol

from gyre_jax.agents.tasks.base import Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How a harness reaches the model as its rollout (what the SDKs' constructors take)."""

    openai_base_url: str  # ends in /v1 (OpenAI SDK: base_url; OPENAI_BASE_URL)
    anthropic_base_url: str  # no /v1 (Anthropic SDK: base_url; ANTHROPIC_BASE_URL)
    api_key: str  # the rollout's key: the proxy records calls made with it under this rollout
    model: str = "gyre"
    # X-Gyre-* identity headers (run, rollout, task, group); optional: the key alone ties calls.
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # config.harness.options
    session: Any = None  # a shared aiohttp.ClientSession, if the runner has one
    harness_config: Any = None  # the runner's HarnessConfig (the built-in agent reads its knobs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeTask:
    """The task as a harness sees it (never the grader's parameters: no expected answers)."""

    task_id: str
    instruction: str
    system_prompt: str | None
    metadata: Mapping[str, Any]
    rollout_id: str
    group_id: str
    run_id: str
    workspace_path: str  # on the host; the sandbox sees it at /workspace
    tools: Any  # gyre_jax.agents.tools.Workspace: write_file / read_file / list_files / run (sandboxed)
    spec: Task  # the whole task (the built-in agent needs its tool list and system prompt)
    # Counters a harness keeps as it goes (calls, retries, ...): read also when the deadline cuts it off.
    counters: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Episode:
    task: EpisodeTask
    client: ClientConfig
    deadline_s: float


@dataclasses.dataclass
class HarnessResult:
    """What a harness reports when it ended by itself (the runner adds grading)."""

    finish_reason: str  # e.g. "finish", "no_tool_call", "max_turns", "exit 0"
    counters: dict = dataclasses.field(default_factory=dict)  # calls, retries, compactions, subagents, ...
    output: str = ""  # bounded (command harness: head and tail of its stdout/stderr)
    exit_code: int | None = None


class HarnessFailed(Exception):
    """The harness did not run the episode to its end (crash, non-zero exit, could not start).
    The runner decides what that is (``gyre_jax.agents.harness``): ``infra_error`` when the policy
    had no say (no model call was made) or the model server failed the rollout, else a score of 0
    (the policy's commands share the harness's sandbox and can end it). ``why``: the short reason,
    the same for every rollout that failed the same way (the message adds the output's tail)."""

    def __init__(self, reason: str, *, output: str = "", exit_code: int | None = None, why: str | None = None):
        super().__init__(reason)
        self.output, self.exit_code = output, exit_code
        self.why = why or reason


class Harness(Protocol):
    kind: ClassVar[str]

    def needs_commands(self, task: Task) -> bool:
        """Whether the rollout's sandbox must run commands (the harness itself, or a `run` tool)."""

    async def run(self, episode: Episode) -> HarnessResult: ...


HARNESSES: dict[str, Callable[..., Harness]] = {}


def register_harness(kind: str, factory: Callable[..., Harness]) -> None:
    """Make ``kind`` available to ``make_harness`` (``--config.harness.kind``). The factory is called with
    every kind's options (entry=, command=, env=, ro_paths=, nonzero_exit=, output_bytes=, cpu_s=,
    memory_bytes=, unix_socket=; rl.config.HarnessKnobs.make): take the ones it uses and ``**_``."""
    _register_builtins()  # first: a kind registered before any make_harness must not hide the built-in ones
    if kind in HARNESSES:
        raise ValueError(f"harness kind {kind!r} is already registered")
    HARNESSES[kind] = factory


def make_harness(kind: str, **kwargs) -> Harness:
    """The harness of ``kind`` (``python``: entry=; ``command``: command=, ...)."""
    _register_builtins()
    try:
        factory = HARNESSES[kind]
    except KeyError:
        raise LookupError(f"unknown harness kind {kind!r}; known: {sorted(HARNESSES)}") from None
    return factory(**kwargs)


BUILTIN_ENTRY = "gyre_jax.agents.agent:run_episode"


def _builtin(*, entry: str = "", **kw) -> Harness:
    from gyre_jax.agents.harnesses.python_entry import PythonHarness

    if entry and entry != BUILTIN_ENTRY:
        raise ValueError(f"harness.entry={entry!r} is for harness.kind='python'; kind='builtin' runs {BUILTIN_ENTRY}")
    return PythonHarness(entry=BUILTIN_ENTRY, **kw)


_builtins_registered = False


def _register_builtins() -> None:
    global _builtins_registered
    if _builtins_registered:
        return
    _builtins_registered = True
    from gyre_jax.agents.harnesses.command import CommandHarness
    from gyre_jax.agents.harnesses.python_entry import PythonHarness

    register_harness(PythonHarness.kind, PythonHarness)
    register_harness("builtin", _builtin)
    register_harness(CommandHarness.kind, CommandHarness)
