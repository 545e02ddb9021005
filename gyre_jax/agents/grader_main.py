"""Grader subprocess entry: ``python -m gyre_jax.agents.grader_main --workspace DIR [--bases DIR]``.

Reads the task JSON (``Task.to_json()``) on stdin, builds the graded tree from the task's own
files and the snapshot ``DIR`` (``graded_tree``: every grader, every family, sees only that
tree), imports ``task.grader`` ("module:function"), calls it with ``(task, tree)``, and prints
one line ``GYRE-GRADE {"score": s, "details": {...}}`` (``details["tree"]``: what crossed and
what was refused). Any exception propagates (exit code 1, traceback on stderr): the parent
reports it as a verifier error.

Run as root with a sandboxed grader (``GYRE_GRADER_SANDBOX``), the graded tree lives on a tmpfs of
its own, sized for the task's tree, the policy's snapshot and the workspace's ``disk_bytes`` and
``max_files`` more: what graded code writes while it is graded fills that, never the host's disk
(where it failed other rollouts' graders, and the trainer's own writes).

``--budget_s``: the seconds this process has (the parent kills it a margin later: a verifier
error). What is left of it once the tree is built caps a task file's grader timeout, so graded
work (a hang in every call, a test that sleeps, on top of a tree that took long to lay) ends
as the graded code's own timeout, a 0, never as this process outliving its parent's limit.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from gyre_jax.agents.capture import bound_json
from gyre_jax.agents.graded_tree import build_graded_tree
from gyre_jax.agents.scoring import RESULT_PREFIX, Grade
from gyre_jax.agents.tasks.base import Task

log = logging.getLogger(__name__)


def load_grader(spec: str):
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise LookupError(f"grader {spec!r}: {module} has no callable {name!r}")
    return fn


# Kept of the budget after the graded command's own limit: its output and the verdict read, the tree removed.
RESERVE_S = 8.0


def grade_snapshot(task: Task, snapshot: Path, *, bases: str | None = None, carry_deletions: bool = True,
                   deadline: float | None = None) -> Grade:
    """Build the graded tree of ``snapshot`` in a temporary directory and call the task's grader on it
    (``deadline``: a ``time.monotonic()`` this process must be done by, see ``--budget_s``)."""
    if not snapshot.is_dir():
        raise FileNotFoundError(f"workspace {snapshot} is not a directory")
    grader = load_grader(task.grader)
    with tempfile.TemporaryDirectory(prefix="gyre-grade-") as tmp, _scratch(Path(tmp), task, snapshot, bases):
        tree = Path(tmp) / "tree"
        audit = build_graded_tree(task, snapshot, tree, cache_dir=bases, carry_deletions=carry_deletions)
        if deadline is not None and "grader_timeout_s" in task.params:
            left = max(1.0, deadline - time.monotonic() - RESERVE_S)
            if left < float(task.params["grader_timeout_s"]):
                task = dataclasses.replace(task, params={**task.params, "grader_timeout_s": left})
        grade = grader(task, tree)
    if not isinstance(grade, Grade):
        raise TypeError(f"grader {task.grader} returned {type(grade).__name__}, want scoring.Grade")
    return Grade(grade.score, {**grade.details, "tree": audit})


@contextlib.contextmanager
def _scratch(tmp: Path, task: Task, snapshot: Path, bases: str | None) -> Iterator[None]:
    """A tmpfs on ``tmp`` for the graded tree where one can be had (module docstring)."""
    from gyre_jax.agents import grader_sandbox, sandbox
    from gyre_jax.agents.graded_tree import cached_base

    spec = grader_sandbox.spec()
    if os.geteuid() != 0 or spec.get("kind") in (None, "none") or bases is None:
        yield
        return
    limits = sandbox.SandboxLimits(**spec.get("limits", {}))
    base_bytes, base_entries = _usage(cached_base(task, Path(bases)))
    snap_bytes, snap_entries = _usage(snapshot)
    size = base_bytes + snap_bytes + limits.disk_bytes + (16 << 20)
    inodes = base_entries + snap_entries + limits.max_files + 1024
    why = sandbox.mount_tmpfs(tmp, f"size={size},nr_inodes={inodes},mode=0700")
    if why is not None:
        log.warning("grader: no tmpfs for the graded tree (%s): graded code's writes go to the host's disk", why)
        yield
        return
    try:
        yield
    finally:
        sandbox.unmount(tmp)


def _usage(root: Path) -> tuple[int, int]:
    """(bytes allocated, entries) under ``root``, nothing followed (sparse files count their data)."""
    total, entries, stack = 0, 0, [str(root)]
    while stack:
        try:
            it = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in it:
            entries += 1
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_blocks * 512
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
    return total, entries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--bases", default=None, help="cache of the tasks' own trees")
    parser.add_argument("--keep_deleted", action="store_true", help="the snapshot was truncated: no deletions")
    parser.add_argument("--budget_s", type=float, default=None, help="seconds this process has (module docstring)")
    args = parser.parse_args(argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    task = Task.from_json(sys.stdin.read())
    grade = grade_snapshot(task, Path(args.workspace), bases=args.bases, carry_deletions=not args.keep_deleted,
                           deadline=deadline)
    # details cut to the record bounds here: the result line stays small whatever a grader
    # copied into them (agent output, file contents)
    print(RESULT_PREFIX + json.dumps({"score": grade.score, "details": bound_json(grade.details)}), flush=True)


if __name__ == "__main__":
    main()
