"""Agent functions called with given arguments in a sandboxed subprocess; the values compared outside.

``run_module_checks`` runs ``check_runner`` (stdlib only, ``python3 -I``) in the grader sandbox
on a read-only graded tree: it imports one module of the agent's code and calls its functions
with the cases' arguments, printing the JSON value each returned. The expected values never
enter that process, so agent code can neither read them nor forge a comparison: a forged
result line is only a value the function could have returned, and values are compared as
JSON, types included (an object whose ``__eq__`` says yes to everything is not JSON). The
sound checker pattern, used by the ``repo_spec`` family and the ``calls`` verdict mode of task
files (``grade_calls``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Sequence

from gyre_jax.agents import check_runner
from gyre_jax.agents.check_runner import check_names, import_check_name
from gyre_jax.agents.grader_sandbox import untrusted_python
from gyre_jax.agents.scoring import Checks, Grade

RUNNER_LINE_BYTES = 65536  # a result line longer than this is not a result (the rest of it is skipped)


def run_module_checks(workspace: Path, mod: dict, timeout_s: float, total_s: float | None = None) -> dict[str, dict]:
    """The check runner's results by check name: only well-formed lines naming one of this
    module's checks are kept (agent code can write on the runner's result channel; a line
    it forges cannot crash the grader, and its output cannot fill the grader's memory).
    ``timeout_s``: per call; ``total_s``: the whole runner at most (a function that hangs in every
    case must not keep the grader past its own time limit: that was a verifier error)."""
    from gyre_jax.agents.capture import BoundedCapture, drain_thread

    spec = {"module": mod["import"], "case_timeout_s": timeout_s,  # the arguments only: never the answers
            "functions": [{"name": f["name"], "cases": [{"args": c["args"]} for c in f["cases"]]}
                          for f in mod["functions"]]}
    known = {import_check_name(mod["import"])}
    for f in mod["functions"]:
        defines, cases = check_names(mod["import"], f["name"], len(f["cases"]))
        known.update([defines, *cases])
    n_cases = sum(len(f["cases"]) for f in mod["functions"])
    results: dict[str, dict] = {}
    err = BoundedCapture(head=0, tail=2048)
    with untrusted_python(workspace, check_runner.__file__) as argv:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workspace, start_new_session=True,
                                env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": os.environ.get("PATH", "")})
        err_reader = drain_thread(proc.stderr, err)
        fired = threading.Event()
        def on_timeout() -> None:
            fired.set()
            _kill_group(proc)

        limit = timeout_s * (n_cases + 1) + 10
        timer = threading.Timer(limit if total_s is None else max(0.1, min(limit, total_s)), on_timeout)
        timer.start()
        assert proc.stdin is not None and proc.stdout is not None  # both are pipes (Popen above)
        try:
            try:
                proc.stdin.write(json.dumps(spec).encode())
                proc.stdin.close()
            except BrokenPipeError:  # it died before reading: its exit code says so
                pass
            partial = False
            while line := proc.stdout.readline(RUNNER_LINE_BYTES):
                whole = line.endswith(b"\n")
                if not partial:
                    r = _result_line(line, known)
                    if r is not None:
                        results[r["check"]] = r
                partial = not whole
            code = proc.wait()
        finally:
            timer.cancel()
            _kill_group(proc)
        err_reader.join(5.0)
    why = ("check runner timed out" if fired.is_set()  # checks it finished before the cut still count
           else f"check runner exited with {code}: {err.tail_text(300)}")
    results["_why_missing"] = {"note": why}
    return results


def _result_line(line: bytes, known: set[str]) -> dict | None:
    """One runner result, or None if the line is not one: a JSON object with a known
    ``check``, a bool ``ok``, a string ``note`` and, for a returned case, ``got``."""
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(r, dict) or not isinstance(r.get("check"), str) or r["check"] not in known \
            or not isinstance(r.get("ok"), bool):
        return None
    out = {"check": r["check"], "ok": r["ok"], "note": str(r.get("note", ""))[:300]}
    if "got" in r:
        out["got"] = r["got"]
    return out


def _kill_group(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def same_json(a, b) -> bool:
    """Equal as JSON values, types included (Python's 1 == True would pass a wrong type)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def grade_calls(tree: Path, calls: Sequence[dict[str, Any]], timeout_s: float, total_s: float | None = None) -> Grade:
    """Score = the fraction of ``calls`` (``{"call": "pkg.mod:fn", "args": [...], "expected": v}``)
    whose function returned ``expected``; one runner process per module, ``timeout_s`` per call,
    ``total_s`` for all of them (calls without a result by then score 0)."""
    import time

    deadline = None if total_s is None else time.monotonic() + total_s
    modules: dict[str, dict[str, list]] = {}
    for c in calls:
        module, _, fn = c["call"].partition(":")
        modules.setdefault(module, {}).setdefault(fn, []).append(c)
    checks = Checks()
    for module, fns in modules.items():
        mod = {"import": module, "functions": [{"name": fn, "cases": cases} for fn, cases in fns.items()]}
        results = run_module_checks(tree, mod, timeout_s, None if deadline is None else deadline - time.monotonic())
        why = results.get("_why_missing", {}).get("note", "")
        if import_check_name(module) in results and not results[import_check_name(module)]["ok"]:
            why = f"{module} did not import: {results[import_check_name(module)]['note']}"
        for fn, cases in fns.items():
            for name, case in zip(check_names(module, fn, len(cases))[1], cases):
                r = results.get(name)
                ok = r is not None and r["ok"] and "got" in r and same_json(r["got"], case["expected"])
                note = "" if ok else (f"no result ({why})" if r is None else r["note"] or
                                      f"returned {str(r.get('got'))[:200]}")
                checks.add(name, ok, note)
    g = checks.grade()
    return Grade(g.score, {**g.details, "reason": "calls", "exact": g.score == 1.0, "grader_fault": None})
