"""A per-test verdict: named pytest tests (``fail_to_pass``, ``pass_to_pass``), read from gyre's plugin.

The grader runs ``python3 -P -m pytest -p gyre_verdict [-p PLUGIN...] -p no:cacheprovider
--continue-on-collection-errors --maxfail=0 --rootdir /workspace FILES... CANARY`` in the grader
sandbox on the graded tree (``-P``: pytest and the plugin are imported before the tree is on
``sys.path``; the plugin then puts the tree first, as ``python -m pytest`` would; FILES: the
named tests' files, of which the plugin keeps the named tests), with
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``: installed pytest plugins load only when named
(``grader.pytest_plugins``, or the task's own conftest's ``pytest_plugins``). The plugin
(``verdict_plugin``, with a canary test file, bound read-only at a random path outside the tree)
reports each test's outcome on the write end of a pipe only the test process holds (no path leads
to it; graded code that finds it can append to it, never rewrite what the plugin wrote). A named id
(a test, a parametrized test's base id, a file or a directory) passes when at least one test
under it was collected and every phase (setup, call, teardown) of each passed: skipped,
xfailed, deselected, errored, failed to collect or missing all count as failed.

Score: the fraction of ``fail_to_pass`` ids that pass, if every ``pass_to_pass`` id passes,
else 0 (only ``pass_to_pass``: 1 or 0). The run counts only when it is whole and consistent:
the plugin started and finished, pytest's exit status equals the one the plugin saw, the
canaries behaved (one must fail, one must pass) and no tampering was seen; otherwise 0 with the
reason. The record stream itself must be whole: every line one record of a known kind with its
fields' types, numbered from 0 without a gap, the start first, the finish last, one record per
test and phase; anything else on the pipe (a line graded code appended, a second verdict for a
test, a record after the session finished) is tampering, a score of 0, never a grader error.
SWE-bench's FAIL_TO_PASS / PASS_TO_PASS lists map onto these fields as they are.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from gyre_jax.agents import grader_sandbox
from gyre_jax.agents.scoring import Grade
from gyre_jax.agents.tree_rules import is_test_file, test_file_of
from gyre_jax.agents.verdict_command import MAX_VERDICT_BYTES, OUTPUT_TAIL_BYTES, VERDICT_ENV, _wait

PLUGIN = "gyre_verdict"
# The plugin's source, read as a file: importing it would run it here (it patches unittest and pytest).
PLUGIN_SOURCE = Path(__file__).with_name("verdict_plugin.py")
CANARY_MODULE = "test_gyre_canary"
CANARY_SOURCE = ("def test_gyre_canary_must_fail():\n    assert False, 'gyre canary'\n\n\n"
                 "def test_gyre_canary_must_pass():\n    pass\n")
CANARY_EXPECT = {"test_gyre_canary_must_fail": "failed", "test_gyre_canary_must_pass": "passed"}
MAX_VERDICT_LINES = 200_000
MAX_RECORD_BYTES = MAX_VERDICT_BYTES * 256  # of the plugin's records kept (more: the stream is not whole)
READER_GRACE_S = 5.0  # after the test process ended, for the pipe's last bytes (or a holder that outlived it)
# The plugin's record kinds and their fields' types: a record of any other shape is not the plugin's.
RECORD_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "start": {"pytest": str, "python": str},
    "collect_error": {"nodeid": str, "longrepr": str},
    "collected": {"items": list, "canaries": dict},
    "phase": {"nodeid": str, "when": str, "outcome": str, "canary": bool, "longrepr": str},
    "finish": {"exitstatus": int, "tampered": list},
}
PHASES = ("setup", "call", "teardown")
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

    # the task's test and conftest files: the plugin serves them from memory (writable: it puts decoys
    # in their place); the other protected files are bound read-only
    protected = list(read_only)
    memory = [r for r in protected if (is_test_file(r) or r.rsplit("/", 1)[-1] == "conftest.py")
              and (tree / r).is_file()]
    read_only = [r for r in protected if r not in memory]
    mount = f"/run/gyre-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="gyre-pytest-") as tmp:
        lib = Path(tmp) / "lib"
        lib.mkdir()
        (lib / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE.read_text())
        (lib / f"{CANARY_MODULE}.py").write_text(CANARY_SOURCE)
        for p in (lib, *lib.iterdir()):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        in_sandbox = grader_sandbox.spec()["kind"] not in ("none",)
        lib_path = f"{mount}/lib" if in_sandbox else str(lib)
        canary = f"{lib_path}/{CANARY_MODULE}.py"
        files = list(dict.fromkeys(test_file_of(t) for t in [*fail_to_pass, *pass_to_pass]))
        argv = run_argv([f for f in files if (tree / f).exists()], canary, plugins)
        if not in_sandbox:
            argv[argv.index("/workspace")] = str(tree.resolve())
        capture = BoundedCapture(head=OUTPUT_TAIL_BYTES, tail=65536)
        with _VerdictPipe() as pipe:
            env = {VERDICT_ENV: f"/dev/fd/{pipe.write_fd}", "GYRE_VERDICT_CANARY": canary,
                   "GYRE_VERDICT_ROOT": "/workspace" if in_sandbox else str(tree.resolve()),
                   "PYTHONPATH": lib_path, "PYTHONSAFEPATH": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                   "GYRE_VERDICT_IDS": json.dumps([*fail_to_pass, *pass_to_pass]),
                   "GYRE_VERDICT_HIDDEN": json.dumps(memory)}
            with grader_sandbox.launch(tree, argv, writable=True, read_only=read_only, extra_ro_paths=extra_ro_paths,
                                       binds=(("--ro-bind", str(lib), f"{mount}/lib"),), env=env) as launch:
                try:
                    proc = subprocess.Popen(launch.argv, cwd=tree, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, start_new_session=True, env=launch.env,
                                            pass_fds=(pipe.write_fd,))
                finally:
                    pipe.close_write()  # the test process holds the only write end now
                reader = drain_thread(proc.stdout, capture)
                returncode = _wait(proc, timeout_s)
                reader.join(5.0)
            raw = pipe.read_all()
    records, problems = parse_records(raw)
    return decide(records, returncode, fail_to_pass, pass_to_pass, capture.tail_text(), protected, problems)


class _VerdictPipe:
    """The plugin's channel: a pipe whose write end (a descriptor >= 10) only the test process gets;
    its read end drained by a thread while the tests run (bounded: ``MAX_RECORD_BYTES``)."""

    def __init__(self):
        r, w = os.pipe()
        self.write_fd = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(w)
        self.read_fd = r
        self.data = bytearray()
        self.overflow = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="gyre-verdict-pipe", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.read_fd], [], [], 0.25)
            if not ready:
                continue
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                return
            if len(self.data) + len(chunk) > MAX_RECORD_BYTES:
                self.overflow = True  # keep draining (a writer must never block on us), keep nothing more
            else:
                self.data += chunk

    def close_write(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def read_all(self) -> bytes:
        """What was written, once every writer is gone (or ``READER_GRACE_S`` after the test process
        ended: a process of graded code that outlived it does not hold the grader)."""
        self._thread.join(READER_GRACE_S)
        self._stop.set()
        self._thread.join()
        return bytes(self.data) + (b"\n{overflow}\n" if self.overflow else b"")

    def __enter__(self) -> "_VerdictPipe":
        return self

    def __exit__(self, *exc) -> None:
        self.close_write()
        self._stop.set()
        self._thread.join()
        os.close(self.read_fd)


def parse_records(raw: bytes) -> tuple[list[dict], list[str]]:
    """The plugin's records, in order, and what is wrong with the stream (module docstring): the
    records up to the first line that is not the next one the plugin would write."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out: list[dict] = []
    seen: set[tuple[str, str]] = set()
    for i, line in enumerate(lines[:MAX_VERDICT_LINES + 1]):
        why = _record_problem(line, i, out, seen)
        if why is not None:
            return out, [f"record {i}: {why}"]
        out.append(json.loads(line))
    return out, []


def _record_problem(line: bytes, i: int, before: list[dict], seen: set[tuple[str, str]]) -> str | None:
    if i >= MAX_VERDICT_LINES or line == b"{overflow}":
        return "more records than the plugin writes"
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return "not a record of the plugin's (written by graded code, or cut off)"
    if not isinstance(rec, dict) or rec.get("seq") != i or rec.get("e") not in RECORD_FIELDS:
        return "not the plugin's next record (out of sequence or of no known kind)"
    kind = rec["e"]
    for field, typ in RECORD_FIELDS[kind].items():
        if not isinstance(rec.get(field), typ) or (typ is int and isinstance(rec.get(field), bool)):
            return f"{kind} record with a malformed {field!r}"
    if kind == "collected" and not (all(isinstance(x, str) for x in rec["items"]) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in rec["canaries"].items())):
        return "collected record with malformed items"
    if kind == "finish" and not all(isinstance(x, str) for x in rec["tampered"]):
        return "finish record with malformed tampering notes"
    if (kind == "start") != (i == 0):
        return "the start record is not the first"
    if before and before[-1]["e"] == "finish":
        return "a record after the session finished"
    if kind == "collected" and any(r["e"] == "collected" for r in before):
        return "a second collection record"
    if kind == "phase":
        key = (rec["nodeid"], rec["when"])
        if rec["when"] not in PHASES or key in seen:
            return f"a second (or unknown) {rec['when']!r} record for {rec['nodeid']!r}"
        seen.add(key)
    return None


def matches(requested: str, nodeid: str) -> bool:
    """A collected test id under a requested one: itself, a parametrization, a test of a file or dir."""
    r = requested.rstrip("/")
    return nodeid == r or nodeid.startswith((r + "::", r + "[", r + "/"))


def decide(records: list[dict], returncode: int | None, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
           output: str, protected: Sequence[str], problems: Sequence[str] = ()) -> Grade:
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
    if problems and not finish:  # the stream broke before the session's end: graded code wrote on it
        return Grade(0.0, {**details, "reason": "tampering with the test run: " + "; ".join(problems)[:800],
                           "tampered": list(problems)})
    if len(finish) != 1:
        return Grade(0.0, {**details, "reason": f"the test session did not finish (exit {returncode}): graded code "
                                                "ended it"})
    tampered = [*problems, *finish[0]["tampered"]]
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
