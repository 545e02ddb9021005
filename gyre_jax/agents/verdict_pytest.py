"""A per-test verdict: named pytest tests (``fail_to_pass``, ``pass_to_pass``), read from gyre's plugin.

The grader runs ``python3 -P -m pytest -p gyre_verdict [-p PLUGIN...] -p no:cacheprovider
--continue-on-collection-errors --maxfail=0 --rootdir /workspace FILES... CANARY`` in the grader
sandbox on the graded tree (``-P``: pytest and the plugin are imported before the tree is on
``sys.path``; the plugin then puts the tree first, as ``python -m pytest`` would; FILES: the
named tests' files, of which the plugin keeps the named tests), with
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``: installed pytest plugins load only when named
(``grader.pytest_plugins``, or the task's own conftest's ``pytest_plugins``). The plugin
(``verdict_plugin``, with a canary test file, bound read-only at a random path outside the tree)
reports each test's outcome on a descriptor no path leads to (``verdict_command``). A named id
(a test, a parametrized test's base id, a file or a directory) passes when at least one test
under it was collected and every phase (setup, call, teardown) of each passed: skipped,
xfailed, deselected, errored, failed to collect or missing all count as failed.

Score: the fraction of ``fail_to_pass`` ids that pass, if every ``pass_to_pass`` id passes,
else 0 (only ``pass_to_pass``: 1 or 0). The run counts only when it is whole and consistent:
the plugin started and finished, pytest's exit status equals the one the plugin saw, the
canaries behaved (one must fail, one must pass) and no tampering was seen; otherwise 0 with the
reason. SWE-bench's FAIL_TO_PASS / PASS_TO_PASS lists map onto these fields as they are.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

from gyre_jax.agents import grader_sandbox, verdict_plugin
from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tree_rules import is_test_file, test_file_of
from gyre_jax.agents.verdict_command import MAX_VERDICT_BYTES, OUTPUT_TAIL_BYTES, VERDICT_ENV, _wait, open_verdict

PLUGIN = "gyre_verdict"
CANARY_MODULE = "test_gyre_canary"
CANARY_SOURCE = ("def test_gyre_canary_must_fail():\n    assert False, 'gyre canary'\n\n\n"
                 "def test_gyre_canary_must_pass():\n    pass\n")
CANARY_EXPECT = {"test_gyre_canary_must_fail": "failed", "test_gyre_canary_must_pass": "passed"}
MAX_VERDICT_LINES = 200_000
PYTEST_FAILED = 1  # pytest's exit status when a test failed: always, since the must-fail canary fails


def run_argv(paths: Sequence[str], canary: str, plugins: Sequence[str] = ()) -> list[str]:
    """pytest on the named tests' files (the plugin keeps only the named tests and the canaries)."""
    return ["python3", "-P", "-m", "pytest", "-p", PLUGIN, *(a for p in plugins for a in ("-p", p)),
            "-p", "no:cacheprovider", "-o", "enable_assertion_pass_hook=true", "-q", "-rN",
            "--continue-on-collection-errors", "--maxfail=0",
            "--rootdir", "/workspace", *paths, canary]


def grade(tree: Path, *, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], timeout_s: float,
          read_only: list[str], extra_ro_paths: Sequence[str] = (), plugins: Sequence[str] = ()) -> Grade:
    """Run the named tests on ``tree`` and score them (module docstring)."""
    from gyre_jax.agents.capture import BoundedCapture, drain_thread

    nonce = secrets.token_hex(16)
    # the task's test and conftest files: the plugin serves them from memory (writable: it puts decoys
    # in their place); the other protected files are bound read-only
    protected = list(read_only)
    memory = [r for r in protected if (is_test_file(r) or r.rsplit("/", 1)[-1] == "conftest.py")
              and (tree / r).is_file()]
    read_only = [r for r in protected if r not in memory]
    mount = f"/run/gyre-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="gyre-pytest-") as tmp, open_verdict(tmp) as fd:
        lib = Path(tmp) / "lib"
        lib.mkdir()
        (lib / f"{PLUGIN}.py").write_text(Path(verdict_plugin.__file__).read_text())
        (lib / f"{CANARY_MODULE}.py").write_text(CANARY_SOURCE)
        for p in (lib, *lib.iterdir()):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        in_sandbox = grader_sandbox.spec()["kind"] not in ("none",)
        lib_path = f"{mount}/lib" if in_sandbox else str(lib)
        canary = f"{lib_path}/{CANARY_MODULE}.py"
        env = {VERDICT_ENV: f"/dev/fd/{fd}", "GYRE_VERDICT_NONCE": nonce, "GYRE_VERDICT_CANARY": canary,
               "GYRE_VERDICT_ROOT": "/workspace" if in_sandbox else str(tree.resolve()),
               "PYTHONPATH": lib_path, "PYTHONSAFEPATH": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               "GYRE_VERDICT_IDS": json.dumps([*fail_to_pass, *pass_to_pass]), "GYRE_VERDICT_HIDDEN": json.dumps(memory)}
        files = list(dict.fromkeys(test_file_of(t) for t in [*fail_to_pass, *pass_to_pass]))
        argv = run_argv([f for f in files if (tree / f).exists()], canary, plugins)
        if not in_sandbox:
            argv[argv.index("/workspace")] = str(tree.resolve())
        capture = BoundedCapture(head=OUTPUT_TAIL_BYTES, tail=65536)
        with grader_sandbox.launch(tree, argv, writable=True, read_only=read_only, extra_ro_paths=extra_ro_paths,
                                   binds=(("--ro-bind", str(lib), f"{mount}/lib"),), env=env) as launch:
            proc = subprocess.Popen(launch.argv, cwd=tree, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=launch.env, pass_fds=(fd,))
            reader = drain_thread(proc.stdout, capture)
            returncode = _wait(proc, timeout_s)
            reader.join(5.0)
        raw = _read_all(fd)
    records = parse_records(raw, nonce)
    return decide(records, returncode, fail_to_pass, pass_to_pass, capture.tail_text(), protected)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, min(size, MAX_VERDICT_BYTES * 256), 0)


def parse_records(raw: bytes, nonce: str) -> list[dict]:
    """The plugin's lines that carry this run's nonce (anything else in the file is ignored)."""
    out = []
    for line in raw.splitlines()[:MAX_VERDICT_LINES]:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and rec.get("nonce") == nonce and isinstance(rec.get("e"), str):
            out.append(rec)
    return out


def matches(requested: str, nodeid: str) -> bool:
    """A collected test id under a requested one: itself, a parametrization, a test of a file or dir."""
    r = requested.rstrip("/")
    return nodeid == r or nodeid.startswith((r + "::", r + "[", r + "/"))


def decide(records: list[dict], returncode: int | None, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
           output: str, protected: Sequence[str]) -> Grade:
    """The score of one run (module docstring); ``details['grader_fault']``: why the grader
    itself looks broken on this tree, if anything says so."""
    tail = output[-OUTPUT_TAIL_BYTES:]
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["e"], []).append(r)
    details: dict[str, Any] = {"exit_code": returncode, "output_tail": tail, "grader_fault": None,
                               "collect_errors": [(c.get("nodeid"), str(c.get("longrepr", ""))[-500:])
                                                  for c in by_kind.get("collect_error", [])][:10]}
    if not by_kind.get("start"):
        details["grader_fault"] = ("pytest did not start with gyre's verdict plugin (is pytest installed for the "
                                   "grader's python3? grader.ro_paths / config.task.grader_ro_paths): "
                                   f"{output.strip()[-400:]!r}")
        return Grade(0.0, {**details, "reason": "the test run did not start"})
    details["grader_fault"] = _collect_fault(details["collect_errors"], protected)
    if returncode is None:
        return Grade(0.0, {**details, "reason": "timeout", "timed_out": True})
    finish = by_kind.get("finish", [])
    if len(finish) != 1:
        return Grade(0.0, {**details, "reason": f"the test session did not finish (exit {returncode}): graded code "
                                                "ended it"})
    tampered = list(finish[0].get("tampered") or [])
    status = finish[0].get("exitstatus")
    if status != returncode:
        tampered.append(f"the process exited {returncode}, pytest's session ended with {status}")
    outcome = _outcomes(by_kind.get("phase", []))
    canaries = {n: outcome.get(i) for i, n in (by_kind.get("collected", [{}])[-1].get("canaries") or {}).items()}
    if canaries != CANARY_EXPECT:
        tampered.append(f"the canary tests ended {canaries}, not {CANARY_EXPECT}")
    elif returncode != PYTEST_FAILED:
        tampered.append(f"pytest exited {returncode} although the must-fail canary failed")
    if tampered:
        return Grade(0.0, {**details, "reason": "tampering with the test run: " + "; ".join(tampered)[:800],
                           "tampered": tampered})
    collected = by_kind.get("collected", [{}])[-1].get("items") or []
    per_id = {t: _id_result(t, collected, outcome) for t in [*fail_to_pass, *pass_to_pass]}
    f2p_ok = sum(per_id[t] == "passed" for t in fail_to_pass)
    p2p_ok = all(per_id[t] == "passed" for t in pass_to_pass)
    score = (f2p_ok / len(fail_to_pass) if fail_to_pass else 1.0) if p2p_ok else 0.0
    missing = [t for t, r in per_id.items() if r == "missing"]
    reason = "tests" if not missing else f"not collected: {missing[:5]}"
    return Grade(score, {**details, "reason": reason, "tests": per_id, "exact": score == 1.0,
                         "fail_to_pass_passed": f2p_ok, "pass_to_pass_passed": p2p_ok})


def _outcomes(phases: list[dict]) -> dict[str, str]:
    """Test id -> passed / failed / skipped / error (setup or teardown failed) / incomplete."""
    seen: dict[str, dict[str, str]] = {}
    for p in phases:
        seen.setdefault(str(p.get("nodeid")), {})[str(p.get("when"))] = str(p.get("outcome"))
    out = {}
    for nodeid, w in seen.items():
        if w.get("setup") not in (None, "passed"):
            out[nodeid] = "error" if w.get("setup") == "failed" else "skipped"
        elif w.get("call") != "passed":
            out[nodeid] = w.get("call") or "incomplete"
        elif w.get("teardown") != "passed":
            out[nodeid] = "error" if w.get("teardown") == "failed" else "incomplete"
        else:
            out[nodeid] = "passed"
    return out


def _id_result(requested: str, collected: list[str], outcome: dict[str, str]) -> str:
    mine = [c for c in collected if matches(requested, c)]
    if not mine:
        return "missing"
    results = [outcome.get(c, "incomplete") for c in mine]
    return "passed" if all(r == "passed" for r in results) else next(r for r in results if r != "passed")


def _collect_fault(errors: list, protected: Sequence[str]) -> str | None:
    """A collection error that is the grader's: a syntax error in one of the task's own test files."""
    for nodeid, text in errors:
        if nodeid in protected and ("SyntaxError" in text or "IndentationError" in text):
            where = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")][-4:]
            return f"the task's test file {nodeid} does not compile: {' | '.join(where)[:300]}"
    return None
