"""Runs one module's unit checks against agent-written code, in its own process.

``python3 -I check_runner.py`` (this file as a script: it imports only the standard library,
so it runs in the grader's sandbox without gyre_jax) with cwd = the workspace snapshot and a
JSON spec on stdin: ``{"module": "pkg.mod", "functions": [{"name", "cases": [{"args"}]}],
"case_timeout_s": 2.0}``. Emits one JSON line per check, as it completes:
``{"check": name, "ok": bool, "note": str}`` with names from :func:`check_names`; a case's
line has ``"got"``, the JSON value the call returned (``ok``: it returned).

The expected values never enter this process: the grader compares ``got`` with them. Agent
code runs in this process and can forge anything it prints, but a forged ``got`` is only a
value the function itself could have returned, so forging gains nothing.

Why a separate process: agent code may hang, exit, crash the interpreter or print
anything. Here that only fails the agent's checks (a genuine partial score); it must
never take the grader down (which would be a verifier error). Result lines go to a
duplicate of the original stdout; fd 1 is pointed at stderr before agent code is
imported, so its stray prints do not garble results. A hang is cut per call with SIGALRM
and the parent also bounds the whole process.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys


def check_names(module: str, fn: str, n_cases: int) -> tuple[str, list[str]]:
    return f"defines:{module}.{fn}", [f"case:{module}.{fn}[{k}]" for k in range(n_cases)]


def import_check_name(module: str) -> str:
    return f"import:{module}"


class _CaseTimeout(BaseException):  # BaseException: agent code's `except Exception` cannot swallow it
    pass


def _on_alarm(signum, frame):
    raise _CaseTimeout()


def _timed(fn, timeout_s):
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _normalize(value):
    return json.loads(json.dumps(value))  # tuples -> lists, as the expected values are stored


def main() -> None:
    spec = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(name, ok, note="", **got):
        out.write(json.dumps({"check": name, "ok": bool(ok), "note": str(note)[:300], **got}) + "\n")
        out.flush()

    signal.signal(signal.SIGALRM, _on_alarm)
    timeout = float(spec["case_timeout_s"])
    module_name = spec["module"]
    sys.path.insert(0, os.getcwd())
    try:
        module = _timed(lambda: importlib.import_module(module_name), timeout)
    except BaseException as e:  # SystemExit, timeouts, anything the agent's module raised
        emit(import_check_name(module_name), False, f"{type(e).__name__}: {e}")
        return
    emit(import_check_name(module_name), True)
    for fn_spec in spec["functions"]:
        defines, case_names = check_names(module_name, fn_spec["name"], len(fn_spec["cases"]))
        fn = getattr(module, fn_spec["name"], None)
        emit(defines, callable(fn), "" if callable(fn) else "not defined or not callable")
        for name, case in zip(case_names, fn_spec["cases"]):
            if not callable(fn):
                emit(name, False, "function missing")
                continue
            try:
                got = _normalize(_timed(lambda: fn(*case["args"]), timeout))
            except _CaseTimeout:
                emit(name, False, f"timed out after {timeout:g} s")
                continue
            except BaseException as e:
                emit(name, False, f"{type(e).__name__}: {e}")
                continue
            emit(name, True, got=got)


if __name__ == "__main__":
    main()
