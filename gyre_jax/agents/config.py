"""HarnessConfig: every knob of a rollout's harness, validated on construction; the RL run's ``config.harness``.

What runs an episode is a harness kind (``kind``, ``gyre_jax.agents.harnesses``) with its own
options (``kind_options``: ``--config.harness.kind_options.command.command=...``); the rest are the
knobs of the rollout runner and the built-in agent. ``base_url``, ``run_id`` and ``concurrency`` are
the runner's to set (the proxy's URL, the run, a group's size), not flags.
"""
from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, ClassVar, Mapping

from gyre_jax.agents.harnesses import HARNESS_KINDS, make_harness
from gyre_jax.agents.sandbox import SandboxConfig
from gyre_jax.registry import options_field, resolve_options
from gyre_jax.schema import derived, flag_via
from gyre_jax.serving.identity import check_id


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarnessConfig:
    SECTION: ClassVar[str] = "harness"
    # What runs an episode: builtin (the example agent), python (module:function), command (a shell command
    # in the rollout's sandbox), or a kind registered in gyre_jax/agents/harnesses/.
    kind: str = "builtin"
    kind_options: Any = options_field(HARNESS_KINDS, "kind")  # --config.harness.kind_options.KIND.OPTION=v
    # Where the model is: an OpenAI-compatible base URL ending in /v1 (the proxy's; "" until the runner knows it).
    base_url: str = derived("", "the proxy's URL")
    model: str = "gyre"
    run_id: str = derived("run", "the run")
    # None: send the per-rollout key ``gyre:<run>:<rollout>``; else this key verbatim
    # (e.g. the proxy's bearer token; the X-Gyre-* headers still identify the call).
    api_key: str | None = None
    # Sampling, per call.
    max_tokens: int = 512
    temperature: float = 1.0
    # Merged into every request body (e.g. {"top_p": 0.95, "logprobs": True}).
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Send the OpenAI ``tools`` schema. Off for tiny models: a chat template would
    # spend hundreds of prompt tokens on it; they use the plain-text call format.
    send_tools_schema: bool = True
    # Overrides the task's (and the default) system prompt when set.
    system_prompt: str | None = None
    # None: gyre_jax.agents.agent's defaults. Short ones keep a byte-level model's contexts short.
    subagent_system_prompt: str | None = None
    summary_request: str | None = None  # appended as a user turn to ask for the compaction summary
    summary_header: str | None = None  # put between the task and the summary in the compacted context
    # Agent loop.
    max_turns: int = 32  # model calls per agent (a summary call is not a turn)
    # Context budget: estimated tokens of the next prompt above which the agent
    # compacts. Estimated from the server's usage field when present, else bytes. The RL run
    # reads 0 as its engines' context length (config.cells.max_len).
    context_budget_tokens: int = 32768
    bytes_per_token: float = 4.0  # 1.0 for byte-level tokenizers
    max_compactions: int = 8  # per agent; a guard against summaries that never fit
    max_subagents: int = 4  # per rollout
    max_subagent_depth: int = 1  # sub-agents of sub-agents need depth >= 2
    # Tools.
    command_timeout_s: float = 30.0  # upper bound for the `run` tool
    max_tool_output_bytes: int = 4096
    # Deadlines and retries.
    deadline_s: float = 600.0  # per rollout, from its start (not its queueing)
    # A task's own deadline (its ``timeout_s``) times this; deadline_s applies to a task without one. A held-out
    # eval beside a busy run, or a slow host, stretches both.
    deadline_scale: float = 1.0
    request_timeout_s: float = 300.0  # per HTTP attempt
    max_retries: int = 3  # per call, on 5xx / 429 / connection errors / timeouts
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    # Concurrency and grading.
    concurrency: int = derived(8, "scheduler.group_size")  # rollouts in flight
    grader_timeout_s: float = 60.0
    grader_concurrency: int = 0  # grader subprocesses at once; 0 = os.cpu_count()
    # Host paths every graded command sees read-only, besides the run's Python (gyre_jax.agents.grader_sandbox).
    grader_ro_paths: tuple[str, ...] = derived((), "task.grader_ro_paths")
    # Where the policy's commands run (gyre_jax.agents.sandbox; the flag is its kind): auto = bubblewrap where
    # it works; where it cannot and the harness runs commands, the run refuses to start (fail closed) unless
    # none is chosen explicitly; bubblewrap, docker, podman, none.
    sandbox: Any = flag_via("sandbox.kind", SandboxConfig())

    def __post_init__(self):
        resolve_options(self)
        if isinstance(self.sandbox, str):
            object.__setattr__(self, "sandbox", SandboxConfig(kind=self.sandbox))
        for name in ("system_prompt", "subagent_system_prompt", "summary_request", "summary_header"):
            if getattr(self, name) == "":  # "" on the command line: the default
                object.__setattr__(self, name, None)
        if not isinstance(self.base_url, str) or (self.base_url and not self.base_url.startswith(("http://",
                                                                                                "https://"))):
            raise ValueError(f"HarnessConfig.base_url must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        check_id(self.run_id, "HarnessConfig.run_id")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError(f"HarnessConfig.extra_body must be a mapping, got {type(self.extra_body).__name__}")
        reserved = {"model", "messages", "tools", "max_tokens", "temperature"} & set(self.extra_body)
        if reserved:
            raise ValueError(f"HarnessConfig.extra_body may not set {sorted(reserved)}; use the fields")
        object.__setattr__(self, "extra_body", types.MappingProxyType(dict(self.extra_body)))
        object.__setattr__(self, "grader_ro_paths", tuple(self.grader_ro_paths))
        for p in self.grader_ro_paths:
            if not isinstance(p, str) or not os.path.isabs(p):
                raise ValueError(f"HarnessConfig.grader_ro_paths: {p!r} is not an absolute path")
        if not isinstance(self.sandbox, SandboxConfig):
            raise ValueError(f"HarnessConfig.sandbox must be a SandboxConfig, got {type(self.sandbox).__name__}")
        positive = ("max_tokens", "max_turns", "bytes_per_token", "command_timeout_s",
                    "max_tool_output_bytes", "deadline_s", "request_timeout_s", "backoff_max_s", "concurrency",
                    "grader_timeout_s", "deadline_scale")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"HarnessConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_compactions", "max_subagents", "max_subagent_depth", "max_retries", "backoff_base_s",
                     "temperature", "grader_concurrency", "context_budget_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"HarnessConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def grader_slots(self) -> int:
        return self.grader_concurrency or os.cpu_count() or 1

    def make(self, unix_socket: str | None = None):
        """The harness of ``kind`` with its options; ``unix_socket``: the proxy's, for one that runs sandboxed."""
        return make_harness(self.kind, self.kind_options, unix_socket=unix_socket)
