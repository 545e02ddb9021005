"""Grader subprocess entry: ``python -m gyre_jax.agents.grader_main --workspace DIR``.

Reads the task JSON (``Task.to_json()``) on stdin, imports ``task.grader``
("module:function"), calls it with ``(task, Path(workspace))``, and prints one line
``GYRE-GRADE {"score": s, "details": {...}}``. Any exception propagates (exit code 1,
traceback on stderr): the parent reports it as a verifier error.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from gyre_jax.agents.capture import bound_json
from gyre_jax.agents.scoring import RESULT_PREFIX, Grade
from gyre_jax.agents.tasks.base import Task


def load_grader(spec: str):
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise LookupError(f"grader {spec!r}: {module} has no callable {name!r}")
    return fn


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", required=True)
    args = parser.parse_args(argv)
    task = Task.from_json(sys.stdin.read())
    workspace = Path(args.workspace)
    if not workspace.is_dir():
        raise FileNotFoundError(f"workspace {workspace} is not a directory")
    grade = load_grader(task.grader)(task, workspace)
    if not isinstance(grade, Grade):
        raise TypeError(f"grader {task.grader} returned {type(grade).__name__}, want scoring.Grade")
    # details cut to the record bounds here: the result line stays small whatever a grader
    # copied into them (agent output, file contents)
    print(RESULT_PREFIX + json.dumps({"score": grade.score, "details": bound_json(grade.details)}), flush=True)


if __name__ == "__main__":
    main()
