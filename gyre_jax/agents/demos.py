"""Scripted demonstrations for a supervised warm start before RL.

``demonstration(task)`` replays the family's ideal actions (``solution_turns``) through
the real agent loop and real tools in a scratch workspace, so the transcript is exactly
the context the harness would build for that task (same system prompt, same tool-result
text), ending with the last assistant message. Train on its assistant messages. Pass
the HarnessConfig the rollouts use (its ``system_prompt`` and ``max_tool_output_bytes``
shape the transcript).
"""
from __future__ import annotations

import asyncio
import dataclasses
import tempfile

from gyre_jax.agents import tools
from gyre_jax.agents.agent import DEFAULT_SYSTEM_PROMPT, Agent, RolloutContext, tool_call_message
from gyre_jax.agents.client import ChatReply
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graders import grade_in_process
from gyre_jax.trajectory.vocab import ROLE_MAIN
from gyre_jax.agents.tasks import solution_turns, test_suite
from gyre_jax.agents.tasks.base import Task

# Only the prompt / tool knobs matter here; the URL is never contacted.
_DEMO_CONFIG = HarnessConfig(base_url="http://demo.invalid/v1")


@dataclasses.dataclass(frozen=True)
class Demonstration:
    task_id: str
    messages: list[dict]  # system, user, then assistant / tool-result turns; ends with assistant
    tools: list[dict] | None  # the `tools` field the harness sends with it (None if not sent)
    score: float | None  # the grader's score of the resulting workspace (None: not verified)


async def ademonstration(task: Task, config: HarnessConfig | None = None, *, text_format: bool = True,
                         verify: bool = False) -> Demonstration:
    config = config or _DEMO_CONFIG
    replies = [tool_call_message(turn, text_format=text_format, id_prefix=f"call{k}")
               for k, turn in enumerate(solution_turns(task))]
    sent_tools = []

    async def scripted(messages, headers, tool_schemas):
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn >= len(replies):
            raise RuntimeError(f"demonstration of {task.task_id}: the agent asked for turn {turn} but the "
                               f"script has {len(replies)}")
        sent_tools.append(tool_schemas)
        return ChatReply(replies[turn], "stop", None, 0)

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
    return Demonstration(task.task_id, outcome.messages, sent_tools[0], score)


def demonstration(task: Task, config: HarnessConfig | None = None, *, text_format: bool = True,
                  verify: bool = False) -> Demonstration:
    """Sync wrapper of :func:`ademonstration` (not from inside a running event loop)."""
    return asyncio.run(ademonstration(task, config, text_format=text_format, verify=verify))
