"""Task sets in the formats teams already have (gyre_jax/agents/tasks/formats): Harbor task directories and
SWE-bench-style JSONL, read as gyre tasks. Every field is honoured or refused naming it; the examples under
examples/ load; a Harbor task's own tests grade its untouched and solved workspace through the real grader."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import pytest

from gyre_jax.agents.tasks.dataset import TaskFileError
from gyre_jax.agents.tasks.formats import detect, load_task_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARBOR = os.path.join(ROOT, "examples", "harbor")
HOST = '{"environment": "host"}'


def test_the_harbor_examples_load_with_every_field_mapped():
    assert detect(HARBOR) == "harbor"
    rows = {t.task_id: (t, split) for t, split in load_task_set(HARBOR, HOST)}
    assert sorted(rows) == ["count-words", "fix-add", "hello-file"]
    assert rows["count-words"][1] == "eval" and rows["fix-add"][1] == "train"  # [metadata] split
    fix, _ = rows["fix-add"]
    assert fix.setup_files == {"calc.py": open(os.path.join(HARBOR, "fix-add", "environment", "calc.py")).read()}
    assert "/workspace/calc.py" in fix.prompt and "/app" not in fix.prompt  # WORKDIR is the workspace here
    assert fix.deadline_s == 600.0  # [agent] timeout_sec
    harbor = fix.metadata["harbor"]
    assert harbor["skipped_instructions"] == ["FROM python:3.11-slim", "RUN pip install --no-cache-dir pytest==8.3.3"]
    assert harbor["resources"] == {"cpus": 1, "memory_mb": 2048} and harbor["workdir"] == "/app"
    assert "bash /workspace/tests/test.sh" in json.dumps(dict(fix.params)) and "GYRE_VERDICT" in json.dumps(dict(fix.params))
    assert sorted(fix.hidden_files) == ["tests/test.sh", "tests/test_calc.py"]  # hidden from the agent
    assert "/workspace/tests/test_calc.py" in fix.hidden_files["tests/test.sh"]
    assert "/tmp/gyre-harbor/logs/verifier/reward.txt" in fix.hidden_files["tests/test.sh"]
    assert fix.params["grader_verdict"] == "file"  # the reward file becomes $GYRE_VERDICT, never stdout
    assert "solve.sh" in fix.metadata["solution"]
    words, _ = rows["count-words"]
    assert words.setup_files == {"words.txt": "the quick brown fox\njumps\nover the lazy dog\n"}  # COPY x /app/


def test_a_harbor_dockerfile_without_docker_is_a_clear_error():
    from gyre_jax.agents.tasks.formats.harbor import docker_unavailable

    if docker_unavailable() is None:
        pytest.skip("docker runs containers here")
    with pytest.raises(TaskFileError) as e:
        load_task_set(HARBOR)
    msg = str(e.value)
    assert e.value.field == "environment/Dockerfile" and "docker is not available" in msg, msg
    assert '"environment": "host"' in msg, msg


def _task(tmp_path, toml: str, name="t"):
    d = tmp_path / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("Do it.")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return str(d)


@pytest.mark.parametrize("toml, field", [
    ('[verifier]\nuser = "root"\n', "verifier.user"),
    ('[agent]\nnetwork_mode = "public"\n', "agent.network_mode"),
    ("[environment]\nallow_internet = true\n", "environment.allow_internet"),
    ("[environment]\ngpus = 1\n", "environment.gpus"),
    ('[environment]\nmcp_servers = [{name = "x", url = "http://x"}]\n', "environment.mcp_servers"),
    ('[environment]\ndocker_image = "python:3.11"\n', "environment.docker_image"),
    ('[verifier]\nretries = 3\n', "verifier.retries"),
    ('[[steps]]\nname = "one"\n', "steps"),
    ('color = "blue"\n', "color"),
    ('schema_version = "2.0"\n', "schema_version"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(tmp_path, toml, field):
    d = _task(tmp_path, toml)
    with pytest.raises(TaskFileError) as e:
        load_task_set(d, HOST)
    assert e.value.field == field, str(e.value)


def test_harbor_tasks_need_instruction_and_tests(tmp_path):
    d = _task(tmp_path, "")
    os.remove(os.path.join(d, "tests", "test.sh"))
    with pytest.raises(TaskFileError, match="tests/test.sh"):
        load_task_set(d, HOST)


def test_options_are_the_formats_own(tmp_path):
    d = _task(tmp_path, "")
    with pytest.raises(ValueError, match="'repos' is not an option of the harbor format"):
        load_task_set(d, '{"repos": "/x"}')
    with pytest.raises(ValueError, match="environment='vm'"):
        load_task_set(d, '{"environment": "vm"}')
    with pytest.raises(ValueError, match="not a JSON object"):
        load_task_set(d, "{environment: host}")
    (t, split), = load_task_set(d)  # no image: runs in the rollout sandbox in either mode
    assert t.task_id == "t" and split == "train"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_harbor_tasks_own_tests_grade_it_through_the_grader(tmp_path):
    """hello-file: untouched scores 0, its solve.sh's work scores 1, through gyre's grader in bubblewrap."""
    from gyre_jax.agents.graders import grader_sandbox_env, run_grader
    from gyre_jax.agents.harness import prepare_workspace
    from gyre_jax.agents.sandbox import SandboxLimits

    rows = {t.task_id: t for t, _ in load_task_set(HARBOR, HOST)}
    task = rows["hello-file"]
    scores = {}
    for label in ("untouched", "solved"):
        ws = prepare_workspace(str(tmp_path / label), "r0", task)
        if label == "solved":  # what solve.sh does, run where the agent's commands run (/workspace)
            argv = ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--symlink", "usr/bin", "/bin",
                    "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev",
                    "/dev", "--bind", str(ws), "/workspace", "--tmpfs", "/tmp", "--chdir", "/workspace", "--setenv",
                    "GYRE_WORKSPACE", "/workspace", "bash", "-c", task.metadata["solution"]]
            subprocess.run(argv, check=True, capture_output=True)
        g = asyncio.run(run_grader(task, ws, timeout_s=60, env=grader_sandbox_env("bubblewrap", SandboxLimits())))
        assert g.ok, g.error
        scores[label] = g.score
    assert scores == {"untouched": 0.0, "solved": 1.0}
