"""Small Python harnesses for tests (``--config.harness.kind=python --config.harness.kind_options.python.entry=...``).

Real harnesses in the sense that matters: they reach the model only through the proxy, as
their rollout (the key in ``client``), with an official SDK, and act on the workspace
through its sandboxed tools. They are not agents: they make one call and write what came
back, so a test knows exactly what the workspace holds.
"""
from __future__ import annotations


async def answer_once(task, client) -> dict:
    """One chat call with the instruction (OpenAI SDK); the reply's text goes to answer.txt."""
    from openai import AsyncOpenAI

    llm = AsyncOpenAI(base_url=client.openai_base_url, api_key=client.api_key, max_retries=0)
    try:
        reply = await llm.chat.completions.create(
            model=client.model, max_tokens=16, messages=[{"role": "user", "content": task.instruction}])
    finally:
        await llm.close()
    task.tools.write_file("answer.txt", reply.choices[0].message.content or "")
    return {"calls": 1, "finish_reason": "answered"}


answer_once.needs_commands = lambda task: False  # type: ignore[attr-defined]  # a function harness carries Harness.needs_commands


async def crash(task, client) -> None:
    raise RuntimeError("scripted harness crash")


crash.needs_commands = lambda task: False  # type: ignore[attr-defined]  # a function harness carries Harness.needs_commands
