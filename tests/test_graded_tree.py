"""The graded tree (gyre_jax.agents.graded_tree, tree_rules): built from the task's own files, the
policy's changes laid on where allowed, hidden files last; nothing followed, everything refused counted."""
import os

import pytest

from gyre_jax.agents.graded_tree import build_graded_tree, cached_base
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tree_rules import Rules, command_files, command_tool_names, glob_regex


def _task(**kw):
    base = dict(task_id="t", family="dataset", prompt="p", grader="gyre_jax.agents.tasks.dataset:grade",
                setup_files={"calc.py": "bug\n", "conftest.py": "# the task's own\n", "run.sh": "exit 1\n",
                             "pkg/__init__.py": "", "tests/test_old.py": "old\n"},
                hidden_files={"tests/test_calc.py": "hidden\n"}, params={"grader_command": "bash run.sh"})
    return Task(**{**base, **kw})


def _snapshot(root, files):
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _tree(root):
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_only_allowed_changes_cross_and_every_refusal_is_counted(tmp_path):
    task = _task()
    snap = _snapshot(tmp_path / "snap", {
        **task.setup_files, "calc.py": "fixed\n", "new_module.py": "new\n", "conftest.py": "evil\n",
        "sub/conftest.py": "evil\n", "pytest.ini": "x", "setup.cfg": "x", "x.pth": "x", "sitecustomize.py": "x",
        "__pycache__/calc.cpython-311.pyc": "x", "calc.pyc": "x", "json.py": "x", "tests/json.py": "x",
        "pkg/json.py": "pkg.json is fine\n", "pytest.py": "x", "tests/test_calc.py": "forged\n", "run.sh": "exit 0\n",
        "tests/test_new.py": "x", "tests/test_old.py": "changed\n", ".git/hooks/pre-commit": "x",
        "notes.txt": "fine\n"})
    audit = build_graded_tree(task, snap, tmp_path / "tree")
    tree = _tree(tmp_path / "tree")
    assert tree == {"calc.py": "fixed\n", "conftest.py": "# the task's own\n", "new_module.py": "new\n",
                    "notes.txt": "fine\n", "pkg/__init__.py": "", "pkg/json.py": "pkg.json is fine\n",
                    "run.sh": "exit 1\n", "tests/test_calc.py": "hidden\n", "tests/test_old.py": "old\n"}
    assert audit["refused"] == {"runner_config": 6, "bytecode": 2, "shadowing": 3, "protected": 2, "test_file": 2,
                                "outside_solution_paths": 0, "over_limit": 0}
    assert audit["carried"] == 4 and audit["deleted"] == 0
    assert set(audit["examples"]["protected"]) == {"run.sh", "tests/test_calc.py"}  # named by the command, hidden


def test_solution_paths_deletions_and_conflicts_with_hidden_paths(tmp_path):
    task = _task(solution_paths=("calc.py", "src/**/*.py"))
    snap = _snapshot(tmp_path / "snap", {"run.sh": "exit 1\n", "conftest.py": "# the task's own\n", "pkg/__init__.py": "",
                                         "tests/test_old.py": "old\n", "src/a/b.py": "ok\n", "src/readme.md": "no\n",
                                         "other.py": "no\n"})
    # calc.py deleted by the policy (allowed), a file where the hidden tests/ directory goes: refused
    audit = build_graded_tree(task, snap, tmp_path / "tree")
    tree = _tree(tmp_path / "tree")
    assert "calc.py" not in tree and tree["src/a/b.py"] == "ok\n" and "other.py" not in tree
    assert audit["deleted"] == 1 and audit["refused"]["outside_solution_paths"] == 2
    files = {k: v for k, v in _task().setup_files.items() if not k.startswith("tests/")}
    snap2 = _snapshot(tmp_path / "snap2", {**files, "tests": "a file where a hidden dir goes\n"})
    audit2 = build_graded_tree(_task(), snap2, tmp_path / "tree2")
    assert _tree(tmp_path / "tree2")["tests/test_calc.py"] == "hidden\n"
    assert audit2["refused"]["protected"] == 1 and audit2["refused"]["test_file"] == 1  # tests/test_old.py deleted


def test_the_tasks_symlinks_are_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib").symlink_to(outside)  # the task ships a link out of the tree
    (repo / "data").symlink_to(outside / "f")
    task = _task(repo=str(repo), hidden_files={})
    snap = _snapshot(tmp_path / "snap", {**task.setup_files, "lib/x.py": "through the link?\n", "data": "over it\n"})
    build_graded_tree(task, snap, tmp_path / "tree")
    assert os.listdir(outside) == []  # nothing written outside the tree
    assert (tmp_path / "tree" / "lib").is_dir() and not (tmp_path / "tree" / "lib").is_symlink()
    assert (tmp_path / "tree" / "data").read_text() == "over it\n"


def test_the_tasks_own_tree_is_cached_by_content(tmp_path):
    task = _task()
    a = cached_base(task, tmp_path / "bases")
    assert cached_base(task, tmp_path / "bases") == a
    b = cached_base(_task(setup_files={"calc.py": "other\n"}), tmp_path / "bases")
    assert a != b and (b / "calc.py").read_text() == "other\n"
    build_graded_tree(task, _snapshot(tmp_path / "s", dict(task.setup_files)), tmp_path / "tree", cache_dir=tmp_path / "bases")
    assert (tmp_path / "tree" / "tests" / "test_calc.py").read_text() == "hidden\n"


@pytest.mark.parametrize("path,new,why", [
    ("conftest.py", True, "runner_config"), ("a/b/conftest.py", False, "runner_config"), ("tox.ini", True, "runner_config"),
    ("pytest.toml", True, "runner_config"), ("a.pth", True, "runner_config"), ("usercustomize.py", True, "runner_config"),
    ("x/__pycache__/y.pyc", True, "bytecode"), ("m.cpython-311-x86_64-linux-gnu.so", True, "bytecode"),
    ("os.py", True, "shadowing"), ("unittest/__init__.py", True, "shadowing"), ("pluggy.py", True, "shadowing"),
    ("os.py", False, None), ("unittest/case.py", True, None),  # no __init__.py: a namespace portion never wins
    ("test_x.py", True, "test_file"), ("x_test.py", True, "test_file"), ("src/calc.py", True, None),
])
def test_rules(path, new, why):
    rules = Rules(package_dirs={"unittest"} if path.startswith("unittest/__init__") else set())
    assert rules.refusal(path, new=new) == why


def test_globs_and_command_files():
    assert glob_regex("src/**/*.py").fullmatch("src/a/b/c.py") and glob_regex("src/**/*.py").fullmatch("src/c.py")
    assert not glob_regex("*.py").fullmatch("a/b.py") and glob_regex("lib").fullmatch("lib/x/y")
    assert command_files("cd x && bash ./run_tests.sh; python3 check.py --fast | tee log; make test",
                         ["run_tests.sh", "check.py", "Makefile", "other.sh"]) == {"run_tests.sh", "check.py"}
    # a script named relative to the directory the command changes to
    assert command_files("cd scripts && bash run.sh", ["scripts/run.sh", "run.sh2"]) == {"scripts/run.sh"}
    assert command_files("make -C sub check", ["sub/check", "check"]) == {"sub/check", "check"}
    # make reads whichever makefile name it finds first: every one is protected wherever it is
    assert command_tool_names("cd x && make -s test") == command_tool_names("sh -c 'make test'") == \
        {"GNUmakefile", "makefile", "Makefile"}
    assert command_tool_names("python3 check.py") == frozenset()


def test_a_sparse_file_is_laid_sparse_and_changes_past_the_limit_are_refused(tmp_path, monkeypatch):
    """A 128 MiB file of holes costs the policy nothing in its tmpfs; laid dense, a few hundred of them
    were gigabytes written in the grader's time (a verifier error, not a 0). So were 65536 empty files."""
    from gyre_jax.agents import graded_tree

    task = _task()
    snap = _snapshot(tmp_path / "snap", dict(task.setup_files))
    with open(snap / "holes.bin", "wb") as f:
        f.truncate(128 << 20)
        f.seek(64 << 20)
        f.write(b"data")
    build_graded_tree(task, snap, tmp_path / "tree")
    st = os.stat(tmp_path / "tree" / "holes.bin")
    assert st.st_size == (128 << 20) + 0 and st.st_blocks * 512 < (1 << 20)
    with open(tmp_path / "tree" / "holes.bin", "rb") as f:
        f.seek(64 << 20)
        assert f.read(4) == b"data"
    monkeypatch.setattr(graded_tree, "MAX_CHANGED_FILES", 3)
    snap2 = _snapshot(tmp_path / "snap2", {**task.setup_files, "calc.py": "fixed\n",
                                           **{f"junk/{i}.txt": "x" for i in range(5)}})
    audit = build_graded_tree(task, snap2, tmp_path / "tree2")
    assert audit["carried"] == 3 and audit["refused"]["over_limit"] == 3
    assert (tmp_path / "tree2" / "calc.py").read_text() == "fixed\n"  # sorted: calc.py before junk/


@pytest.mark.parametrize("files,why", [
    # a package beside a hidden module wins its import (tests/helpers/ over tests/helpers.py)
    ({"tests/helpers/__init__.py": "EXPECTED = -1\n"}, "shadowing"),
    # an __init__.py the policy plants makes tests/ a package: the hidden test is then imported as
    # tests.test_calc and tests/ leaves sys.path, so a root helpers.py answers `from helpers import`
    ({"tests/__init__.py": "", "helpers.py": "EXPECTED = -1\n"}, "shadowing"),
    ({"my-tests/__init__.py": ""}, "protected"), ({"__init__.py": ""}, "protected"),
    ({"helpers.py": "EXPECTED = -1\n"}, "shadowing"),
    # a planted __init__.py does not make grader/ a package: grader/json.py shadows json for
    # `python3 grader/check.py` (the script's directory is first on sys.path)
    ({"grader/__init__.py": "", "grader/json.py": "x"}, "shadowing"),
    ({"grader/json.py": "x"}, "shadowing"),
    # make prefers GNUmakefile and makefile to the task's Makefile
    ({"GNUmakefile": "test:\n\t@true\n"}, "protected"), ({"sub/makefile": "x"}, "protected"),
    ({"Makefile": "test:\n\t@true\n"}, "protected"),
])
def test_packages_layouts_and_makefiles_that_would_answer_for_hidden_files_are_refused(tmp_path, files, why):
    task = _task(setup_files={"calc.py": "bug\n", "Makefile": "test:\n\tpython3 grader/check.py\n",
                              "pkg/__init__.py": ""},
                 hidden_files={"tests/test_calc.py": "from helpers import EXPECTED\n", "tests/helpers.py": "EXPECTED = 5\n",
                               "grader/check.py": "import json\n", "my-tests/test_x.py": "x\n"},
                 params={"grader_command": "make -s test"})
    snap = _snapshot(tmp_path / "snap", {**task.setup_files, **files})
    audit = build_graded_tree(task, snap, tmp_path / "tree")
    assert audit["refused"][why] >= 1 and audit["carried"] == 0, audit
    tree = _tree(tmp_path / "tree")
    assert tree["tests/helpers.py"] == "EXPECTED = 5\n" and tree["Makefile"] == task.setup_files["Makefile"]
    assert not set(files) - {"Makefile"} & set(tree)


def test_new_modules_inside_the_tasks_own_packages_still_cross(tmp_path):
    """The rules above refuse no honest change: a new module in a package the task ships (even one whose
    directory holds hidden tests' parents), a changed __init__.py, new helper modules at the root."""
    task = _task(setup_files={"app/__init__.py": "", "app/core.py": "bug\n"},
                 hidden_files={"app/tests/test_core.py": "from app.core import f\n"}, params={})
    snap = _snapshot(tmp_path / "snap", {"app/__init__.py": "from app.core import f\n", "app/core.py": "fixed\n",
                                         "app/json_io.py": "x\n", "app/util/__init__.py": "", "app/util/io.py": "x\n",
                                         "tools.py": "x\n"})
    audit = build_graded_tree(task, snap, tmp_path / "tree")
    assert audit["carried"] == 6 and not any(audit["refused"].values()), audit
