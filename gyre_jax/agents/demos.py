"""Scripted demonstrations for a supervised warm start before RL.

``demonstration(task)`` replays the family's ideal actions (``solution_turns``, or a
family's ``scripted_reply`` that reacts to the context) through the real agent loop and
real tools in a scratch workspace, so every call is exactly what the harness would send
for that task (same system prompt, same tool-result text, the same compaction and
sub-agent contexts). Train on every call's reply (``Demonstration.calls``). Pass
the HarnessConfig the rollouts use (its ``system_prompt`` and ``max_tool_output_bytes``
shape the transcript).
"""
from __future__ import annotations

import asyncio
import dataclasses
import tempfile

from gyre_jax.agents import tools
from gyre_jax.agents.agent import DEFAULT_SYSTEM_PROMPT, Agent, RolloutContext, summary_header, tool_call_message
from gyre_jax.agents.client import ChatReply
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graders import grade_in_process
from gyre_jax.agents.tasks import family, solution_turns, test_suite
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving.identity import HEADER_ROLE
from gyre_jax.trajectory.vocab import ROLE_MAIN

# Only the prompt / tool knobs matter here; the URL is never contacted.
_DEMO_CONFIG = HarnessConfig(base_url="http://demo.invalid/v1")


@dataclasses.dataclass(frozen=True)
class DemoCall:
    """One model call of a demonstration, as the proxy would record it."""
    messages: list[dict]  # what the harness sent
    tools: list[dict] | None  # the `tools` field it sent (None if not sent)
    reply: dict  # the scripted assistant message
    role: str  # main | subagent | summary


@dataclasses.dataclass(frozen=True)
class Demonstration:
    task_id: str
    messages: list[dict]  # the main agent's context when it ended (after any compaction)
    tools: list[dict] | None  # the `tools` field the harness sent with the first call (None if not sent)
    score: float | None  # the grader's score of the resulting workspace (None: not verified)
    calls: tuple[DemoCall, ...] = ()  # every model call, summary and sub-agent calls included, in order


def _script(task: Task, config: HarnessConfig, text_format: bool):
    """(messages, role) -> the scripted assistant message. A family with ``scripted_reply``
    reacts to the context (compaction, sub-agents); otherwise its ``solution_turns`` are
    replayed in order to the main agent."""
    fam = family(task.family)
    react = getattr(fam, "scripted_reply", None)
    turns = None if react is not None else solution_turns(task)

    def reply(messages: list[dict], role: str, k: int) -> dict:
        if react is not None:
            out = react(task, messages, role, summary_header(config))
            if isinstance(out, str):
                return {"role": "assistant", "content": out}
            return tool_call_message(out, text_format=text_format, id_prefix=f"call{k}")
        turn = sum(m["role"] == "assistant" for m in messages)
        assert turns is not None  # set whenever the family has no scripted_reply (above)
        if role != ROLE_MAIN or turn >= len(turns):
            raise RuntimeError(f"demonstration of {task.task_id}: the agent asked for {role} turn {turn} but the "
                               f"script has {len(turns)} main turns")
        return tool_call_message(turns[turn], text_format=text_format, id_prefix=f"call{turn}")

    return reply


async def ademonstration(task: Task, config: HarnessConfig | None = None, *, text_format: bool = True,
                         verify: bool = False) -> Demonstration:
    config = config or _DEMO_CONFIG
    script = _script(task, config, text_format)
    calls: list[DemoCall] = []

    async def scripted(messages, headers, tool_schemas):
        role = headers[HEADER_ROLE]
        message = script(messages, role, len(calls))
        calls.append(DemoCall(list(messages), tool_schemas, message, role))
        return ChatReply(message, "stop", None, 0)

    with tempfile.TemporaryDirectory(prefix="gyre_demo_") as tmp:
        ws = tools.Workspace(tmp, sandbox=None, max_output_bytes=config.max_tool_output_bytes,
                             command_timeout_s=config.command_timeout_s, test_suite=test_suite(task),
                             test_wait=False)  # the suite's result text, not its 1-30 s, shapes the transcript
        for rel, content in task.setup_files.items():
            ws.write_file(rel, content)
        ctx = RolloutContext(config=config, task=task, rollout_id="demo", group_id="demo", workspace=ws,
                             transport=scripted)
        agent = Agent(ctx, role=ROLE_MAIN, user_prompt=task.prompt,
                      system_prompt=config.system_prompt or task.system_prompt or DEFAULT_SYSTEM_PROMPT)
        outcome = await agent.run()
        if outcome.finish_reason != "finish" or ctx.stats.tool_errors:
            raise RuntimeError(f"demonstration of {task.task_id} did not run cleanly: ended by "
                               f"{outcome.finish_reason}, {ctx.stats.tool_errors} tool errors")
        score = grade_in_process(task, tmp).score if verify else None
    return Demonstration(task.task_id, outcome.messages, calls[0].tools, score, tuple(calls))


def demonstration(task: Task, config: HarnessConfig | None = None, *, text_format: bool = True,
                  verify: bool = False) -> Demonstration:
    """Sync wrapper of :func:`ademonstration` (not from inside a running event loop)."""
    return asyncio.run(ademonstration(task, config, text_format=text_format, verify=verify))
