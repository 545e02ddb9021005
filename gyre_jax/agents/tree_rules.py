"""Which of the policy's files may reach a grader: the rules, as pure functions of a path.

The graded tree is built from the task's own files (``graded_tree``); a path the policy wrote
(created, changed or deleted) crosses into it only if :func:`refusal` returns None. The
categories, in the order they are checked:

  runner_config  ``conftest.py`` (any directory), ``*.ini``, ``*.pth``, ``pyproject.toml``,
                 ``setup.cfg``, ``pytest.toml``/``.pytest.toml``, ``sitecustomize.py``,
                 ``usercustomize.py``: files a test runner or the interpreter reads as
                 configuration, so one written by the policy could skip, deselect or rewrite
                 the hidden tests. Never carried.
  bytecode       ``__pycache__/``, ``*.pyc``, ``*.pyo`` and compiled extension modules (``*.so``,
                 ``*.pyd``): an unchecked-hash ``.pyc`` runs instead of the restored source, a
                 new extension module wins the import over a ``.py`` of the same name. Never
                 carried (the task's own bytecode is dropped too: the graded tree has none).
  shadowing      a new module or package whose name is one of the standard library's, a test
                 tool's (pytest, pluggy, unittest, ...), gyre's grading modules' or an installed
                 package's, in a directory that can be on ``sys.path`` (one that is not a
                 regular package: the root, a tests directory). Never carried. Changes to
                 a module the task itself ships under such a name are ordinary files.
  protected      the task's hidden grader files, the files of the tests it names
                 (``fail_to_pass``/``pass_to_pass``) and shipped files its grader command
                 names (``bash run_tests.sh``): the graded tree always has the task's version;
                 a policy path equal to one, inside one or holding one (a file where a hidden
                 directory goes) is not carried.
  test_file      (default solution paths only) a test file a runner discovers by name
                 (``test*.py``, ``*_test.py``): the policy's new or changed tests would run
                 inside the grader's session. Carried only where ``solution_paths`` names it.
  outside_solution_paths  with ``solution_paths`` set, anything its globs do not match.
  vcs            the policy's ``.git`` changes (commits, hooks): ignored, not audited.

Default solution paths (``solution_paths`` unset): every other path, i.e. the files the task
ships and new files, minus the categories above.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from typing import Iterable, Sequence

RUNNER_CONFIG_NAMES = frozenset({
    "conftest.py", "pyproject.toml", "setup.cfg", "tox.ini", "pytest.toml", ".pytest.toml",
    "sitecustomize.py", "usercustomize.py"})
RUNNER_CONFIG_SUFFIXES = (".ini", ".pth")
BYTECODE_DIRS = frozenset({"__pycache__"})
BYTECODE_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd")
VCS_DIRS = frozenset({".git"})
# Modules of the test tools graders run, and gyre's own grading modules (loaded inside the sandbox).
TEST_TOOL_MODULES = frozenset({
    "pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "unittest", "nose", "nose2", "hypothesis",
    "_hypothesis_pytestplugin", "coverage", "xdist", "pytest_xdist", "execnet", "tomli", "exceptiongroup",
    "typing_extensions", "gyre_verdict", "gyre_canary", "check_runner"})
# Module file suffixes whose stem is an importable name.
MODULE_SUFFIXES = (".py", ".pyw", ".pyc", ".so", ".pyd")
CATEGORIES = ("runner_config", "bytecode", "shadowing", "protected", "test_file", "outside_solution_paths")
IGNORED = "vcs"
_TEST_FILE = re.compile(r"(test[^/]*\.py|[^/]*_test\.py)$")


def is_bytecode(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in BYTECODE_DIRS for p in parts) or parts[-1].endswith(BYTECODE_SUFFIXES)


def is_runner_config(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name in RUNNER_CONFIG_NAMES or name.endswith(RUNNER_CONFIG_SUFFIXES)


def is_test_file(rel: str) -> bool:
    return bool(_TEST_FILE.match(rel.rsplit("/", 1)[-1]))


def module_name(component: str, is_dir: bool) -> str | None:
    """The importable name a path component defines (``json.py`` -> json, ``x.cpython-311.so`` -> x)."""
    if is_dir:
        return component if component.isidentifier() else None
    for suffix in MODULE_SUFFIXES:
        if component.endswith(suffix):
            stem = component.split(".", 1)[0]
            return stem if stem.isidentifier() else None
    return None


@functools.lru_cache(maxsize=1)
def shadowed_names() -> frozenset[str]:
    """Names a tree must not newly define on ``sys.path``: the standard library, the test tools,
    gyre's grading modules and the top-level names installed in this interpreter's site dirs (a
    directory listing: a metadata scan costs seconds)."""
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | TEST_TOOL_MODULES
    for d in sys.path:
        if not d or not os.path.isabs(d) or "-packages" not in d:
            continue
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for e in entries:
            if e.endswith((".dist-info", ".egg-info", ".pth")) or e == "__pycache__":
                continue
            name = module_name(e, os.path.isdir(os.path.join(d, e)))
            if name:
                names.add(name)
    return frozenset(names)


def glob_regex(pattern: str) -> re.Pattern:
    """A ``solution_paths`` glob as a regex over '/'-separated relative paths: ``*`` and ``?``
    within one component, ``**`` any number of components, ``[...]`` a set; a pattern naming a
    directory (``src`` or ``src/``) also matches everything under it."""
    pat = pattern.strip("/")
    out, i = [], 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pat[i + 1:j].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + "(?:/.*)?")


def check_glob(pattern: str) -> str:
    """A valid ``solution_paths`` glob, or ValueError naming what is wrong."""
    if not isinstance(pattern, str) or not pattern.strip("/") or pattern.startswith("/") or "\0" in pattern \
            or ".." in pattern.split("/"):
        raise ValueError(f"{pattern!r} must be a relative glob inside the workspace (no leading '/', no '..')")
    glob_regex(pattern)
    return pattern


class Rules:
    """The rules for one task: ``refusal(rel, ...)`` -> a category, or None (the path crosses)."""

    def __init__(self, *, solution_paths: Sequence[str] = (), protected: Iterable[str] = (),
                 package_dirs: Iterable[str] = ()):
        self.solution = [glob_regex(p) for p in solution_paths]
        self.explicit = bool(solution_paths)
        self.protected = frozenset(protected)
        # ancestors of protected paths: a policy *file* there would block a hidden directory
        self.protected_dirs = frozenset(p.rsplit("/", k)[0] for p in self.protected
                                        for k in range(1, p.count("/") + 1))
        self.package_dirs = set(package_dirs)  # directories holding an __init__.py (regular packages)

    def in_solution(self, rel: str) -> bool:
        return any(rx.fullmatch(rel) for rx in self.solution)

    def refusal(self, rel: str, *, new: bool, is_dir: bool = False) -> str | None:
        """Why the policy's ``rel`` (a file, or with ``is_dir`` a directory it made where the task
        has a file) does not cross, or None. ``new``: the task's own tree has nothing there."""
        parts = rel.split("/")
        if parts[0] in VCS_DIRS:
            return IGNORED
        if is_runner_config(rel) and not is_dir:
            return "runner_config"
        if is_bytecode(rel):
            return "bytecode"
        if new and self._shadows(parts, is_dir):
            return "shadowing"
        if rel in self.protected or rel in self.protected_dirs or any(
                rel.startswith(p + "/") for p in self.protected):
            return "protected"
        if self.explicit:
            return None if self.in_solution(rel) or (is_dir and self._solution_below(rel)) else \
                "outside_solution_paths"
        if not is_dir and is_test_file(rel):
            return "test_file"
        return None

    def _solution_below(self, rel: str) -> bool:
        return any(rx.fullmatch(rel + "/x") for rx in self.solution)

    def _shadows(self, parts: list[str], is_dir: bool) -> bool:
        """A path component that defines a shadowing name in a directory that may be on sys.path:
        a module file, or a regular package (a directory without ``__init__.py`` is a namespace
        portion, which never wins over a module of the same name elsewhere on the path)."""
        names = shadowed_names()
        for k, comp in enumerate(parts):
            if "/".join(parts[:k]) in self.package_dirs:
                continue  # inside a regular package: pkg.json, not json
            if k == len(parts) - 1 and not is_dir:
                name = module_name(comp, is_dir=False)
            elif "/".join(parts[:k + 1]) in self.package_dirs:
                name = module_name(comp, is_dir=True)
            else:
                continue
            if name in names:
                return True
        return False


def command_files(command: str, shipped: Iterable[str]) -> set[str]:
    """Shipped files a grader command names (``bash run_tests.sh``, ``python3 ./check.py``,
    ``make`` -> the Makefile): the command runs them, so they are protected."""
    shipped = set(shipped)
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so; split on whitespace here
        tokens = command.split()
    out = set()
    for tok in tokens:
        for t in (tok, tok[2:] if tok.startswith("./") else tok):
            if t in shipped:
                out.add(t)
    if any(t == "make" or t.endswith("/make") for t in tokens):
        out |= {m for m in ("Makefile", "makefile", "GNUmakefile") if m in shipped}
    return out


def test_file_of(test_id: str) -> str:
    """The file of a pytest id (``tests/test_x.py::TestA::test_b[1]`` -> ``tests/test_x.py``)."""
    return test_id.split("::", 1)[0].rstrip("/")
