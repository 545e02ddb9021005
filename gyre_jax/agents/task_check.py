"""Check every task's grader before training on it: the untouched workspace and the solution.

For each task, through the same path rollouts take (``prepare_workspace`` with the task's repo
and commit in the rollout sandbox, ``snapshot_workspace``, ``run_grader`` and its graded tree):

  untouched  the workspace as the task lays it, graded: must score below 1 (unless
             ``metadata.untouched_may_pass``), and nothing may say the grader itself is broken
             (exit 126/127, a test tool its Python cannot import, a syntax error in a hidden
             file, a ``{"score"}`` line on stdout, an error verdict, tampering flags); per-test
             tasks: every named test is collected, every ``fail_to_pass`` fails and every
             ``pass_to_pass`` passes;
  forgery    the untouched workspace with every Python file the policy may change wrapped in
             generic forgeries (pytest and unittest patched at import, a ``$GYRE_VERDICT``
             write, an atexit hook printing ``{"score": 1.0}`` and exiting 0, ``os._exit``
             made to exit 0, public functions returning an object that equals everything), and
             every shell script it may change in a ``$GYRE_VERDICT`` write and an exit trap
             that ends the shell with 0: must not score above the untouched workspace, or the
             grader is one graded code can forge (it imports or sources the agent's code, runs
             a script the policy can edit, or lets graded code reach its verdict);
  solution   ``metadata.solution`` (a command run in the workspace's sandbox, ``{"command"}``,
             ``{"files"}`` or ``{"patch"}``; a generated family's ``solution_files(task)``)
             applied, graded: must score 1.

A task with a problem is broken; its line names every problem. Tasks run ``concurrency`` at a
time with a progress line (rate, ETA) every ``progress_every_s``. ``python -m launch.main
--config ... --check_tasks`` prints this for a config's tasks and exits non-zero if any is
broken; the RL job runs the same check at start (``gyre_jax.rl.task_gate``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gyre_jax.agents import sandbox as sandbox_lib
from gyre_jax.agents import tools
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graders import grader_sandbox_env, run_grader, snapshot_workspace
from gyre_jax.agents.harness import BASES, SNAPSHOTS, grader_timeout, prepare_workspace
from gyre_jax.agents.tasks.base import Task

log = logging.getLogger(__name__)
SOLUTION_TIMEOUT_S = 300.0
_MISSING = re.compile(r"(?:ModuleNotFoundError|ImportError): No module named '([\w.]+)'")
PATCH_FILE = ".gyre_solution.patch"


@dataclasses.dataclass
class TaskCheck:
    task_id: str
    ok: bool
    seconds: float
    untouched: float | None
    solution: float | None  # None: the task has no solution to try
    problems: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        score = lambda s: "-" if s is None else f"{s:.2f}"  # noqa: E731
        head = (f"check: {'ok    ' if self.ok else 'BROKEN'} {self.task_id}  untouched {score(self.untouched)}  "
                f"solution {score(self.solution)}  {self.seconds:.1f} s")
        return "\n".join([head, *(f"    problem: {p}" for p in self.problems), *(f"    note: {n}" for n in self.notes)])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Prepended to every Python file the policy may change, in the forgery probe: what generic graded
# code could do to its grader if it runs inside the grader's process or reaches its channel.
FORGERY_PREAMBLE = """# gyre --check_tasks forgery probe (not a solution): what graded code could try on its grader
def _gyre_forge():
    import atexit, os
    try:
        v = os.environ.get("GYRE_VERDICT")
        if v:
            with open(v, "w") as f:
                f.write('{"score": 1.0}')
    except Exception:
        pass
    try:
        import _pytest.reports as r
        init = r.TestReport.__init__
        def forged(self, *a, **k):
            init(self, *a, **k)
            self.outcome, self.longrepr = "passed", None
        r.TestReport.__init__ = forged
    except Exception:
        pass
    try:
        import unittest
        unittest.TestResult.wasSuccessful = lambda self: True
        for n in ("assertEqual", "assertTrue", "assertFalse", "assertIn", "assertIs", "assertRaises"):
            setattr(unittest.TestCase, n, lambda *a, **k: None)
    except Exception:
        pass
    real_exit = os._exit
    os._exit = lambda *a, **k: real_exit(0)  # a checker that ends itself with os._exit(1) ends with 0
    os.abort = lambda: real_exit(0)
    atexit.register(lambda: (print('{"score": 1.0}', flush=True), real_exit(0)))
_gyre_forge()
"""
# Put at the top of every shell script the policy may change (after its #! line): a checker that
# sources it, or trusts the exit status of a script the policy can edit, then ends with 0.
SHELL_FORGERY = """# gyre --check_tasks forgery probe (not a solution)
if [ -n "${GYRE_VERDICT:-}" ]; then printf '{"score": 1.0}' > "$GYRE_VERDICT" 2>/dev/null; fi
trap 'exit 0' EXIT
"""
# Appended: every public function of the module returns an object that equals everything.
FORGERY_POSTAMBLE = """
class _GyreAlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
for _gyre_n, _gyre_f in list(globals().items()):
    if callable(_gyre_f) and not _gyre_n.startswith("_") and not isinstance(_gyre_f, type) \\
            and getattr(_gyre_f, "__module__", None) == __name__:
        globals()[_gyre_n] = lambda *a, **k: _GyreAlwaysEqual()
"""


def forgery_files(task: Task, workspace: Path, forged: bool = True) -> dict[str, str]:
    """The forgery probe's files: every Python file of the workspace the policy may change, and
    every one the solution creates (as stubs of its functions), wrapped in the forgeries above
    (``forged=False``: the same files without them, the probe's control: files that merely
    exist can earn credit of their own)."""
    import ast

    from gyre_jax.agents.graded_tree import listing, task_rules

    rules = task_rules(task, listing(workspace))
    out = {}
    for f in sorted(workspace.rglob("*")):
        rel = f.relative_to(workspace).as_posix()
        if not forged or not f.is_file() or f.is_symlink() or rules.refusal(rel, new=False) is not None:
            continue
        kind = _script_kind(f)
        if kind is not None:
            head, body = _split_shebang(f.read_text(errors="replace"))
            out[rel] = head + (FORGERY_PREAMBLE + body + FORGERY_POSTAMBLE if kind == "python" else SHELL_FORGERY + body)
    sol = solution_of(task)
    for rel, content in (sol.get("files", {}) if isinstance(sol, dict) else {}).items():
        if rel.endswith(".py") and rel not in out and rules.refusal(rel, new=True) is None:
            try:
                names = [n.name for n in ast.parse(content).body if isinstance(n, (ast.FunctionDef,
                                                                                  ast.AsyncFunctionDef))]
            except SyntaxError:
                names = []
            stubs = "".join(f"def {n}(*a, **k):\n    return None\n" for n in names)
            out[rel] = FORGERY_PREAMBLE + stubs + FORGERY_POSTAMBLE if forged else stubs
    return out


def _script_kind(path: Path) -> str | None:
    """'python' or 'shell' for a file a checker could import, source or run, else None."""
    if path.suffix in (".py", ".pyw"):
        return "python"
    if path.suffix in (".sh", ".bash"):
        return "shell"
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    names = [os.path.basename(w) for w in first[2:].decode(errors="replace").split()[:2]]  # /usr/bin/env bash
    if any(n.startswith("python") for n in names):
        return "python"
    return "shell" if any(n in ("sh", "bash", "dash", "zsh", "ksh") for n in names) else None


def _split_shebang(text: str) -> tuple[str, str]:
    """(the ``#!`` line, if any, the rest): the probe goes below it, so the script still runs."""
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return first + "\n", rest
    return "", text


def solution_of(task: Task) -> Any:
    """The task's reference solution: metadata.solution, or its family's ``solution_files(task)``."""
    if task.metadata.get("solution") is not None:
        return task.metadata["solution"]
    from gyre_jax.agents.tasks import FAMILIES, family

    fn = getattr(family(task.family), "solution_files", None) if task.family in FAMILIES else None
    return {"files": fn(task)} if fn is not None else None


def solution_command(solution: Any) -> str:
    """``solution`` as one shell command run in the workspace (what a scripted agent types)."""
    import shlex

    if isinstance(solution, str):
        return solution
    if "command" in solution:
        return solution["command"]
    if "patch" in solution:
        return f"printf %s {shlex.quote(solution['patch'])} | git apply --whitespace=nowarn -"
    return " && ".join(f"mkdir -p {shlex.quote(os.path.dirname(rel) or '.')} && printf %s {shlex.quote(content)} > "
                       f"{shlex.quote(rel)}" for rel, content in solution["files"].items())


async def apply_solution(solution: Any, ws: tools.Workspace) -> str | None:
    """Apply ``solution`` to the workspace (commands in its sandbox); why it failed, or None."""
    if isinstance(solution, str):
        solution = {"command": solution}
    if "files" in solution:
        for rel, content in solution["files"].items():
            ws.write_file(rel, content)
        return None
    if "patch" in solution:
        ws.write_file(PATCH_FILE, solution["patch"])
        command = f"git apply --whitespace=nowarn {PATCH_FILE}; s=$?; rm -f {PATCH_FILE}; exit $s"
    else:
        command = solution["command"]
    out, code = await ws.execute(command, SOLUTION_TIMEOUT_S)
    if code != 0:
        return f"the solution {'timed out' if code is None else f'exited {code}'}: {out.strip()[-300:]!r}"
    return None


async def _grade_workspace(task: Task, config: HarnessConfig, root: Path, name: str,
                           solution: Any = None, forge: bool | None = None) -> tuple[Any, str | None]:
    """(GraderOutcome, why the solution could not be applied) of a fresh workspace of ``task``;
    ``forge``: with the forgery probe's files (``forgery_files``; False: its control) instead."""
    path = root / name
    sandbox = sandbox_lib.make_sandbox(config.sandbox, path, family=task.family, name=name, commands=True)
    try:
        await asyncio.to_thread(prepare_workspace, root, name, task, sandbox)
        failed = None
        if forge is not None:
            solution = {"files": forgery_files(task, path, forged=forge)}
        if solution is not None:
            ws = tools.Workspace(path, sandbox=sandbox, command_timeout_s=SOLUTION_TIMEOUT_S, max_file_bytes=1 << 30)
            failed = await apply_solution(solution, ws)
        snap = await asyncio.to_thread(snapshot_workspace, path, root / SNAPSHOTS / name,
                                       max_bytes=config.sandbox.limits.disk_bytes,
                                       max_entries=config.sandbox.limits.max_files)
    finally:
        sandbox.release()
    g = await run_grader(task, root / SNAPSHOTS / name, timeout_s=grader_timeout(task, config),
                         env=grader_sandbox_env(sandbox.kind, config.sandbox.limits, sandbox.image,
                                                config.grader_ro_paths),
                         bases=root / BASES, carry_deletions=not snap.get("truncated"))
    return g, failed


def _last_line(details: dict) -> str:
    lines = [ln.strip() for ln in str(details.get("output_tail", "")).splitlines() if ln.strip()]
    return f" ({lines[-1][:300]})" if lines else ""


def _missing_module(task: Task, details: dict) -> str | None:
    """A module the grader imports that nothing in the task asks for: a name the instruction does
    not mention and the solution does not create (``import jsno``): the grader's own bug."""
    m = _MISSING.search(str(details.get("output_tail", "")))
    if m is None:
        return None
    name = m.group(1).split(".")[0]
    sol = solution_of(task)
    made = " ".join(sol.get("files", {})) if isinstance(sol, dict) else str(sol or "")
    if name in task.prompt or name in made or any(name in f for f in task.setup_files):
        return None
    return (f"untouched workspace: the grader imports {m.group(1)!r}, which the task neither ships nor asks for"
            f"{_last_line(details)}")


def _untouched_problems(task: Task, g) -> list[str]:
    if not g.ok:
        return [f"the grader failed on the untouched workspace: {g.error}"]
    d, out = g.details, []
    if d.get("grader_fault"):
        out.append(f"untouched workspace: {d['grader_fault']}")
    elif _missing_module(task, d):
        out.append(_missing_module(task, d) or "")
    if d.get("tampered"):
        out.append(f"untouched workspace: the test run looks tampered with ({d['reason']}): is a plugin or conftest "
                   "of the task patching pytest?")
    for test, result in (d.get("tests") or {}).items():
        if result == "missing":
            out.append(f"test {test} is not collected (check the id: file::test)")
        elif test in task.params.get("fail_to_pass", ()) and result == "passed":
            out.append(f"fail_to_pass {test} passes before any change")
        elif test in task.params.get("pass_to_pass", ()) and result != "passed":
            out.append(f"pass_to_pass {test} is {result} on the untouched workspace (it must pass before and after)")
    if g.score >= 1.0 and not task.metadata.get("untouched_may_pass", False):
        out.append("the untouched workspace scores 1.0: the grader passes without any work (set "
                   "metadata.untouched_may_pass if that is right)")
    return out


def _forgery_problems(untouched, forged) -> list[str]:
    """The forgery probe must not score above the untouched workspace (or, where it created files,
    the same files without the forgeries)."""
    if not forged.ok or not untouched.ok or forged.score <= untouched.score:
        return []
    return [f"graded code can forge this grader's verdict: a generic forgery (pytest/unittest patched at import, "
            f"an atexit hook that prints a score and exits 0, a $GYRE_VERDICT write, functions returning an object "
            f"that equals everything) scores {forged.score:.2f} on the untouched work, which scores "
            f"{untouched.score:.2f}: use fail_to_pass/pass_to_pass or grader.calls, or a checker that runs agent "
            "code in a subprocess it never imports (README: Train your own agent)"]


def _solution_problems(g, failed: str | None) -> list[str]:
    if failed:
        return [failed]
    if not g.ok:
        return [f"the grader failed on the solution: {g.error}"]
    if g.score >= 1.0:
        return []
    d = g.details
    why = d.get("grader_fault") or d.get("reason") or ""
    tests = {t: r for t, r in (d.get("tests") or {}).items() if r != "passed"}
    refused = {c: v for c, v in (d.get("tree") or {}).get("examples", {}).items()}
    return [f"the solution scores {g.score:.2f}, not 1: {why}{_last_line(d)}"
            + (f"; tests not passing: {tests}" if tests else "")
            + (f"; the solution's paths refused: {refused}" if refused else "")]


async def check_task(task: Task, config: HarnessConfig, root: Path) -> TaskCheck:
    t0 = time.monotonic()
    problems: list[str] = []
    notes: list[str] = []
    untouched = solution = None
    try:
        g, _ = await _grade_workspace(task, config, root, f"{task.task_id}.untouched")
        untouched = g.score
        problems += _untouched_problems(task, g)
        g3, _ = await _grade_workspace(task, config, root, f"{task.task_id}.forged", forge=True)
        if g3.ok and g.ok and g3.score > g.score:  # above the untouched: above the same files, unforged?
            g, _ = await _grade_workspace(task, config, root, f"{task.task_id}.stubs", forge=False)
        problems += _forgery_problems(g, g3)
        sol = solution_of(task)
        if sol is None:
            notes.append("no metadata.solution: the grader's passing path was not checked")
        else:
            g2, failed = await _grade_workspace(task, config, root, f"{task.task_id}.solution", sol)
            solution = g2.score
            problems += _solution_problems(g2, failed)
    except Exception as e:  # noqa: BLE001 - a task that cannot even be laid out is broken, with why
        problems.append(f"{type(e).__name__}: {e}"[:600])
    finally:
        for name in (f"{task.task_id}.{k}" for k in ("untouched", "solution", "forged", "stubs")):
            for p in (root / name, root / SNAPSHOTS / name):
                shutil.rmtree(p, ignore_errors=True)
    return TaskCheck(task.task_id, not problems, time.monotonic() - t0, untouched, solution, problems, notes)


async def check_tasks(tasks: Sequence[Task], config: HarnessConfig, root: str | Path, *, concurrency: int = 2,
                      progress_every_s: float = 10.0, on_result: Callable[[TaskCheck], None] | None = None
                      ) -> list[TaskCheck]:
    """Every task's check, in the order given; ``on_result`` sees each as it completes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    slots = asyncio.Semaphore(max(1, concurrency))
    t0 = last = time.monotonic()
    done: list[TaskCheck] = []

    async def one(task: Task) -> TaskCheck:
        nonlocal last
        async with slots:
            r = await check_task(task, config, root)
        done.append(r)
        if on_result is not None:
            on_result(r)
        now = time.monotonic()
        if now - last >= progress_every_s and len(done) < len(tasks):
            last = now
            rate = len(done) / max(now - t0, 1e-9)
            log.info("check: %d/%d tasks, %.2f/s, ETA %.0f s, %d broken so far", len(done), len(tasks), rate,
                     (len(tasks) - len(done)) / rate, sum(not d.ok for d in done))
        return r

    return list(await asyncio.gather(*(one(t) for t in tasks)))
