"""Grader subprocess entry: ``python -m gyre_jax.agents.grader_main --workspace DIR [--bases DIR]``.

Reads the task JSON (``Task.to_json()``) on stdin, builds the graded tree from the task's own
files and the snapshot ``DIR`` (``graded_tree``: every grader, every family, sees only that
tree), imports ``task.grader`` ("module:function"), calls it with ``(task, tree)``, and prints
one line ``GYRE-GRADE {"score": s, "details": {...}}`` (``details["tree"]``: what crossed and
what was refused). Any exception propagates (exit code 1, traceback on stderr): the parent
reports it as a verifier error.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from gyre_jax.agents.capture import bound_json
from gyre_jax.agents.graded_tree import build_graded_tree
from gyre_jax.agents.scoring import RESULT_PREFIX, Grade
from gyre_jax.agents.tasks.base import Task


def load_grader(spec: str):
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise LookupError(f"grader {spec!r}: {module} has no callable {name!r}")
    return fn


def grade_snapshot(task: Task, snapshot: Path, *, bases: str | None = None, carry_deletions: bool = True) -> Grade:
    """Build the graded tree of ``snapshot`` in a temporary directory and call the task's grader on it."""
    if not snapshot.is_dir():
        raise FileNotFoundError(f"workspace {snapshot} is not a directory")
    grader = load_grader(task.grader)
    with tempfile.TemporaryDirectory(prefix="gyre-grade-") as tmp:
        tree = Path(tmp) / "tree"
        audit = build_graded_tree(task, snapshot, tree, cache_dir=bases, carry_deletions=carry_deletions)
        grade = grader(task, tree)
    if not isinstance(grade, Grade):
        raise TypeError(f"grader {task.grader} returned {type(grade).__name__}, want scoring.Grade")
    return Grade(grade.score, {**grade.details, "tree": audit})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--bases", default=None, help="cache of the tasks' own trees")
    parser.add_argument("--keep_deleted", action="store_true", help="the snapshot was truncated: no deletions")
    args = parser.parse_args(argv)
    task = Task.from_json(sys.stdin.read())
    grade = grade_snapshot(task, Path(args.workspace), bases=args.bases, carry_deletions=not args.keep_deleted)
    # details cut to the record bounds here: the result line stays small whatever a grader
    # copied into them (agent output, file contents)
    print(RESULT_PREFIX + json.dumps({"score": grade.score, "details": bound_json(grade.details)}), flush=True)


if __name__ == "__main__":
    main()
