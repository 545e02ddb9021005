"""The agent loop: model call -> tool calls -> results, with compaction and sub-agents.

One :class:`Agent` owns one context (a list of OpenAI chat messages). It ends when the
model calls ``finish``, answers without any tool call, or reaches ``max_turns``.

Compaction: before each call the agent estimates the next prompt's tokens: the last
reply's ``usage.prompt_tokens + usage.completion_tokens`` plus the bytes appended
since divided by ``bytes_per_token``; without a usage field, all message bytes divided
by ``bytes_per_token``. Above ``context_budget_tokens`` it makes a summary call (role
``summary``, same agent id, no tools): the current context plus :data:`SUMMARY_REQUEST`.
The new context is ``[system prompt, user: <the agent's task> + SUMMARY_HEADER +
<summary>]``, so the agent keeps its task and nothing else.

Sub-agents: the ``spawn_subagent`` tool starts an Agent with a fresh context (its own
system prompt, the given task as its user message), the next agent id of the rollout,
role ``subagent`` and the caller as parent; it shares the workspace and the rollout's
deadline, and its final report is the tool result.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Awaitable, Callable

from gyre_jax.agents import tools
from gyre_jax.agents.client import ChatReply, InfraError
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving import identity
from gyre_jax.trajectory.vocab import ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUMMARY

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a workspace directory. Act only through tools: "
    "write_file, read_file, list_files, run (a shell command), spawn_subagent (delegate a "
    "sub-task), finish. If you cannot make structured tool calls, write each call as "
    '<tool>NAME {"arg": "value"}</tool>. Call finish when the task is done.'
)
SUBAGENT_SYSTEM_PROMPT = (
    "You are a sub-agent working in a shared workspace directory on one sub-task. Act only "
    "through tools (or <tool>NAME {json args}</tool> lines). Call finish with a short report."
)
SUMMARY_REQUEST = (
    "Your context is full. Summarize the task, what you have done so far (files written, "
    "commands run, results) and what remains, so you can continue from the summary alone."
)
SUMMARY_HEADER = "\n\nSummary of your earlier work (your context was compacted):\n"

# (messages, headers, tools or None) -> reply. The HTTP client is the real one; demos
# use a scripted function to replay an ideal transcript through this same loop.
Transport = Callable[[list[dict], dict[str, str], "list[dict] | None"], Awaitable[ChatReply]]


def summary_header(config: HarnessConfig) -> str:
    return SUMMARY_HEADER if config.summary_header is None else config.summary_header


@dataclasses.dataclass
class RolloutStats:
    calls: int = 0  # successful model calls, summary and sub-agent calls included
    retries: int = 0  # failed attempts that were retried (or gave up)
    compactions: int = 0
    subagents: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # malformed, unknown or failing calls answered with "error: ..."
    ignored_tool_calls: int = 0  # calls after `finish` in the same reply (not executed)


class RolloutContext:
    """What every agent of one rollout shares: ids, workspace, transport, counters."""

    def __init__(self, *, config: HarnessConfig, task: Task, rollout_id: str, group_id: str,
                 workspace: tools.Workspace, transport: Transport, api_key: str | None = None):
        self.config, self.task, self.workspace, self.transport = config, task, workspace, transport
        self.rollout_id = identity.check_id(rollout_id, "rollout id")
        self.group_id = identity.check_id(group_id, "group id")
        self.stats = RolloutStats()
        self._next_agent_id = 0
        self._next_call = 0
        key = (api_key if api_key is not None else config.api_key if config.api_key is not None
               else identity.api_key(config.run_id, rollout_id))
        self._auth = {"Authorization": f"Bearer {key}"}

    def new_agent_id(self) -> int:
        aid, self._next_agent_id = self._next_agent_id, self._next_agent_id + 1
        return aid

    async def call_model(self, messages: list[dict], *, agent_id: int, parent_id: int | None, role: str,
                         tool_schemas: list[dict] | None) -> ChatReply:
        index, self._next_call = self._next_call, self._next_call + 1
        headers = identity.call_headers(
            run_id=self.config.run_id, rollout_id=self.rollout_id, task_id=self.task.task_id,
            group_id=self.group_id, agent_id=agent_id, parent_agent_id=parent_id, role=role,
            call_index=index, attempt=0)
        headers.update(self._auth)
        try:
            reply = await self.transport(list(messages), headers, tool_schemas)
        except InfraError as e:
            self.stats.retries += e.retries
            raise
        self.stats.calls += 1
        self.stats.retries += reply.retries
        return reply


@dataclasses.dataclass
class AgentOutcome:
    agent_id: int
    finish_reason: str  # "finish" | "no_tool_call" | "max_turns"
    final_text: str
    messages: list[dict]  # the agent's context when it ended, last reply included
    turns: int


def _message_bytes(m: dict) -> int:
    n = len((m.get("content") or "").encode())
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") or {}
        n += len(str(fn.get("name", ""))) + len(str(fn.get("arguments", "")))
    return n


class Agent:
    def __init__(self, ctx: RolloutContext, *, role: str, system_prompt: str, user_prompt: str,
                 parent_id: int | None = None, depth: int = 0):
        self.ctx, self.role, self.parent_id, self.depth = ctx, role, parent_id, depth
        self.agent_id = ctx.new_agent_id()
        self.system_prompt, self.user_prompt = system_prompt, user_prompt
        cfg = ctx.config
        allowed = [n for n in ctx.task.tools
                   if n != tools.SPAWN_SUBAGENT or (depth < cfg.max_subagent_depth and cfg.max_subagents > 0)]
        self.tool_names = tuple(allowed)
        self.tool_schemas = tools.openai_tools(allowed) if cfg.send_tools_schema else None
        self.messages = self._fresh_context("")
        self._usage_tokens: int | None = None
        self._bytes_since_usage = 0
        self.compactions = 0

    def _fresh_context(self, summary: str) -> list[dict]:
        user = self.user_prompt + (summary_header(self.ctx.config) + summary if summary else "")
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]

    def estimated_tokens(self) -> float:
        bpt = self.ctx.config.bytes_per_token
        if self._usage_tokens is not None:
            return self._usage_tokens + self._bytes_since_usage / bpt
        return sum(_message_bytes(m) for m in self.messages) / bpt

    def _append(self, message: dict) -> None:
        self.messages.append(message)
        self._bytes_since_usage += _message_bytes(message)

    def _note_usage(self, reply: ChatReply) -> None:
        u = reply.usage or {}
        p, c = u.get("prompt_tokens"), u.get("completion_tokens")
        if isinstance(p, int) and isinstance(c, int):
            self._usage_tokens, self._bytes_since_usage = p + c, 0
        else:
            self._usage_tokens = None

    async def _call(self, messages: list[dict], role: str, tool_schemas) -> ChatReply:
        return await self.ctx.call_model(messages, agent_id=self.agent_id, parent_id=self.parent_id,
                                         role=role, tool_schemas=tool_schemas)

    async def compact(self) -> None:
        request = self.ctx.config.summary_request or SUMMARY_REQUEST
        reply = await self._call(self.messages + [{"role": "user", "content": request}], ROLE_SUMMARY, None)
        summary = reply.message.get("content") or "(the summary call returned no text)"
        self.messages = self._fresh_context(summary)
        self._usage_tokens, self._bytes_since_usage = None, 0
        self.compactions += 1
        self.ctx.stats.compactions += 1

    async def run(self) -> AgentOutcome:
        cfg = self.ctx.config
        for turn in range(cfg.max_turns):
            if (len(self.messages) > 2 and self.compactions < cfg.max_compactions
                    and self.estimated_tokens() > cfg.context_budget_tokens):
                await self.compact()
            reply = await self._call(self.messages, self.role, self.tool_schemas)
            self.messages.append(reply.message)
            self._note_usage(reply)
            structured = bool(reply.message.get("tool_calls"))
            calls = (tools.parse_openai_tool_calls(reply.message) if structured
                     else tools.parse_text_tool_calls(reply.message["content"]))
            if not calls:
                return AgentOutcome(self.agent_id, "no_tool_call", reply.message["content"], self.messages, turn + 1)
            results: list[tuple[tools.ToolCall, str]] = []
            for k, call in enumerate(calls):
                self.ctx.stats.tool_calls += 1
                if call.error is None and call.name == tools.FINISH and call.name in self.tool_names:
                    try:
                        args = tools.check_args(call.name, call.arguments)
                    except tools.ToolError as e:
                        results.append((call, self._tool_error(e)))
                        continue
                    self.ctx.stats.ignored_tool_calls += len(calls) - k - 1
                    return AgentOutcome(self.agent_id, "finish", args.get("message", ""), self.messages, turn + 1)
                results.append((call, await self._execute(call)))
            self._append_results(results, structured)
        return AgentOutcome(self.agent_id, "max_turns", self.messages[-1].get("content") or "", self.messages,
                            cfg.max_turns)

    def _tool_error(self, e: Exception | str) -> str:
        self.ctx.stats.tool_errors += 1
        return f"error: {e}"

    async def _execute(self, call: tools.ToolCall) -> str:
        try:
            if call.error is not None:
                raise tools.ToolError(call.error)
            if call.name not in self.tool_names:
                raise tools.ToolError(f"tool {call.name!r} is not available here; available: "
                                      f"{', '.join(self.tool_names)}")
            if call.name == tools.SPAWN_SUBAGENT:
                return await self._spawn(tools.check_args(call.name, call.arguments)["task"])
            return await self.ctx.workspace.call(call.name, call.arguments or {})
        except tools.ToolError as e:
            return self._tool_error(e)
        except OSError as e:  # e.g. a file the agent made unreadable: the agent's problem, not infra
            return self._tool_error(f"{call.name}: {type(e).__name__}: {e}")

    async def _spawn(self, task_text: str) -> str:
        cfg = self.ctx.config
        if self.ctx.stats.subagents >= cfg.max_subagents:
            raise tools.ToolError(f"spawn_subagent: the limit of {cfg.max_subagents} sub-agents per rollout "
                                  "is reached")
        self.ctx.stats.subagents += 1
        sub = Agent(self.ctx, role=ROLE_SUBAGENT, system_prompt=cfg.subagent_system_prompt or SUBAGENT_SYSTEM_PROMPT,
                    user_prompt=task_text, parent_id=self.agent_id, depth=self.depth + 1)
        out = await sub.run()
        report = f"sub-agent {sub.agent_id} ended ({out.finish_reason}): {out.final_text}"
        return tools.truncate_tail(report, cfg.max_tool_output_bytes)

    def _append_results(self, results: list[tuple[tools.ToolCall, str]], structured: bool) -> None:
        if structured:
            for call, text in results:
                self._append({"role": "tool", "tool_call_id": call.call_id or "", "content": text})
        else:
            self._append({"role": "user", "content": tools.render_text_results([t for _, t in results])})


async def run_episode(task, client) -> dict:
    """The example agent as a harness (``gyre_jax.agents.harnesses``: kind ``builtin``): the main
    agent on ``task.instruction`` with the task's tools, over HTTP with retries as the rollout's
    key; returns its counters and how it ended. Its knobs are the runner's ``HarnessConfig``."""
    import aiohttp

    from gyre_jax.agents.client import ChatClient

    cfg: HarnessConfig = client.harness_config
    if cfg is None:
        raise ValueError("the built-in harness needs client.harness_config (the runner's HarnessConfig)")
    if client.openai_base_url.rstrip("/") != cfg.base_url:
        import dataclasses as _dc

        cfg = _dc.replace(cfg, base_url=client.openai_base_url)
    session = client.session
    own = session is None
    if own:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        chat = ChatClient(session, cfg)

        async def transport(messages, headers, tool_schemas):
            return await chat.chat(messages, headers=headers, tools=tool_schemas)

        spec = task.spec
        ctx = RolloutContext(config=cfg, task=spec, rollout_id=task.rollout_id, group_id=task.group_id,
                             workspace=task.tools, transport=transport, api_key=client.api_key)
        system = cfg.system_prompt or spec.system_prompt or DEFAULT_SYSTEM_PROMPT
        try:
            outcome = await Agent(ctx, role=ROLE_MAIN, user_prompt=spec.prompt, system_prompt=system).run()
        finally:
            task.counters.update(dataclasses.asdict(ctx.stats))  # also when cut off by the deadline
        return {"finish_reason": outcome.finish_reason, **dataclasses.asdict(ctx.stats)}
    finally:
        if own:
            await session.close()


def _needs_commands(task: Task) -> bool:
    return tools.RUN in task.tools or tools.RUN_TESTS in task.tools


run_episode.needs_commands = _needs_commands  # type: ignore[attr-defined]  # the function is the builtin harness (harnesses.Harness's needs_commands)


def tool_call_message(calls: list[tuple[str, dict]], *, text_format: bool, id_prefix: str = "call") -> dict:
    """An assistant message making ``calls``, in either format (for scripted replies)."""
    if text_format:
        return {"role": "assistant", "content": "\n".join(tools.render_text_tool_call(n, a) for n, a in calls)}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"{id_prefix}_{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for k, (n, a) in enumerate(calls)]}
