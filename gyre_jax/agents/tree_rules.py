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
  protected      the task's hidden grader files, the files of the tests it names
                 (``fail_to_pass``/``pass_to_pass``), shipped files its grader command names
                 (``bash run_tests.sh``) and, when the command runs ``make``, every makefile name
                 (a new ``GNUmakefile`` or ``makefile`` would win over the task's ``Makefile``):
                 the graded tree always has the task's version; a policy path equal to one,
                 inside one or holding one (a file where a hidden directory goes) is not carried.
                 So is the import layout of protected Python files: an ``__init__.py`` the policy
                 adds or deletes in their directory or any directory above it (it changes the
                 name they are imported under and what is on ``sys.path``: checked after
                 shadowing).
  shadowing      a new module or package whose name is one of the standard library's, a test
                 tool's (pytest, pluggy, unittest, ...), gyre's grading modules', an installed
                 package's (this interpreter's and the graders' ``ro_paths`` environments') or
                 one the task's protected files define (a hidden ``tests/helpers.py`` or
                 ``grader/`` package: a policy package ``tests/helpers/`` would win the import
                 over the hidden module beside it), in a directory that can be on ``sys.path``:
                 any directory except one inside a regular package the task itself ships
                 (``pkg/json.py`` is ``pkg.json``; so is a package the policy makes inside one);
                 a directory holding protected files is on the path whatever its ``__init__.py``
                 says (a script's own directory, pytest's and unittest's start directories), and
                 an ``__init__.py`` the policy adds to a top-level directory never makes it a
                 package for this rule (``PYTHONPATH=src`` puts it on the path). Never carried.
                 Changes to a module the task itself ships under such a name are ordinary files.
  test_file      (default solution paths only) a test file a runner discovers by name
                 (``test*.py``, ``*_test.py``): the policy's new or changed tests would run
                 inside the grader's session. Carried only where ``solution_paths`` names it.
  outside_solution_paths  with ``solution_paths`` set, anything its globs do not match.
  over_limit     (``graded_tree``) new or changed files past ``MAX_CHANGED_FILES``: laying them
                 costs the grader time the policy would otherwise control.
  vcs            the policy's ``.git`` changes (commits, hooks): ignored, not audited.

Default solution paths (``solution_paths`` unset): every other path, i.e. the files the task
ships and new files, minus the categories above.
"""
from __future__ import annotations

import functools
import glob
import os
import posixpath
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
CATEGORIES = ("runner_config", "bytecode", "shadowing", "protected", "test_file", "outside_solution_paths",
              "over_limit")
# Tools whose own configuration files decide what a grader command that runs them does: where the
# command runs one, those names are protected wherever they are (a new one is refused too).
MAKEFILE_NAMES = ("GNUmakefile", "makefile", "Makefile")
TOOL_FILES = {"make": MAKEFILE_NAMES, "gmake": MAKEFILE_NAMES}
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
    return frozenset(names | _listed_names(d for d in sys.path if d and os.path.isabs(d) and "-packages" in d))


@functools.lru_cache(maxsize=64)
def installed_names(roots: tuple[str, ...]) -> frozenset[str]:
    """Top-level names installed in the Python environments under ``roots`` (a grader's ``ro_paths``:
    a venv or prefix whose ``python3`` a graded command runs, with packages this interpreter lacks)."""
    dirs = []
    for root in roots:
        for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                        "lib64/python3*/site-packages"):
            dirs += glob.glob(os.path.join(glob.escape(root), pattern))
        if os.path.basename(root.rstrip("/")) in ("site-packages", "dist-packages"):
            dirs.append(root)
    return _listed_names(dirs)


def _listed_names(dirs: Iterable[str]) -> frozenset[str]:
    names = set()
    for d in dirs:
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


def defined_names(paths: Iterable[str]) -> frozenset[str]:
    """The importable names the components of ``paths`` define (``tests/helpers.py`` -> tests,
    helpers): a protected file's own name and its directories' must not be shadowed."""
    out = set()
    for rel in paths:
        parts = rel.split("/")
        for k, comp in enumerate(parts):
            name = module_name(comp, is_dir=k < len(parts) - 1)
            if name and name != "__init__":
                out.add(name)
    return frozenset(out)


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
    """The rules for one task: ``refusal(rel, ...)`` -> a category, or None (the path crosses).

    ``package_dirs``: directories holding an ``__init__.py`` in the tree as it would be (the
    task's and the policy's: a regular package shadows as one); ``base_packages``: those the task
    itself ships (only inside one of these is a module not on ``sys.path``); ``names``: names
    that must not be shadowed beyond :func:`shadowed_names` (installed in the graders'
    environments)."""

    def __init__(self, *, solution_paths: Sequence[str] = (), protected: Iterable[str] = (),
                 package_dirs: Iterable[str] = (), base_packages: Iterable[str] = (), names: Iterable[str] = (),
                 protected_names: Iterable[str] = ()):
        self.solution = [glob_regex(p) for p in solution_paths]
        self.explicit = bool(solution_paths)
        self.protected = frozenset(protected)
        self.protected_names = frozenset(protected_names)  # file names protected wherever they are (makefiles)
        # ancestors of protected paths: a policy *file* there would block a hidden directory
        self.protected_dirs = frozenset(p.rsplit("/", k)[0] for p in self.protected
                                        for k in range(1, p.count("/") + 1))
        self.package_dirs = set(package_dirs)
        self.base_packages = set(base_packages) - {""}
        py = [p for p in self.protected if p.endswith(".py")]
        # directories a protected Python file is imported from, and every one above it (its import layout)
        self.layout_dirs = frozenset({""} | {p.rsplit("/", k)[0] for p in py for k in range(1, p.count("/") + 1)})
        # directories that are on sys.path whatever their __init__.py: where protected files are run from
        self.path_dirs = frozenset({""} | {p.rsplit("/", 1)[0] if "/" in p else "" for p in self.protected})
        self.names = frozenset(names) | defined_names(self.protected)

    def in_solution(self, rel: str) -> bool:
        return any(rx.fullmatch(rel) for rx in self.solution)

    def refusal(self, rel: str, *, new: bool, is_dir: bool = False, deleted: bool = False) -> str | None:
        """Why the policy's ``rel`` (a file, or with ``is_dir`` a directory it made where the task
        has a file) does not cross, or None. ``new``: the task's own tree has nothing there;
        ``deleted``: the policy removed the task's file."""
        parts = rel.split("/")
        if parts[0] in VCS_DIRS:
            return IGNORED
        if is_runner_config(rel) and not is_dir:
            return "runner_config"
        if is_bytecode(rel):
            return "bytecode"
        if rel in self.protected or rel in self.protected_dirs or any(
                rel.startswith(p + "/") for p in self.protected) or parts[-1] in self.protected_names:
            return "protected"
        if new and self._shadows(parts, is_dir):
            return "shadowing"
        if self._layout(parts, new or deleted, is_dir):
            return "protected"
        if self.explicit:
            return None if self.in_solution(rel) or (is_dir and self._solution_below(rel)) else \
                "outside_solution_paths"
        if not is_dir and is_test_file(rel):
            return "test_file"
        return None

    def _layout(self, parts: list[str], added_or_removed: bool, is_dir: bool) -> bool:
        """An ``__init__.py`` added or removed where it changes how a protected Python file is imported."""
        return not is_dir and added_or_removed and parts[-1] == "__init__.py" and "/".join(parts[:-1]) in self.layout_dirs

    def _in_package(self, d: str) -> bool:
        """``d`` is a regular package the task ships, or one the policy made inside such a package
        (a top-level directory the policy made a package can be on ``sys.path``: a grader's
        ``PYTHONPATH=src``)."""
        while d in self.package_dirs:
            if d in self.base_packages:
                return True
            if "/" not in d:
                return False
            d = d.rsplit("/", 1)[0]
        return False

    def _solution_below(self, rel: str) -> bool:
        return any(rx.fullmatch(rel + "/x") for rx in self.solution)

    def _shadows(self, parts: list[str], is_dir: bool) -> bool:
        """A path component that defines a shadowing name in a directory that may be on sys.path:
        a module file, or a regular package the task does not ship (a directory without
        ``__init__.py`` is a namespace portion, which never wins over a module of the same name
        elsewhere on the path)."""
        names = shadowed_names()
        for k, comp in enumerate(parts):
            parent, here = "/".join(parts[:k]), "/".join(parts[:k + 1])
            if parent not in self.path_dirs and self._in_package(parent):
                continue  # inside a package the task ships: pkg.json, not json
            if k == len(parts) - 1 and not is_dir:
                name = module_name(comp, is_dir=False)
            elif here in self.package_dirs and here not in self.base_packages:
                name = module_name(comp, is_dir=True)
            else:
                continue
            if name is not None and (name in names or name in self.names):
                return True
        return False


def command_files(command: str, shipped: Iterable[str]) -> set[str]:
    """Shipped files a grader command names (``bash run_tests.sh``, ``python3 ./check.py``,
    ``cd scripts && bash run.sh``, ``make`` -> the Makefile): the command runs them, so they are
    protected."""
    shipped = set(shipped)
    tokens = _tokens(command)
    # the directories the command changes to (``cd DIR``, ``make -C DIR``): a name there is DIR/name
    dirs = [""] + [posixpath.normpath(b.removeprefix("./")) for a, b in zip(tokens, tokens[1:])
                   if a in ("cd", "pushd", "-C", "--directory") and not b.startswith(("/", "-", "$", "~"))]
    out = set()
    for tok in tokens:
        t = tok[2:] if tok.startswith("./") else tok
        for d in dirs:
            path = posixpath.normpath(posixpath.join(d, t)) if d else t
            if path in shipped:
                out.add(path)
    return out


def command_tool_names(command: str) -> frozenset[str]:
    """File names protected wherever they are because the grader command runs a tool that reads
    them as its configuration (``TOOL_FILES``: ``make`` anywhere in it, quoted or not)."""
    words = set(re.findall(r"[A-Za-z0-9_.+-]+", command))
    return frozenset(n for tool, names in TOOL_FILES.items() if tool in words for n in names)


def _tokens(command: str) -> list[str]:
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so; split on whitespace here
        return command.split()


def test_file_of(test_id: str) -> str:
    """The file of a pytest id (``tests/test_x.py::TestA::test_b[1]`` -> ``tests/test_x.py``)."""
    return test_id.split("::", 1)[0].rstrip("/")
