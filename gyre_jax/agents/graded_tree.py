"""The tree a grader sees: the task's own files, the policy's changes where allowed, hidden files last.

``build_graded_tree(task, snapshot, dest)`` never starts from the workspace. It lays, in order:

  1. the task's own tree (``repo``, checked out at ``repo_commit`` if set, then ``setup_files``),
     without any bytecode; cached per task content under ``cache_dir`` when given;
  2. what the policy changed (files new or different in the snapshot, files it deleted), one
     path at a time, where ``tree_rules.Rules.refusal`` allows it; nothing is followed (no
     symlink of the task's or the policy's is ever written through);
  3. the task's hidden files (``Task.hidden_files``), over anything in their way.

It returns the audit: paths carried and deleted, and by category the policy's paths that were
refused (``tree_rules.CATEGORIES``), with a few examples each. A file the policy left as the
task shipped it is not a write, whatever its category (the task's own ``conftest.py``).

What laying the policy's changes costs is bounded by the policy's own tree, never by the grader's
time limit: files are copied sparse (a file of holes stays one: a workspace of 128 MiB sparse files
must not become gigabytes written in the grader's time), and at most ``MAX_CHANGED_FILES`` new or
changed files are carried (the rest are refused, ``over_limit``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Any

from gyre_jax.agents.sparse_copy import copy_extents
from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tree_rules import (
    CATEGORIES,
    IGNORED,
    Rules,
    command_files,
    command_tool_names,
    installed_names,
    test_file_of,
)

EXAMPLES_PER_CATEGORY = 5
# The policy's new or changed files laid into a graded tree at most (an honest change is a few files; a
# workspace of 65536 empty files took the grader past its time limit, a verifier error instead of a 0).
MAX_CHANGED_FILES = 10_000
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1"}


def copy_repo(repo: str, commit: str, dest: Path) -> None:
    """``repo`` (a local directory, or with ``commit`` a local git repository checked out at it)
    into the existing, empty ``dest``. ``safe.directory``: as root the destination may belong
    to a rollout's uid, and git refuses a repository someone else owns ("dubious ownership")."""
    if commit:
        safe = ["-c", f"safe.directory={dest}", "-c", f"safe.directory={repo}", "-c", "safe.directory=*"]
        for argv in (["git", *safe, "clone", "--quiet", "--no-hardlinks", "--no-checkout", repo, str(dest)],
                     ["git", *safe, "-C", str(dest), "checkout", "--quiet", "--detach", commit]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **_GIT_ENV})
            if r.returncode != 0:
                raise RuntimeError(f"copying repo {repo}@{commit}: {' '.join(argv[3:6])} failed: {r.stderr[-500:]}")
        return
    shutil.copytree(repo, dest, symlinks=True, dirs_exist_ok=True)


def lay_files(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` under ``root``, replacing whatever is in the way (files, symlinks or
    directories at a path or its parents): never writing through a symlink."""
    for rel, content in files.items():
        path = _make_parents(root, rel.split("/"))
        _remove(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(content)


def build_base(task: Task, dest: Path) -> None:
    """The task's own tree in the (new or empty) ``dest``: repo, files, no bytecode."""
    dest.mkdir(parents=True, exist_ok=True)
    if task.repo:
        copy_repo(task.repo, task.repo_commit, dest)
    lay_files(dest, dict(task.setup_files))
    _drop_bytecode(dest)


def base_key(task: Task) -> str:
    """What the task's own tree is made of: its repo (and commit, or for a plain directory the
    listing with sizes and times) and its files."""
    h = hashlib.sha256(json.dumps([task.repo, task.repo_commit, sorted(task.setup_files.items())]).encode())
    if task.repo and not task.repo_commit:
        for dirpath, dirnames, files in os.walk(task.repo):
            dirnames.sort()
            for name in sorted(files):
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                h.update(f"{os.path.relpath(os.path.join(dirpath, name), task.repo)}\0{st.st_size}\0"
                         f"{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def cached_base(task: Task, cache_dir: Path) -> Path:
    """The task's own tree, built once under ``cache_dir`` (atomically: concurrent graders of one
    task race harmlessly) and read-only from then on."""
    final = cache_dir / base_key(task)
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{uuid.uuid4().hex}"
    try:
        build_base(task, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another grader built it first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def protected_paths(task: Task) -> set[str]:
    """Paths whose content always comes from the task: hidden files, the files of the tests it
    names, shipped files its grader command runs (``tree_rules`` says why)."""
    p = task.params
    out = set(task.hidden_files)
    for key in ("fail_to_pass", "pass_to_pass"):
        out |= {test_file_of(t) for t in p.get(key, ())}
    return out


def protection(task: Task, shipped) -> tuple[set[str], frozenset[str]]:
    """(protected paths, file names protected wherever they are) of ``task``, whose own tree holds
    the files ``shipped``: ``protected_paths``, the shipped files its grader command runs and the
    configuration of the tools it runs (``tree_rules.command_tool_names``)."""
    command = str(task.params.get("grader_command", ""))
    return protected_paths(task) | command_files(command, shipped), command_tool_names(command)


def task_rules(task: Task, base: dict[str, str], snap: dict[str, str] | None = None) -> Rules:
    """The rules for ``task`` whose own tree is the listing ``base`` (``listing``), the policy's
    tree ``snap``."""
    from gyre_jax.agents import grader_sandbox

    shipped = [r for r, k in base.items() if k == "file"]
    protected, names = protection(task, shipped)
    def packages(listing):
        return {r.rsplit("/", 1)[0] if "/" in r else "" for r, k in listing.items()
                if k == "file" and r.rsplit("/", 1)[-1] == "__init__.py"} - {""}
    envs = installed_names(grader_sandbox.ro_paths(task.params.get("grader_ro_paths", ())))
    return Rules(solution_paths=task.solution_paths, protected=protected, protected_names=names,
                 package_dirs=packages({**base, **(snap or {})}), base_packages=packages(base), names=envs)


def build_graded_tree(task: Task, snapshot: str | os.PathLike, dest: str | os.PathLike, *,
                      cache_dir: str | os.PathLike | None = None, carry_deletions: bool = True) -> dict[str, Any]:
    """Lay the graded tree in ``dest`` (must not exist); returns the audit (module docstring).
    ``carry_deletions=False``: the snapshot was truncated, so a missing file is not a deletion."""
    snapshot, dest = Path(snapshot), Path(dest)
    if cache_dir is not None:
        shutil.copytree(cached_base(task, Path(cache_dir)), dest, symlinks=True)
    else:
        build_base(task, dest)
    base = listing(dest)
    snap = listing(snapshot)
    rules = task_rules(task, base, snap)
    audit = _Audit(str(dest), str(snapshot), {r for r, k in base.items() if k == "dir"})
    for rel in sorted(r for r, k in base.items() if k == "file" and snap.get(r) != "file"):
        if carry_deletions or snap.get(rel) == "dir":  # a directory where the file was is a change
            audit.delete(rel, rules)
    for rel in sorted(r for r, k in snap.items() if k == "file"):
        audit.carry(rel, rules, base)
    lay_files(dest, dict(task.hidden_files))
    return audit.to_dict()


class _Audit:
    def __init__(self, dest: str, snapshot: str, dirs: set[str]):
        self.dest, self.snapshot = dest, snapshot
        self.dirs = dirs  # relative paths known to be real directories in dest (no lstat per file)
        self.carried = self.deleted = 0
        self.refused = dict.fromkeys(CATEGORIES, 0)
        self.examples: dict[str, list[str]] = {c: [] for c in CATEGORIES}

    def refuse(self, category: str, rel: str) -> None:
        if category == IGNORED:
            return
        self.refused[category] += 1
        if len(self.examples[category]) < EXAMPLES_PER_CATEGORY:
            self.examples[category].append(rel)

    def delete(self, rel: str, rules: Rules) -> None:
        why = rules.refusal(rel, new=False, deleted=True)
        if why is not None:
            return self.refuse(why, rel)
        _remove(Path(self.dest, rel))
        self.deleted += 1

    def carry(self, rel: str, rules: Rules, base: dict[str, str]) -> None:
        src, dst, base_kind = os.path.join(self.snapshot, rel), os.path.join(self.dest, rel), base.get(rel)
        if base_kind == "file" and _same_file(src, dst):
            return  # as the task shipped it: not a write
        why = rules.refusal(rel, new=base_kind is None)
        if why is None and base_kind == "dir":  # the policy's file where the task has a directory
            why = next((w for r, k in base.items() if k == "file" and r.startswith(rel + "/")
                        for w in [rules.refusal(r, new=False, deleted=True)] if w is not None), None)
        if why is None:
            why = self._blocked_parent(rel, rules)
        if why is None and self.carried >= MAX_CHANGED_FILES:
            why = "over_limit"
        if why is not None:
            return self.refuse(why, rel)
        self._make_parents(rel)
        mode = 0o644
        if base_kind is not None:
            try:
                st = os.lstat(dst)
                if stat.S_ISREG(st.st_mode):
                    mode = stat.S_IMODE(st.st_mode)  # the task's executable bit stays
            except FileNotFoundError:
                pass
            _remove(Path(dst))
        _copy_into(src, dst, mode)
        self.carried += 1

    def _blocked_parent(self, rel: str, rules: Rules) -> str | None:
        """Why a parent of ``rel`` that is not a directory in the tree (a file or symlink the
        task ships) may not be replaced by the policy's directory, or None."""
        parts = rel.split("/")
        for k in range(1, len(parts)):
            prefix = "/".join(parts[:k])
            if prefix in self.dirs:
                continue
            try:
                st = os.lstat(os.path.join(self.dest, prefix))
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return rules.refusal(prefix, new=False, is_dir=True)
            self.dirs.add(prefix)
        return None

    def _make_parents(self, rel: str) -> None:
        parts = rel.split("/")
        for k in range(1, len(parts)):
            prefix = "/".join(parts[:k])
            if prefix not in self.dirs:
                _make_parents(Path(self.dest), parts[:k] + ["x"])
                self.dirs.add(prefix)

    def to_dict(self) -> dict[str, Any]:
        return {"carried": self.carried, "deleted": self.deleted, "refused": dict(self.refused),
                "examples": {c: v for c, v in self.examples.items() if v}}


def listing(root: Path) -> dict[str, str]:
    """Relative path -> 'file' | 'dir' | 'link' (anything else is skipped), nothing followed."""
    out: dict[str, str] = {}
    stack = [("", root)]
    while stack:
        rel, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            if e.is_symlink():
                out[r] = "link"
            elif e.is_dir(follow_symlinks=False):
                out[r] = "dir"
                stack.append((r, Path(e.path)))
            elif e.is_file(follow_symlinks=False):
                out[r] = "file"
    return out


def _make_parents(root: Path, parts: list[str]) -> Path:
    """``root/parts[:-1]`` as real directories (a file or symlink in the way is removed); the
    final path, not created."""
    cur = root
    for comp in parts[:-1]:
        cur = cur / comp
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(cur)
            os.mkdir(cur, 0o755)
    return cur / parts[-1]


def _remove(path: Path) -> None:
    """Whatever is at ``path`` (a directory recursively, a symlink itself), if anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except FileNotFoundError:
        return False
    if not (stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode)) or sa.st_size != sb.st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def _copy_into(src: str, dst: str, mode: int) -> None:
    """Copy the regular file ``src`` to the new ``dst``, sparse: only its data extents are written
    (a file of holes stays one), nothing followed."""
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            size = os.fstat(fd_in).st_size
            copy_extents(fd_in, fd_out, size, size)
            os.ftruncate(fd_out, size)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _drop_bytecode(root: Path) -> None:
    """The task's own ``__pycache__`` and ``.pyc``: stale bytecode would run instead of the
    policy's source (its compiled extension modules stay: the task ships them)."""
    for rel, kind in listing(root).items():
        name = rel.rsplit("/", 1)[-1]
        if name == "__pycache__" if kind == "dir" else kind == "file" and name.endswith((".pyc", ".pyo")):
            _remove(root / rel)
