"""A family a tiny byte-level model can learn on CPU in minutes: one string transform.

The task "reverse abc" asks for ``answer.txt`` containing ``cba``. Ops: ``copy``,
``reverse``, ``upper`` (lowercase letters in), ``sort`` (letters sorted), ``sum`` (the
decimal sum of the digits of a digit string). Prompts and the system prompt are a few
dozen bytes, and the ideal transcript is ONE model call in the plain-text tool format::

    <tool>write_file {"path": "answer.txt", "content": "cba"}</tool>
    <tool>finish</tool>

Partial credit: characters equal at the same position over the longer of expected and
written answer (``scoring.char_match_score``); a missing file scores 0 (a genuine zero:
the agent did not produce it). Run the harness with ``send_tools_schema=False`` and
``bytes_per_token=1`` for such models. :func:`solution_turns` is the scripted
demonstration for the supervised warm start (see ``gyre_jax.agents.demos``).
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from gyre_jax.agents.scoring import Grade, char_match_score
from gyre_jax.agents.tasks import FAMILIES, family_options
from gyre_jax.agents.tasks.base import Task

FAMILY = "tiny"
ANSWER_FILE = "answer.txt"
SYSTEM_PROMPT = 'Answer in answer.txt: <tool>write_file {"path": "answer.txt", "content": ANSWER}</tool><tool>finish</tool>'
TOOLS = ("write_file", "finish")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DIGITS = "0123456789"

OPS = {
    "copy": (_LETTERS, lambda s: s),
    "reverse": (_LETTERS, lambda s: s[::-1]),
    "upper": (_LETTERS, lambda s: s.upper()),
    "sort": (_LETTERS, lambda s: "".join(sorted(s))),
    "sum": (_DIGITS, lambda s: str(sum(int(c) for c in s))),
}
DEFAULT_OPS = ("reverse", "upper", "sum")


def expected_answer(op: str, arg: str) -> str:
    if op not in OPS:
        raise ValueError(f"tiny task: unknown op {op!r}; known: {sorted(OPS)}")
    alphabet, fn = OPS[op]
    if not arg or any(c not in alphabet for c in arg):
        raise ValueError(f"tiny task {op!r}: argument {arg!r} must be non-empty, made of {alphabet!r}")
    return fn(arg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``--config.task.family_options.tiny.*``."""

    ops: str = ",".join(DEFAULT_OPS)  # comma-separated ops drawn per task (OPS), e.g. "copy,upper,reverse"
    min_len: int = 3  # argument length range
    max_len: int = 5

    def __post_init__(self):
        if not isinstance(self.ops, str):  # a tuple of names, as a caller in code writes it
            object.__setattr__(self, "ops", ",".join(self.ops))

    @property
    def op_names(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.ops.split(",") if o.strip())


@FAMILIES.register(FAMILY, config=Options, generated=True,
                   summary="one string transform (copy, reverse, upper, sort, sum) written to answer.txt")
def make_task(seed: int, options: Options | None = None, **values) -> Task:
    """A deterministic task for ``seed``; the task id names op and argument, so equal
    tasks from different seeds share an id (and a group). ``values``: options by name."""
    o = family_options(FAMILY, options, values)
    ops, min_len, max_len = o.op_names, o.min_len, o.max_len
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"tiny.make_task: ops must be a non-empty subset of {sorted(OPS)}, got {ops!r}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"tiny.make_task: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    op = ops[rng.randrange(len(ops))]
    alphabet = OPS[op][0]
    arg = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
    return Task(task_id=f"tiny-{op}-{arg}", family=FAMILY, prompt=f"{op} {arg}", system_prompt=SYSTEM_PROMPT,
                tools=TOOLS, grader="gyre_jax.agents.tasks.tiny:grade",
                params={"op": op, "arg": arg, "expected": expected_answer(op, arg)})


def solution_turns(task: Task) -> list[list[tuple[str, dict]]]:
    """The ideal actions: one turn writing the answer and finishing (``params['demo_give_up']``,
    set only by ``gyre_jax.rl.sft.noisy_tasks``: a lazy demonstration that just finishes)."""
    if task.params.get("demo_give_up"):
        return [[("finish", {})]]
    return [[("write_file", {"path": ANSWER_FILE, "content": task.params["expected"]}), ("finish", {})]]


def solution_files(task: Task) -> dict[str, str]:
    """A workspace that scores 1 (``--check_tasks`` grades it)."""
    return {ANSWER_FILE: task.params["expected"]}


def grade(task: Task, workspace: Path) -> Grade:
    expected = task.params["expected"]
    if expected != expected_answer(task.params["op"], task.params["arg"]):
        raise ValueError(f"task {task.task_id}: params.expected {expected!r} does not match op and arg")
    path = Path(workspace) / ANSWER_FILE
    if not path.is_file():
        return Grade(0.0, {"expected": expected, "got": None, "note": f"{ANSWER_FILE} missing"})
    got = path.read_bytes().decode(errors="replace").strip()
    return Grade(char_match_score(expected, got), {"expected": expected, "got": got[:200], "exact": got == expected})
