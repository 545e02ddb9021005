"""Harbor task directories as gyre tasks (format ``harbor``).

A task directory (Harbor's ``TaskConfig``, schema 1.x)::

    task.toml            [task] [metadata] [verifier] [agent] [environment] [solution], source
    instruction.md       the instruction: what the agent is told
    tests/test.sh        the verifier: runs in the finished environment, writes the reward (a number in
                         [0, 1]) to /logs/verifier/reward.txt (or {"reward": x} to reward.json)
    tests/...            the files test.sh uses (hidden from the agent)
    solution/solve.sh    optional: the reference solution (``--check_tasks`` runs it: it must score 1)
    environment/Dockerfile   the environment (or [environment] docker_image)

A task set is a task directory, or a directory of them (its subdirectories holding ``task.toml``).

What is honoured, field by field (anything else in task.toml is refused with a message naming it):

  version / schema_version   1.x
  [task] name, description, authors, keywords; [metadata]; source   -> the task's metadata
                             ([metadata] split = "eval" puts a task in the held-out set: a gyre extension
                             Harbor ignores; default train)
  [verifier] timeout_sec     -> the grader's timeout;  env -> exported for test.sh
  [agent] timeout_sec        -> the rollout's deadline
  [solution] env             -> exported for solve.sh
  [environment] cpus, memory_mb, storage_mb (and the old memory, storage)   accepted: the run's sandbox
                             limits apply (config.harness.memory_bytes ...), recorded in metadata.harbor
  network_mode / allow_internet / allowed_hosts (any section)   "no-network" (or allow_internet = false)
                             only: rollouts and graders have no network; an explicit request for it is
                             refused. Left out, the task runs without network as well (Harbor's default
                             is public: a test.sh that installs packages from the internet fails here).
  user (verifier, agent)     refused when set: gyre runs both as the sandbox's own user
  gpus > 0, gpu_types, mcp_servers, env ([environment]), skills_dir, healthcheck, [[steps]]   refused

The environment (``options.environment``):

  docker (default)  the task's Dockerfile or docker_image is its environment. gyre does not build
                    per-task images: where docker cannot run (no CLI, or no daemon answering) the task is
                    refused naming environment/Dockerfile, why, and this option; where it can, it is
                    refused saying that per-task images are not supported yet (one image per family:
                    harness.sandbox=docker)
  host              the task runs in gyre's rollout sandbox on this host's toolchain (/usr, the run's
                    Python). From the Dockerfile, WORKDIR and COPY/ADD of local files are honoured (the
                    files land in the workspace; WORKDIR is /workspace); every other instruction (RUN,
                    ENV, FROM's packages ...) is not run, and each task lists them in
                    metadata.harbor.skipped_instructions. Choose it for tasks whose tests need only
                    what the host has.

How a Harbor task runs here: the workspace is /workspace (Harbor's WORKDIR, e.g. /app, is rewritten to
it in the instruction and the test and solution files), the verifier's files are hidden grader files
under ``tests/`` of the graded tree (read-only to graded code), ``/tests`` is rewritten to
``/workspace/tests`` and ``/logs`` to a directory private to the grader (/tmp/gyre-harbor/logs). The grader
command runs test.sh (without the verdict's descriptor: neither it nor the code it runs can write the
verdict), then reads its reward file: a non-zero exit of test.sh scores 0 whatever it wrote, no reward
file is a grader fault (``--check_tasks`` names it), a reward outside [0, 1] too. Harbor's reward file is
written by a script that runs the graded code, in the same sandbox: a test.sh that imports the agent's
code (pytest on it) can be forged by that code, and ``--check_tasks``' forgery probe refuses such a task;
write the checks to run agent code in processes of their own and compare what they print (as
examples/harbor/fix-add does), or use the SWE-bench format's per-test verdict for pytest suites. Grading goes
through gyre's clean graded tree like every task (``tasks/dataset.py``): what the policy changed is laid
on the task's own files, never the other way round.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

from gyre_jax.agents.tasks.base import Task
from gyre_jax.agents.tasks.dataset import TaskFileError, parse_line
from gyre_jax.agents.tasks.formats.registry import TASK_FORMATS

ENVIRONMENTS = ("docker", "host")
TOP_FIELDS = ("version", "schema_version", "task", "metadata", "verifier", "agent", "environment", "solution",
              "source")
TASK_FIELDS = ("name", "description", "authors", "keywords")
VERIFIER_FIELDS = ("timeout_sec", "env", "user", "network_mode", "allowed_hosts")
AGENT_FIELDS = ("timeout_sec", "user", "network_mode", "allowed_hosts")
SOLUTION_FIELDS = ("env",)
ENV_FIELDS = ("build_timeout_sec", "docker_image", "cpus", "memory_mb", "storage_mb", "memory", "storage", "gpus",
              "gpu_types", "allow_internet", "network_mode", "allowed_hosts", "mcp_servers", "env", "skills_dir",
              "healthcheck")
LOGS = "/tmp/gyre-harbor/logs"  # where /logs goes: the grader's private /tmp
SOLUTION_DIR = "/tmp/gyre-harbor/solution"
MAX_FILE_BYTES = 8 << 20
_DOCKER_COPY = re.compile(r"^(COPY|ADD)\s+(.*)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    environment: str = "docker"  # docker | host (module docstring)

    def __post_init__(self):
        if self.environment not in ENVIRONMENTS:
            raise ValueError(f"config.task.dataset_options: environment={self.environment!r}; known: {ENVIRONMENTS}")


def detect(path: str) -> bool:
    return os.path.isdir(path) and bool(task_dirs(path))


def task_dirs(path: str) -> list[str]:
    """The task directories of a set: ``path`` itself, or its subdirectories with a task.toml."""
    if os.path.isfile(os.path.join(path, "task.toml")):
        return [path]
    return [os.path.join(path, n) for n in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, n, "task.toml"))]


def load(path: str, opts: Options) -> list[tuple[Task, str]]:
    dirs = task_dirs(path)
    if not dirs:
        raise TaskFileError(path, None, None, "holds no Harbor task (no task.toml in it or its subdirectories)")
    out: list[tuple[Task, str]] = []
    seen: dict[str, str] = {}
    for d in dirs:
        line = task_line(d, opts)
        where = os.path.join(d, "task.toml")
        try:
            task, split = parse_line(line, path=where, line=1, base=Path(d))
        except TaskFileError as e:  # the field as gyre names it: say which file it came from
            raise TaskFileError(where, None, e.field, f"{e.problem} (from the Harbor task {d})") from None
        if task.task_id in seen:
            raise TaskFileError(where, None, "id", f"{task.task_id!r} is also the id of {seen[task.task_id]}")
        seen[task.task_id] = d
        out.append((task, split))
    return out


def _refuse(where: str, field: str | None, problem: str):
    raise TaskFileError(where, None, field, problem)


def _section(toml: dict, name: str, fields: tuple, where: str) -> dict:
    sec = toml.get(name, {})
    if not isinstance(sec, dict):
        _refuse(where, name, f"must be a table, got {type(sec).__name__}")
    bad = sorted(set(sec) - set(fields))
    if bad:
        _refuse(where, f"{name}.{bad[0]}", f"not a Harbor field gyre knows; known in [{name}]: {', '.join(fields)}")
    return sec


def _no_network(sec: dict, name: str, where: str) -> None:
    mode = sec.get("network_mode")
    if mode not in (None, "no-network"):
        _refuse(where, f"{name}.network_mode", f"{mode!r}: rollouts and graders have no network here (only "
                                               "'no-network' can be honoured)")
    if sec.get("allowed_hosts"):
        _refuse(where, f"{name}.allowed_hosts", "rollouts and graders have no network here")


def _env(sec: dict, name: str, where: str) -> dict[str, str]:
    env = sec.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_]\w*", k)
                                            and isinstance(v, str) for k, v in env.items()):
        _refuse(where, f"{name}.env", "must be a table of NAME = \"value\" strings")
    return env


def _config(d: str) -> dict:
    """task.toml, checked field by field (module docstring): what gyre honours, or one refusal."""
    where = os.path.join(d, "task.toml")
    try:
        with open(where, "rb") as f:
            toml = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        _refuse(where, None, f"not valid TOML ({e})")
    bad = sorted(set(toml) - set(TOP_FIELDS))
    if bad:
        _refuse(where, bad[0], "steps (multi-step tasks) are not supported" if bad[0] == "steps" else
                f"not a Harbor field gyre knows; known: {', '.join(TOP_FIELDS)}")
    version = str(toml.get("schema_version", toml.get("version", "1.0")))
    if not version.startswith("1."):
        _refuse(where, "schema_version", f"{version!r}: gyre reads Harbor task schema 1.x")
    task = _section(toml, "task", TASK_FIELDS, where)
    verifier = _section(toml, "verifier", VERIFIER_FIELDS, where)
    agent = _section(toml, "agent", AGENT_FIELDS, where)
    env = _section(toml, "environment", ENV_FIELDS, where)
    solution = _section(toml, "solution", SOLUTION_FIELDS, where)
    for name, sec in (("verifier", verifier), ("agent", agent)):
        if sec.get("user") is not None:
            _refuse(where, f"{name}.user", "gyre runs the agent and the verifier as the sandbox's own user")
        _no_network(sec, name, where)
    _no_network(env, "environment", where)
    if env.get("allow_internet") is True:
        _refuse(where, "environment.allow_internet", "true: rollouts have no network here (false can be honoured)")
    if int(env.get("gpus", 0) or 0) > 0 or env.get("gpu_types"):
        _refuse(where, "environment.gpus" if env.get("gpus") else "environment.gpu_types",
                "rollouts get no GPU here")
    for k in ("mcp_servers", "env", "skills_dir", "healthcheck"):
        if env.get(k):
            _refuse(where, f"environment.{k}", "not supported by gyre's rollout sandbox")
    metadata = toml.get("metadata", {})
    if not isinstance(metadata, dict):
        _refuse(where, "metadata", "must be a table")
    return {"task": task, "verifier": verifier, "agent": agent, "environment": env, "solution": solution,
            "metadata": metadata, "source": toml.get("source"), "version": version,
            "verifier_env": _env(verifier, "verifier", where), "solution_env": _env(solution, "solution", where)}


def _text(path: str, where: str) -> str:
    if os.path.getsize(path) > MAX_FILE_BYTES:
        _refuse(where, os.path.relpath(path, where), f"over {MAX_FILE_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        _refuse(where, os.path.relpath(path, where), "not UTF-8 text (gyre carries a task's files as text)")
    raise AssertionError("unreachable")


def _tree(root: str, where: str) -> dict[str, str]:
    """Every file under ``root`` (relative path -> text); symlinks refused (they would point off the task)."""
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for n in sorted(files):
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                _refuse(where, os.path.relpath(p, where), "a symlink: give the file itself")
            out[os.path.relpath(p, root)] = _text(p, where)
    return out


def _dockerfile(d: str, opts: Options) -> tuple[str | None, dict[str, str], list[str]]:
    """(WORKDIR, workspace files from COPY/ADD, the instructions not run) of environment/Dockerfile in host mode."""
    path = os.path.join(d, "environment", "Dockerfile")
    if not os.path.isfile(path):
        return None, {}, []
    context = os.path.join(d, "environment")
    workdir, files, skipped = "/", {}, []
    lines = _text(path, d).replace("\\\n", " ").splitlines()
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op = line.split(None, 1)[0].upper()
        arg = line[len(op):].strip()
        if op == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, arg))
        elif op in ("COPY", "ADD"):
            parts = [p for p in arg.split() if not p.startswith("--")]
            if len(parts) < 2 or any("://" in p for p in parts) or arg.startswith("["):
                skipped.append(line)
                continue
            *srcs, dst = parts
            dst_abs = os.path.normpath(os.path.join(workdir, dst))
            for src in srcs:
                files.update(_copy(context, src, dst_abs, workdir, dst.endswith("/") or len(srcs) > 1, d, line))
        else:
            skipped.append(line)
    return workdir, files, skipped


def _copy(context: str, src: str, dst: str, workdir: str, into_dir: bool, d: str, line: str) -> dict[str, str]:
    """A COPY's files as workspace paths (relative to WORKDIR, which is /workspace here)."""
    s = os.path.normpath(os.path.join(context, src))
    if not s.startswith(os.path.normpath(context)) or not os.path.exists(s):
        _refuse(d, "environment/Dockerfile", f"{line!r}: {src} is not in the build context (environment/)")
    if os.path.isdir(s):
        items = {os.path.join(dst, rel): text for rel, text in _tree(s, d).items()}
    else:
        target = os.path.join(dst, os.path.basename(s)) if into_dir or os.path.isdir(dst) else dst
        items = {target: _text(s, d)}
    out = {}
    for target, text in items.items():
        rel = os.path.relpath(target, workdir)
        if rel.startswith(".."):
            _refuse(d, "environment/Dockerfile", f"{line!r}: copies to {target}, outside WORKDIR {workdir}: in host "
                                                 "mode only files under WORKDIR can be laid into the workspace")
        out[rel] = text
    return out


def _rewrite(text: str, workdir: str | None) -> str:
    """Harbor's absolute paths as they are here (module docstring)."""
    subs = [("/tests", "/workspace/tests"), ("/logs", LOGS), ("/solution", SOLUTION_DIR)]
    if workdir and workdir != "/":
        subs.insert(0, (workdir, "/workspace"))
    for old, new in subs:
        text = re.sub(r"(?<![\w.\-/$])" + re.escape(old) + r"(?=/|\b|$)", new, text)
    return text


_CONVERT = (
    "import json,os,sys\n"
    "d=sys.argv[1]\n"
    "def out(o):\n"
    " p=os.environ.get('GYRE_VERDICT')\n"
    " s=json.dumps(o)\n"
    " open(p,'w').write(s) if p else print(s)\n"
    "r=None\n"
    "try:\n"
    " r=float(open(os.path.join(d,'reward.txt')).read().split()[0])\n"
    "except (OSError,IndexError,ValueError):\n"
    " try:\n"
    "  j=json.load(open(os.path.join(d,'reward.json')));r=float(j['reward'] if isinstance(j,dict) else j)\n"
    " except (OSError,ValueError,KeyError,TypeError):\n"
    "  pass\n"
    "if r is None: out({'error':'test.sh exited 0 but wrote no reward to /logs/verifier/reward.txt or reward.json'})\n"
    "elif not 0.0<=r<=1.0: out({'error':'reward %r is outside [0, 1]'%r})\n"
    "else: out({'score':r})\n")


def _grader_command(env: dict[str, str]) -> str:
    exports = "".join(f"export {k}={_sh(v)}; " for k, v in sorted(env.items()))
    return (f"rm -rf /tmp/gyre-harbor; mkdir -p {LOGS}/verifier {LOGS}/agent; "
            "if [ ! -d /workspace/tests ]; then echo 'gyre: a Harbor verifier needs the graded tree at /workspace "
            "(a bubblewrap or docker sandbox)'; exit 3; fi; "
            # test.sh and the graded code it runs never hold the verdict's descriptor: only the reward converter
            'vfd=${GYRE_VERDICT#/dev/fd/}; '
            "cd /workspace && ( if [ -n \"$vfd\" ]; then eval \"exec $vfd>&-\"; fi; "
            f"{exports}bash /workspace/tests/test.sh ); rc=$?; "
            "if [ $rc -ne 0 ]; then echo \"gyre: tests/test.sh exited $rc (scored 0: GYRE_VERDICT unwritten)\"; "
            "exit $rc; fi; "
            f"exec python3 -c {_sh(_CONVERT)} {LOGS}/verifier")


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _solution(d: str, env: dict[str, str], workdir: str | None) -> str | None:
    """solve.sh as a command for ``--check_tasks``: the solution directory's files written under
    /tmp/gyre-harbor/solution (Harbor's /solution), then solve.sh run from the workspace."""
    sdir = os.path.join(d, "solution")
    if not os.path.isfile(os.path.join(sdir, "solve.sh")):
        return None
    files = {rel: _rewrite(text, workdir) for rel, text in _tree(sdir, d).items()}
    writes = "".join(f"mkdir -p {_sh(os.path.dirname(os.path.join(SOLUTION_DIR, rel)))}; printf %s {_sh(text)} > "
                     f"{_sh(os.path.join(SOLUTION_DIR, rel))}; " for rel, text in files.items())
    exports = "".join(f"export {k}={_sh(v)}; " for k, v in sorted(env.items()))
    return f"{writes}cd \"${{GYRE_WORKSPACE:-$PWD}}\" && {exports}bash {SOLUTION_DIR}/solve.sh"


@functools.lru_cache(maxsize=1)
def docker_unavailable() -> str | None:
    """Why docker cannot run containers here (None: its daemon answers)."""
    if shutil.which("docker") is None:
        return "docker is not available here (no `docker` on PATH)"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker is not available here (docker info: {e})"
    if r.returncode != 0:
        return f"docker is not available here (its daemon does not answer: {(r.stderr or r.stdout).strip()[:200]})"
    return None


def task_line(d: str, opts: Options) -> dict[str, Any]:
    """The gyre JSONL line (``tasks/dataset.py``'s schema) of one Harbor task directory."""
    cfg = _config(d)
    where = os.path.join(d, "task.toml")
    for need in ("instruction.md", os.path.join("tests", "test.sh")):
        if not os.path.isfile(os.path.join(d, need)):
            _refuse(d, need, "missing (a Harbor task needs instruction.md and tests/test.sh)")
    env = cfg["environment"]
    has_image = os.path.isfile(os.path.join(d, "environment", "Dockerfile")) or env.get("docker_image")
    workdir: str | None = None
    files: dict[str, str] = {}
    skipped: list[str] = []
    if opts.environment == "docker" and has_image:
        what = "environment/Dockerfile" if os.path.isfile(os.path.join(d, "environment", "Dockerfile")) \
            else "environment.docker_image"
        why = docker_unavailable() or ("gyre does not build or pull per-task images yet (harness.sandbox=docker "
                                       "takes one image per family)")
        _refuse(d, what, f"the task's environment is a container image and {why}. To run it in gyre's sandbox on "
                         "this host's toolchain instead: --config.task.dataset_options='{\"environment\": \"host\"}' "
                         "(its Dockerfile's WORKDIR and COPY are honoured, other instructions are not run)")
    if opts.environment == "host":
        if env.get("docker_image") and not os.path.isfile(os.path.join(d, "environment", "Dockerfile")):
            _refuse(where, "environment.docker_image", "a prebuilt image cannot run on the host: give a Dockerfile "
                                                       "(its WORKDIR and COPY are honoured) or use docker")
        workdir, files, skipped = _dockerfile(d, opts)
    hidden = {os.path.join("tests", rel): _rewrite(text, workdir)
              for rel, text in _tree(os.path.join(d, "tests"), d).items()}
    meta = cfg["metadata"]
    split = meta.get("split", "train")
    harbor = {"dir": os.path.abspath(d), "schema_version": cfg["version"], **{k: v for k, v in cfg["task"].items()},
              "metadata": meta, "source": cfg["source"], "environment": opts.environment,
              "resources": {k: env[k] for k in ("cpus", "memory_mb", "storage_mb", "memory", "storage") if k in env}}
    if workdir is not None:
        harbor.update(workdir=workdir, skipped_instructions=skipped)
    line: dict[str, Any] = {
        "id": os.path.basename(os.path.normpath(d)),
        "instruction": _rewrite(_text(os.path.join(d, "instruction.md"), d), workdir),
        "files": files,
        "grader": {"command": _grader_command(cfg["verifier_env"]), "files": hidden,
                   "timeout_s": float(cfg["verifier"].get("timeout_sec", 600.0))},
        "split": split,
        "metadata": {"harbor": json.loads(json.dumps(harbor, default=str))},
    }
    if cfg["agent"].get("timeout_sec"):
        line["timeout_s"] = float(cfg["agent"]["timeout_sec"])
    solution = _solution(d, cfg["solution_env"], workdir)
    if solution is not None:
        line["metadata"]["solution"] = solution
    return line


TASK_FORMATS.register("harbor", config=Options, detect=detect,
                      summary="Harbor task directories (task.toml, instruction.md, tests/test.sh)")(load)
