"""examples/tasks/smol_tasks.jsonl (tools/gen_smol_tasks.py): the shipped file is what the generator writes, it
loads as a task file, held-out words and answers are disjoint from the train tasks', and every family's grader
passes its ``metadata.solution`` and fails the untouched workspace (bash in a scratch directory, as the grader
command runs)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = os.path.join(ROOT, "examples", "tasks", "smol_tasks.jsonl")


def _gen():
    if os.path.join(ROOT, "tools") not in sys.path:  # the generator imports tools/benchkit.py, as tools do
        sys.path.insert(0, os.path.join(ROOT, "tools"))
    spec = importlib.util.spec_from_file_location("gen_smol_tasks", os.path.join(ROOT, "tools", "gen_smol_tasks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tasks():
    with open(FILE) as f:
        return [json.loads(line) for line in f]


def test_file_is_the_generators_and_loads(tasks):
    from gyre_jax.agents.tasks.dataset import load_task_file

    assert tasks == _gen().generate(320, 64, 0)
    loaded = load_task_file(FILE)
    assert sum(split == "eval" for _, split in loaded) == 64 and len(loaded) == 384


def test_held_out_answers_are_disjoint_from_train(tasks):
    gen = _gen()
    train_words = set(gen._split_pool(gen._WORDS, False))
    eval_words = set(gen._split_pool(gen._WORDS, True))
    assert train_words and eval_words and not train_words & eval_words
    train_graders = {t["grader"] for t in tasks if t["split"] == "train"}
    assert not any(t["grader"] in train_graders for t in tasks if t["split"] == "eval")
    fams = {t["metadata"]["family"] for t in tasks if t["split"] == "eval"}
    assert fams == set(gen.FAMILIES)


def _run(task, tmp_path, solve: bool) -> int:
    ws = tmp_path / ("solved" if solve else "untouched") / task["id"]
    ws.mkdir(parents=True)
    for rel, content in task.get("files", {}).items():
        (ws / rel).write_text(content)
    if solve:
        subprocess.run(["bash", "-c", task["metadata"]["solution"]], cwd=ws, check=True, timeout=30)
    return subprocess.run(["bash", "-c", task["grader"]], cwd=ws, timeout=30, capture_output=True).returncode


def test_every_family_grades_its_solution_and_not_the_untouched_workspace(tasks, tmp_path):
    seen = {}
    for t in tasks:  # two tasks of each family and split
        key = (t["metadata"]["family"], t["split"])
        if seen.get(key, 0) < 2:
            seen[key] = seen.get(key, 0) + 1
            assert _run(t, tmp_path, True) == 0, t["id"]
            assert _run(t, tmp_path, False) != 0, t["id"]
    assert len(seen) == 2 * len(_gen().FAMILIES)
