"""Where a grader runs graded code: the sandbox, the environment, and what it can see.

Graders run agent code confined as the rollout's commands were (``GYRE_GRADER_SANDBOX``, set by
``graders.run_grader`` from the rollout's sandbox; unset: kind none, a plain subprocess). A
graded command sees:

  /workspace      the graded tree (``graded_tree``), writable, its working directory; the
                  task's hidden files and the shipped files its command runs bound read-only
                  over it (they can be read, not changed, moved or deleted)
  /tmp            a private tmpfs; HOME=/tmp
  read-only       the system dirs (/usr, /etc, /bin, /lib...), the run's Python installation
                  (the venv and the interpreter it was made from: ``python3`` is the run's
                  interpreter, with whatever it has installed, pytest included), and the paths
                  of the task's ``grader.ro_paths`` and the run's ``config.task.grader_ro_paths``
  PATH            the ``bin`` of each of those paths (the task's, the run's, then the run's
                  Python: an environment a task brings is the ``python3`` it grades with),
                  then /usr/local/bin:/usr/bin:/bin
  environment     only PATH, HOME, LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1, PYTHONNOUSERSITE=1,
                  GYRE_WORKSPACE=/workspace, and the verdict mode's own (GYRE_VERDICT); the
                  ``__pycache__`` of every directory holding a protected Python file is an empty
                  read-only directory (graded code cannot plant bytecode for a hidden module)
  no network, rlimits and a memory cgroup as the rollout's commands had; as root, a fresh uid.

Container kinds (docker, podman) get the tree, the environment and the limits, but no inherited
descriptor: the per-test verdict and ``$GYRE_VERDICT`` need the bubblewrap (or none) grader
sandbox for now (exit-code and ``calls`` verdicts work in both).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from gyre_jax.agents import sandbox as sb

GRADER_PATH_TAIL = ("/usr/local/bin", "/usr/bin", "/bin")


@dataclasses.dataclass(frozen=True)
class GraderLaunch:
    """How to start one graded command: ``argv`` and the Popen ``env`` (inside bubblewrap the
    command's environment is set by bwrap: the Popen one is the host's minimum)."""
    argv: list[str]
    env: dict[str, str]
    kind: str


def spec() -> dict:
    """The grader sandbox the trainer asked for (``GYRE_GRADER_SANDBOX``)."""
    return json.loads(os.environ.get(sb.GRADER_SANDBOX_ENV) or '{"kind": "none"}')


def python_paths() -> tuple[str, ...]:
    """The run's Python installation (the venv and the interpreter it was made from)."""
    paths: list[str] = []
    for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        p = os.path.realpath(p)
        if p not in paths and p != "/" and not any(p == s or p.startswith(s + "/") for s in sb.SYSTEM_DIRS):
            paths.append(p)
    return tuple(paths)


def ro_paths(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """Read-only host paths of a graded command, in PATH order: the task's ``grader.ro_paths``, the
    run's ``config.task.grader_ro_paths``, then the run's Python (a task that brings an environment
    with its own ``python3`` grades with it)."""
    return tuple(dict.fromkeys((*extra, *spec().get("ro_paths", ()), *python_paths())))


def environment(paths: Sequence[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    bins = [os.path.join(p, "bin") for p in paths if os.path.isdir(os.path.join(p, "bin"))]
    return {"PATH": os.pathsep.join([*bins, *GRADER_PATH_TAIL]), "HOME": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "GYRE_WORKSPACE": sb.WORKSPACE_MOUNT,
            **(extra or {})}


@contextlib.contextmanager
def launch(workspace: str | os.PathLike, argv: list[str], *, writable: bool, extra_ro_paths: Sequence[str] = (),
           read_only: Sequence[str] = (), binds: Sequence[tuple[str, str, str]] = (),
           env: Mapping[str, str] | None = None) -> Iterator[GraderLaunch]:
    """Run ``argv`` on graded code in ``workspace`` (with cwd = ``workspace``): see the module
    docstring. ``read_only``: workspace-relative paths bound read-only over the writable tree;
    ``binds``: extra (option, host path, sandbox path) binds (the verdict plugin's directory);
    ``env``: variables on top of the grader environment. Pass open file descriptors with
    Popen's ``pass_fds``: they reach the command (not in container kinds)."""
    s = spec()
    kind = s["kind"]
    limits = sb.SandboxLimits(**s.get("limits", {}))
    workspace = str(Path(workspace).resolve())
    paths = ro_paths(extra_ro_paths)
    full_env = environment(paths, env)
    if kind == "none":
        for rel in read_only:  # no mounts without a sandbox: a mode, which graded code could undo
            p = os.path.join(workspace, rel)
            if os.path.isfile(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) & ~0o222)
        yield GraderLaunch(list(argv), {**os.environ, **full_env}, kind)
        return
    if kind == "bubblewrap":
        with _bubblewrap(workspace, argv, writable=writable, limits=limits, paths=paths, read_only=read_only,
                         binds=binds, env=full_env, seccomp=s.get("seccomp", True)) as a:
            yield GraderLaunch(a, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, kind)
        return
    if kind in ("docker", "podman"):
        yield GraderLaunch(_container(kind, workspace, argv, writable=writable, limits=limits, env=full_env,
                                      image=s.get("image")), dict(os.environ), kind)
        return
    raise ValueError(f"{sb.GRADER_SANDBOX_ENV}: unknown sandbox kind {kind!r}")


@contextlib.contextmanager
def _bubblewrap(workspace: str, argv: list[str], *, writable: bool, limits: sb.SandboxLimits, paths, read_only,
                binds, env: Mapping[str, str], seccomp: bool) -> Iterator[list[str]]:
    if not seccomp:
        sb.note_seccomp_refused("refused (found by the trainer)")
    uid = sb.take_uid() if os.geteuid() == 0 else None
    cap = None
    empty = tempfile.mkdtemp(prefix="gyre-empty-")
    os.chmod(empty, 0o555)
    try:
        if uid is not None and writable:  # the fresh uid owns the tree it may write
            for dirpath, dirnames, files in os.walk(workspace):
                for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + files)]:
                    os.lchown(name, uid, uid)
        bind = "--bind" if writable else "--ro-bind"
        overlays = tuple(("--ro-bind", os.path.join(workspace, rel), f"{sb.WORKSPACE_MOUNT}/{rel}")
                         for rel in read_only if os.path.lexists(os.path.join(workspace, rel)))
        # no bytecode can be planted beside a protected module: its __pycache__ is empty and read-only
        pydirs = sorted({os.path.dirname(rel) for rel in read_only if rel.endswith(".py")})
        overlays += tuple(("--ro-bind", empty, f"{sb.WORKSPACE_MOUNT}/{d + '/' if d else ''}__pycache__") for d in pydirs)
        nproc = limits.processes if uid is not None else sb.processes_of(os.getuid()) + limits.processes
        cap, why = sb.make_cap(limits.cap_bytes, limits.processes)  # the grader's own, per command
        if cap is None:
            sb.warn_no_cgroup(why)
        inner = sb.bwrap_argv(network=False, uid=uid, tmp_bytes=limits.tmp_bytes, extra_ro_paths=paths, env=env,
                              binds=((bind, workspace, sb.WORKSPACE_MOUNT), *binds), overlays=overlays,
                              deny_shared_memory=cap is None)
        inner += sb.limited_shell(limits, nproc, list(argv))
        yield cap.wrap(inner) if cap is not None else inner
    finally:
        if cap is not None:
            cap.release()
        if uid is not None:
            sb.give_uid(uid)
        os.rmdir(empty)


def _container(kind: str, workspace: str, argv: list[str], *, writable: bool, limits: sb.SandboxLimits,
               env: Mapping[str, str], image: str | None) -> list[str]:
    user = "65534:65534" if not writable else f"{os.getuid()}:{os.getgid()}"
    envs = [a for k, v in env.items() if k != "PATH" for a in ("--env", f"{k}={v}")]
    return [kind, "run", "--rm", "--init", "-i", "--network", "none", "--read-only",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={limits.tmp_bytes},mode=1777",
            "--volume", f"{workspace}:{sb.WORKSPACE_MOUNT}:{'rw' if writable else 'ro'}", "--workdir",
            sb.WORKSPACE_MOUNT, "--user", user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--pids-limit", str(limits.processes), "--memory", str(limits.memory_bytes),
            "--ulimit", f"cpu={limits.cpu_s}:{limits.cpu_s}", *envs,
            image or sb.SandboxConfig().default_image, *argv]


@contextlib.contextmanager
def untrusted_command(workspace: str | os.PathLike, argv: list[str], *, writable: bool) -> Iterator[list[str]]:
    """The argv of :func:`launch` (callers that set their own Popen environment)."""
    with launch(workspace, argv, writable=writable) as a:
        yield a.argv


@contextlib.contextmanager
def untrusted_python(workspace: str | os.PathLike, script: str | os.PathLike) -> Iterator[list[str]]:
    """The argv that runs the standard-library-only ``script`` (``python3 -I -c SOURCE``: the
    source travels in the argv, no file of ours is mounted) on agent code in ``workspace``,
    read-only, no network. Run it with cwd = ``workspace``; stdin and stdout are its channel."""
    source = Path(script).read_text()
    if spec()["kind"] == "none":
        yield [sys.executable, "-I", "-B", "-c", source]
        return
    with untrusted_command(workspace, ["python3", "-I", "-B", "-c", source], writable=False) as argv:
        yield argv
