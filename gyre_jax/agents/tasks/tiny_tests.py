"""'tiny' with a test suite: the string transform, then ``run_tests``, whose suite takes
1-30 s of wall time (heavy-tailed, per task), as real test suites do.

Why: on the 'tiny' family a rollout is one model call and nothing else, so rollout cells
are never idle and an elastic scheduler has nothing to hand to training. Here every
rollout waits on its environment (the suite runs in the rollout's sandbox, holding no
decode slot) for a time drawn per task from :func:`test_suite.heavy_tailed_seconds`:
median 3 s, ~1% at 30 s. A step's rollouts then finish over tens of seconds while the
model is idle, which is the situation the paper's elastic cells exploit.

The ideal transcript is still ONE model call (the harness runs the calls in order)::

    <tool>write_file {"path": "answer.txt", "content": "cba"}</tool>
    <tool>run_tests</tool>
    <tool>finish</tool>

Grading: the tiny family's partial credit (characters equal at the same position) if a
valid test receipt covers the final answer (the agent ran the suite on what it
submitted; ``test_suite`` says why it cannot be forged), else half of it: an untested
answer never earns more than 0.5. ``run_tests_scale`` multiplies every task's suite time
(tests use ~0.01; 0 makes suites instant).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from gyre_jax.agents import test_suite as ts
from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tasks import FAMILIES, family_options, tiny
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tool_schemas import FINISH, RUN_TESTS

FAMILY = "tiny_tests"
ANSWER_FILE = tiny.ANSWER_FILE
SYSTEM_PROMPT = ('Answer in answer.txt, then test: <tool>write_file {"path": "answer.txt", "content": ANSWER}'
                 '</tool><tool>run_tests</tool><tool>finish</tool>')
TOOLS = ("write_file", RUN_TESTS, FINISH)
UNTESTED_FACTOR = 0.5  # an answer no suite ran on earns at most this


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options(tiny.Options):
    """``--config.task.family_options.tiny_tests.*``: tiny's, and the suite's time."""

    run_tests_scale: float = 1.0  # x each task's test-suite seconds (heavy-tailed, 1-30 s at 1; 0 = instant)
    test_min_s: float = 1.0
    test_max_s: float = 30.0
    test_median_s: float = 3.0


@FAMILIES.register(FAMILY, config=Options, generated=True,
                   summary="tiny, then run_tests: a test suite of 1-30 s (heavy-tailed) per task")
def make_task(seed: int, options: Options | None = None, **values) -> Task:
    """The tiny task of ``seed`` plus its suite time (deterministic per task: the id names
    the op, the argument and the suite time, so tasks sharing an id share a time)."""
    o = family_options(FAMILY, options, values)
    if not o.run_tests_scale >= 0:
        raise ValueError(f"tiny_tests.make_task: run_tests_scale must be >= 0, got {o.run_tests_scale!r}")
    base = tiny.make_task(seed, tiny.Options(ops=o.ops, min_len=o.min_len, max_len=o.max_len))
    seconds = round(o.run_tests_scale * ts.heavy_tailed_seconds(seed, low_s=o.test_min_s, high_s=o.test_max_s,
                                                                median_s=o.test_median_s), 3)
    key = hashlib.sha256(f"gyre-receipt:{seed}:{base.task_id}".encode()).hexdigest()[:32]
    params = {**base.params, "test_s": seconds, "receipt_key": key}
    return Task(task_id=f"{base.task_id}-t{seconds:g}".replace(".", "p"), family=FAMILY, prompt=base.prompt,
                system_prompt=SYSTEM_PROMPT, tools=TOOLS, grader="gyre_jax.agents.tasks.tiny_tests:grade",
                params=params)


def test_suite(task: Task) -> ts.TestSuite:
    p = task.params
    return ts.TestSuite(answer_file=ANSWER_FILE, expected=p["expected"], duration_s=float(p["test_s"]),
                        receipt_key=p["receipt_key"])


test_suite.__test__ = False  # type: ignore[attr-defined]  # not a pytest test (pytest reads the attribute)


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    return [[("write_file", {"path": ANSWER_FILE, "content": task.params["expected"]}), (RUN_TESTS, {}),
             (FINISH, {})]]


def solution_files(task: Task) -> dict[str, str]:
    """A workspace that scores 1: the answer and the receipt of a suite run on it."""
    expected = task.params["expected"]
    return {ANSWER_FILE: expected, ts.RECEIPT_FILE: ts.receipt(task.params["receipt_key"], expected.encode())}


def grade(task: Task, workspace: Path) -> Grade:
    g = tiny.grade(task, workspace)  # checks params.expected against op and arg
    answer = Path(workspace) / ANSWER_FILE
    receipt = Path(workspace) / ts.RECEIPT_FILE
    tested = ts.receipt_valid(task.params["receipt_key"],
                              receipt.read_text(errors="replace") if receipt.is_file() else None,
                              answer.read_bytes().strip() if answer.is_file() else None)
    score = g.score if tested else UNTESTED_FACTOR * g.score
    return Grade(score, {**g.details, "tested": tested})
