"""A multi-call agent family a tiny byte-level model learns on CPU: read, write, test, finish.

The task "reverse in.txt" asks for ``answer.txt`` holding the reverse of the string in the
workspace's ``in.txt``. The prompt does not contain the string, so the agent must read it
first; it should then write the answer and run the task's test suite (1-30 s of wall time
in the rollout's sandbox, see ``gyre_jax.agents.test_suite``), or delegate the test run to
a sub-agent, and finish. A typical good episode is three to five model calls::

    main:  <tool>read_file {"path": "in.txt"}</tool>                       -> abc
    main:  <tool>write_file {..., "content": "cba"}</tool><tool>run_tests</tool>
           (the context passes the harness's budget here: a summary call compacts it)
    main:  <tool>finish</tool>

Reward: the 'tiny' family's partial credit (characters right at the same position), halved
when no valid test receipt covers the final answer (``tiny_tests``'s rule): an untested
answer earns at most 0.5.

Why this family exists: on 'tiny' and 'tiny_tests' an episode is one model call, so the
trees the trajectory processor rebuilds never branch in a real run. Here contexts outgrow
a small ``context_budget_tokens`` exactly when the agent tested its answer, so compaction
(and, on the delegated path, a sub-agent) happens in real rollouts and their trees carry
the learning signal. And the warm start is imperfect by construction, at a decision rather
than at every character: :func:`scripted_reply`, the demonstration the supervised warm
start imitates, runs the tests (itself or through a sub-agent) in only
``demo_test_fraction`` of the demonstrations (by a hash of the task id) and otherwise
finishes untested, as a model that knows the tools but skips verification does. The
warm-started policy therefore tests about that often, and RL has to discover that testing
pays (0.5 -> 1.0 of the score for a right answer).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from gyre_jax.agents import test_suite as ts
from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tasks import FAMILIES, family_options, tiny, tiny_tests
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tool_schemas import FINISH, RUN_TESTS, SPAWN_SUBAGENT
from gyre_jax.trajectory.vocab import ROLE_SUBAGENT, ROLE_SUMMARY

FAMILY = "tiny_agent"
ANSWER_FILE = tiny.ANSWER_FILE
INPUT_FILE = "in.txt"
READ_FILE, WRITE_FILE = "read_file", "write_file"
SYSTEM_PROMPT = ('Tools: read_file, write_file, run_tests, spawn_subagent, finish. Call: <tool>NAME {"path": "in.txt"}'
                 '</tool>. Answer in answer.txt, test it, finish.')
TOOLS = (READ_FILE, WRITE_FILE, RUN_TESTS, SPAWN_SUBAGENT, FINISH)
_SUITE_SUMMARY = re.compile(r"\d+ passed, \d+ failed")  # the suite runner's last line
SUBAGENT_TASK = "run_tests"  # what a delegating demonstration asks its sub-agent to do


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options(tiny_tests.Options):
    """``--config.task.family_options.tiny_agent.*``: tiny_tests', and the warm start's habit."""

    # the fraction of the warm start's demonstrations that test their answer (RL's headroom)
    demo_test_fraction: float = 0.3


@FAMILIES.register(FAMILY, config=Options, generated=True,
                   summary="multi-call agent episodes: read in.txt, answer, test (or delegate the test), finish")
def make_task(seed: int, options: Options | None = None, **values) -> Task:
    """The tiny task of ``seed`` with its argument moved into ``in.txt`` and a test suite whose
    time is drawn per task (``tiny_tests``' options)."""
    o = family_options(FAMILY, options, values)
    demo_test_fraction = o.demo_test_fraction
    if not 0.0 <= demo_test_fraction <= 1.0:
        raise ValueError(f"tiny_agent.make_task: demo_test_fraction must be in [0, 1], got {demo_test_fraction!r}")
    base = tiny_tests.make_task(seed, tiny_tests.Options(**{f.name: getattr(o, f.name)
                                                          for f in dataclasses.fields(tiny_tests.Options)}))
    p = base.params
    return Task(task_id=base.task_id.replace("tiny-", "agent-", 1), family=FAMILY, prompt=f"{p['op']} {INPUT_FILE}",
                system_prompt=SYSTEM_PROMPT, tools=TOOLS, grader="gyre_jax.agents.tasks.tiny_agent:grade",
                setup_files={INPUT_FILE: p["arg"]}, params={**p, "demo_test_fraction": demo_test_fraction})


def test_suite(task: Task) -> ts.TestSuite:
    return tiny_tests.test_suite(task)


def solution_files(task: Task) -> dict[str, str]:
    return tiny_tests.solution_files(task)


test_suite.__test__ = False  # type: ignore[attr-defined]  # not a pytest test (pytest reads the attribute)


def demo_strategy(task: Task) -> str:
    """How the demonstration of ``task`` verifies: 'test', 'delegate' (a sub-agent runs the
    tests) or 'skip'; fixed per task id (a hash), 'test' and 'delegate' splitting
    ``demo_test_fraction`` evenly."""
    u = int.from_bytes(hashlib.sha256(f"tiny_agent-demo:{task.task_id}".encode()).digest()[:8], "big") / 2.0 ** 64
    f = float(task.params.get("demo_test_fraction", 0.0))
    return "test" if u < f / 2 else "delegate" if u < f else "skip"


def _results(messages: list[dict]) -> str:
    """The tool results the agent saw last (text format: a user message of <result> blocks)."""
    for m in reversed(messages):
        if m["role"] in ("user", "tool") and "<result>" in (m.get("content") or ""):
            return m["content"]
        if m["role"] == "assistant":
            break
    return ""


def _last_suite_line(text: str) -> str:
    found = _SUITE_SUMMARY.findall(text)
    return found[-1] if found else "no tests ran"


def scripted_reply(task: Task, messages: list[dict], role: str, summary_header: str) -> list[tuple[str, dict]] | str:
    """The demonstration's next reply given the context the harness built: a list of tool
    calls, or the text of a summary (``role == ROLE_SUMMARY``). Reacting to the context (not
    replaying a fixed list of turns) is what lets a demonstration pass through compaction
    and a sub-agent exactly as the harness runs them."""
    if role == ROLE_SUMMARY:
        return f"answer.txt written; {_last_suite_line(_results(messages[:-1]))}"
    turns = sum(m["role"] == "assistant" for m in messages)
    if role == ROLE_SUBAGENT:
        return [(RUN_TESTS, {})] if turns == 0 else [(FINISH, {"message": _last_suite_line(_results(messages))})]
    if summary_header in messages[1]["content"]:  # compacted after testing: the work is done
        return [(FINISH, {})]
    if turns == 0:
        return [(READ_FILE, {"path": INPUT_FILE})]
    if turns == 1:
        write = (WRITE_FILE, {"path": ANSWER_FILE, "content": task.params["expected"]})
        strategy = demo_strategy(task)
        if strategy == "test":
            return [write, (RUN_TESTS, {})]
        if strategy == "delegate":
            return [write, (SPAWN_SUBAGENT, {"task": SUBAGENT_TASK})]
        return [write, (FINISH, {})]
    return [(FINISH, {})]


def grade(task: Task, workspace: Path) -> Grade:
    return tiny_tests.grade(task, workspace)

