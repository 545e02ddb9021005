"""Task sets in the formats teams already have (gyre_jax/agents/tasks/formats): Harbor task directories and
SWE-bench-style JSONL, read as gyre tasks. Every field is honoured or refused naming it; the examples under
examples/ load; a Harbor task's own tests grade its untouched and solved workspace through the real grader."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

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
    assert sorted(fix.hidden_files) == ["tests/test.sh"]  # hidden from the agent
    assert "cd /workspace &&" in fix.hidden_files["tests/test.sh"]  # /app, its WORKDIR, is the workspace
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


# ------------------------------------------------------------------------------------------ SWE-bench
SWEBENCH = os.path.join(ROOT, "examples", "swebench", "instances.jsonl")


def test_the_swebench_examples_load_with_every_field_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the bundle's clone goes here
    assert detect(SWEBENCH) == "swebench"
    rows = {t.task_id: (t, split) for t, split in load_task_set(SWEBENCH, HOST)}
    assert sorted(rows) == ["gyre__calc-1", "gyre__calc-2", "gyre__calc-3"]
    one, split = rows["gyre__calc-1"]
    line = json.loads(open(SWEBENCH).readline())
    assert split == "train" and rows["gyre__calc-3"][1] == "eval"
    assert one.prompt == line["problem_statement"] and one.repo_commit == line["base_commit"]
    assert one.repo.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(one.repo, "HEAD"))
    assert one.params["grader_mode"] == "tests"  # issue 42's per-test verdict: the named tests decide
    assert one.params["fail_to_pass"] == ["tests/test_calc.py::test_add"]  # FAIL_TO_PASS given as JSON text
    assert one.params["pass_to_pass"] == ["tests/test_calc.py::test_sub"]
    # The test file as the test patch leaves it, hidden from the agent and laid over its work when graded.
    assert list(one.hidden_files) == ["tests/test_calc.py"] and "def test_add" in one.hidden_files["tests/test_calc.py"]
    assert one.metadata["solution"] == {"patch": line["patch"]}
    assert one.metadata["swebench"]["environment_setup_commit"] == line["environment_setup_commit"]
    assert list(rows["gyre__calc-2"][0].hidden_files) == ["tests/test_mul.py"]  # a file the patch adds


def test_swebench_refusals_name_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = json.loads(open(SWEBENCH).readline())
    repos = os.path.join(ROOT, "examples", "swebench", "repos")

    def load(line, options=HOST):
        p = tmp_path / "set.jsonl"
        p.write_text(json.dumps(line) + "\n")
        opts = json.loads(options)
        opts.setdefault("repos", repos)
        return load_task_set(str(p), json.dumps(opts))

    for line, field in [({**base, "image_name": "x"}, "image_name"), ({**base, "repo": "nobody/nothing"}, "repo"),
                        ({k: v for k, v in base.items() if k != "test_patch"}, "test_patch"),
                        ({**base, "FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS"),
                        ({**base, "test_patch": "diff --git a/calc.py b/calc.py\ndeleted file mode 100644\n"
                                                "--- a/calc.py\n+++ /dev/null\n"}, "test_patch")]:
        with pytest.raises(TaskFileError) as e:
            load(line)
        assert e.value.field == field, str(e.value)
    with pytest.raises(TaskFileError) as e:  # the default: an instance's own environment image, not built here
        load(base, "{}")
    assert e.value.field == "environment_setup_commit" and '"environment": "host"' in str(e.value)


def test_reading_a_test_patch_leaves_the_clone_as_it_was(tmp_path):
    from gyre_jax.agents.tasks.formats.swebench import test_files

    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", os.path.join(ROOT, "examples", "swebench", "repos", "gyre__calc.bundle"),
                    str(repo)], check=True)
    before = sorted(os.path.relpath(os.path.join(d, f), repo) for d, _, fs in os.walk(repo) for f in fs)
    line = json.loads(open(SWEBENCH).readline())

    def err(problem):
        raise AssertionError(problem)

    files = test_files(str(repo), line["base_commit"], line["test_patch"], err)
    assert "def test_add" in files["tests/test_calc.py"]
    after = sorted(os.path.relpath(os.path.join(d, f), repo) for d, _, fs in os.walk(repo) for f in fs)
    assert after == before  # no object, index or work-tree file written


@pytest.mark.slow  # ~2-4 min: every example task graded untouched, forged and solved, through the real sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.parametrize("dataset", ["examples/harbor", "examples/swebench/instances.jsonl"])
def test_the_example_sets_pass_check_tasks(dataset, tmp_path):
    r = subprocess.run([sys.executable, "-m", "launch.main", "--config", "configs/external.py", "--check_tasks",
                        f"--config.task.dataset={dataset}", f"--config.task.dataset_options={HOST}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 ok, 0 broken of 3 tasks" in r.stdout + r.stderr
