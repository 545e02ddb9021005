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

Adding a harness kind: a class with ``kind``, ``needs_commands(task)`` and ``async run(episode) ->
HarnessResult`` built as ``Class(options, unix_socket=...)``, its options a frozen dataclass beside it,
and ``@HARNESS_KINDS.register(kind, config=Options, summary=...)`` on the class, in a module of this
package (``--config.harness.kind=NAME``, its options ``--config.harness.kind_options.NAME.OPTION=v``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Protocol

from gyre_jax.agents.tasks.base import Task
from gyre_jax.registry import Registry


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


# Kinds register themselves beside their class (``@HARNESS_KINDS.register("command", config=CommandOptions,
# ...)``); a kind not yet registered is looked for in this package's modules (gyre_jax.registry).
HARNESS_KINDS = Registry("harness kind", "harness.kind", package=__name__)


def make_harness(kind: str, options: Any = None, *, unix_socket: str | None = None, **values) -> Harness:
    """The harness of ``kind`` built from its options (``options``, an instance of the kind's options class,
    or its fields as keywords: ``make_harness("command", command="...")``); ``unix_socket``: the proxy's, for
    a harness that runs in the rollout's sandbox. An option the kind does not take is a ValueError naming them."""
    entry = HARNESS_KINDS.get(kind)
    if options is None:
        options = entry.make_config(values, where="harness: ")
    elif values:
        raise TypeError("make_harness: give the options as an instance or as keywords, not both")
    else:
        entry.check_config(options, "harness: ")
    return entry.obj(options, unix_socket=unix_socket)


BUILTIN_ENTRY = "gyre_jax.agents.agent:run_episode"


@HARNESS_KINDS.register("builtin", summary="the example agent (gyre_jax.agents.agent:run_episode) in-process")
def _builtin(options, *, unix_socket: str | None = None) -> Harness:
    python = HARNESS_KINDS.get("python")  # python_entry.py registers it (this package's modules import this one)
    return python.obj(python.make_config({"entry": BUILTIN_ENTRY}), unix_socket=unix_socket)
