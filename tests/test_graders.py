"""Graders give the right partial credit on hand-made workspaces; failures are errors."""
import asyncio
import json

import pytest

from gyre_jax.agents.graders import RESULT_PREFIX, grade_in_process, parse_grader_output, run_grader
from gyre_jax.agents.scoring import Checks, Grade, char_match_score
from gyre_jax.agents.tasks import repo_spec, tiny


@pytest.fixture(scope="module")
def task():
    # Short case timeout: the hanging-function workspace below costs 3 x this; long enough that a loaded
    # machine does not time out an honest import.
    return repo_spec.make_task(1, n_modules=2, functions_per_module=2, case_timeout_s=0.5)


def _write(root, files):
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)


def _failed(grade):
    return {c["check"] for c in grade.details["checks"] if not c["ok"]}


def _names(task):
    mods = task.params["modules"]
    return mods, task.params["package"]


def test_repo_spec_reference_scores_full(task, tmp_path):
    _write(tmp_path, repo_spec.reference_files(task))
    g = grade_in_process(task, tmp_path)
    # 1 init + per module (exists, import, 2 x (defines + 3 cases)) + README + 3 words
    assert g.details["total"] == 1 + 2 * (1 + 1 + 2 * 4) + 1 + 3
    assert g.score == 1.0 and _failed(g) == set()
    assert not list(tmp_path.rglob("__pycache__"))  # grading leaves the workspace as it was


def test_repo_spec_empty_workspace_scores_zero(task, tmp_path):
    g = grade_in_process(task, tmp_path)
    assert g.score == 0.0 and g.details["passed"] == 0 and len(_failed(g)) == g.details["total"]


def test_repo_spec_partial_credit_piece_by_piece(task, tmp_path):
    (m0, m1), pkg = _names(task)
    f_wrong, f_hang = m0["functions"][0]["name"], m1["functions"][1]["name"]
    files = repo_spec.reference_files(task)
    # m0: one function returns garbage.
    files[m0["path"]] += f"\n\ndef {f_wrong}(*args):\n    return 'nope'\n"
    # m1: one function never returns.
    files[m1["path"]] += f"\n\ndef {f_hang}(*args):\n    while True:\n        pass\n"
    files[repo_spec.README] = f"# {pkg}\nonly the package name\n"
    _write(tmp_path, files)
    g = grade_in_process(task, tmp_path)
    expected_failed = ({f"case:{m0['import']}.{f_wrong}[{k}]" for k in range(3)}
                       | {f"case:{m1['import']}.{f_hang}[{k}]" for k in range(3)}
                       | {f"readme:{m0['name']}", f"readme:{m1['name']}"})
    assert _failed(g) == expected_failed
    assert g.score == pytest.approx((25 - 8) / 25)
    notes = {c["check"]: c["note"] for c in g.details["checks"]}
    assert "timed out" in notes[f"case:{m1['import']}.{f_hang}[0]"]
    assert "'nope'" in notes[f"case:{m0['import']}.{f_wrong}[1]"]


def test_repo_spec_broken_modules_fail_only_their_checks(task, tmp_path):
    (m0, m1), pkg = _names(task)
    files = repo_spec.reference_files(task)
    files[m0["path"]] = "def broken(:\n"  # syntax error
    files[m1["path"]] = "import sys\nsys.exit(3)\n"  # exits at import
    del files[f"{pkg}/__init__.py"]  # a namespace package still imports
    _write(tmp_path, files)
    g = grade_in_process(task, tmp_path)
    per_module = lambda m: {f"import:{m['import']}"} | {
        f"{kind}:{m['import']}.{f['name']}{sfx}" for f in m["functions"]
        for kind, sfx in [("defines", "")] + [("case", f"[{k}]") for k in range(3)]}
    assert _failed(g) == {f"exists:{pkg}/__init__.py"} | per_module(m0) | per_module(m1)
    notes = {c["check"]: c["note"] for c in g.details["checks"]}
    assert "SyntaxError" in notes[f"import:{m0['import']}"]
    assert "SystemExit" in notes[f"import:{m1['import']}"]
    assert "did not import" in notes[f"defines:{m0['import']}.{m0['functions'][0]['name']}"]


def test_tiny_grader_char_match_partial_credit(tmp_path):
    t = tiny.make_task(0, ops=("reverse",), min_len=4, max_len=4)
    exp = t.params["expected"]
    assert grade_in_process(t, tmp_path).score == 0.0  # no answer.txt: a real zero
    cases = {exp: 1.0, exp + "\n": 1.0, exp[:2]: 0.5, exp[:3] + "?": 0.75, exp + "zz": 4 / 6, "": 0.0}
    for got, score in cases.items():
        (tmp_path / "answer.txt").write_text(got)
        assert grade_in_process(t, tmp_path).score == pytest.approx(score), got


def test_tiny_grader_rejects_inconsistent_params(tmp_path):
    t = tiny.make_task(0)
    bad = tiny.Task(**{**t.to_dict(), "params": {**t.params, "expected": "zzz"}})
    with pytest.raises(ValueError, match="does not match"):
        grade_in_process(bad, tmp_path)


def test_char_match_and_checks():
    assert char_match_score("cba", "cbx") == pytest.approx(2 / 3)
    assert char_match_score("cba", "cbaa") == pytest.approx(3 / 4)
    assert char_match_score("", "") == 1.0 and char_match_score("ab", "") == 0.0
    c = Checks()
    c.add("a", True)
    c.add("b", False, "why")
    assert c.grade().score == 0.5 and c.grade().details["checks"][1] == {"check": "b", "ok": False, "note": "why"}
    with pytest.raises(ValueError, match="duplicate"):
        c.add("a", True)
    with pytest.raises(ValueError, match="at least one"):
        Checks().grade()
    for bad in (1.5, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="Grade.score"):
            Grade(bad)


def test_parse_grader_output_rejects_everything_but_one_valid_line():
    ok = RESULT_PREFIX + json.dumps({"score": 0.25, "details": {"x": 1}})
    assert parse_grader_output("noise\n" + ok + "\n", 0, "") == (0.25, {"x": 1}, None)
    bad = {
        "exited with code 2": (ok, 2, "Traceback: boom"),
        "printed 0 result lines": ("", 0, ""),
        "printed 2 result lines": (ok + "\n" + ok, 0, ""),
        "malformed": (RESULT_PREFIX + "{not json", 0, ""),
        "not a number in [0, 1]": (RESULT_PREFIX + json.dumps({"score": 2, "details": {}}), 0, ""),
        "details must be an object": (RESULT_PREFIX + json.dumps({"score": 1, "details": []}), 0, ""),
    }
    for why, args in bad.items():
        score, details, error = parse_grader_output(*args)
        assert score is None and why in error, (why, error)


def test_run_grader_subprocess_scores_and_reports_bad_grader(tmp_path):
    t = tiny.make_task(3)
    (tmp_path / "answer.txt").write_text(t.params["expected"])
    out = asyncio.run(run_grader(t, tmp_path, timeout_s=30))
    assert out.ok and out.score == 1.0 and out.details["exact"] is True and out.error is None
    missing = tiny.Task(**{**t.to_dict(), "grader": "gyre_jax.agents.tasks.tiny:no_such_grader"})
    out = asyncio.run(run_grader(missing, tmp_path, timeout_s=30))
    assert not out.ok and out.score is None and "no callable 'no_such_grader'" in out.error


def test_agent_code_cannot_forge_check_results(task, tmp_path):
    (m0, m1), pkg = _names(task)
    files = repo_spec.reference_files(task)
    names = [f"import:{m0['import']}"] + [f"{kind}:{m0['import']}.{f['name']}{sfx}" for f in m0["functions"]
                                          for kind, sfx in [("defines", "")] + [("case", f"[{k}]") for k in range(3)]]
    lines = "".join(json.dumps({"check": n, "ok": True, "note": ""}) + "\n" for n in names)
    # Print "passing" results where the runner writes its own, then leave before any real check.
    files[m0["path"]] = f"import os, sys\nsys.stdout.write({lines!r})\nsys.stdout.flush()\nos.write(1, {lines!r}.encode())\nos._exit(0)\n"
    _write(tmp_path, files)
    g = grade_in_process(task, tmp_path)
    assert _failed(g) == set(names)


_FLOODED = """
import asyncio, json, resource, sys
from gyre_jax.agents.graders import run_grader
from gyre_jax.agents.tasks import tiny
t = tiny.make_task(3)
t = tiny.Task(**{**t.to_dict(), "grader": "gyre_jax.testing.flooding_grader:flooding_grader"})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = asyncio.run(run_grader(t, sys.argv[1], timeout_s=120))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kib": grown, "ok": out.ok, "score": out.score, "error": out.error, "details": out.details}))
"""


def test_grader_output_and_details_stay_bounded(tmp_path):
    # A grader printing 50 MiB on stdout and on stderr, with 50 MiB of details: the trainer's
    # peak memory does not grow by it (the old code buffered all of it), the grade stands,
    # and the details show head, tail and how much was dropped.
    import subprocess
    import sys

    from gyre_jax.agents.capture import RECORD_DEPTH, RECORD_DETAILS_BYTES, RECORD_ITEMS
    proc = subprocess.run([sys.executable, "-c", _FLOODED, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["grown_kib"] < 32 * 1024, got["grown_kib"]
    assert got["ok"] and got["score"] == 0.5, got["error"]
    details = got["details"]
    assert len(json.dumps(details).encode()) <= RECORD_DETAILS_BYTES
    log = details["log"]
    assert log.startswith("STARTxxx") and log.endswith("xxxEND") and " bytes not kept ...]" in log
    assert len(details["many"]) == RECORD_ITEMS + 1 and "more items not kept" in details["many"][-1]
    node, levels = details["deep"], 1
    while isinstance(node, dict):
        node, levels = node["d"], levels + 1
    assert levels == RECORD_DEPTH and "nested deeper" in node


def test_every_outcome_record_field_is_bounded():
    from gyre_jax.agents.capture import RECORD_DETAILS_BYTES, RECORD_TEXT_BYTES
    from gyre_jax.agents.harness import RolloutResult
    big = "e" * (10 << 20)
    r = RolloutResult(rollout_id="r", task_id="t", group_id="g", status="verifier_error", score=None,
                      grader_details={"log": big}, calls=0, retries=0, compactions=0, subagents=0, tool_calls=0,
                      tool_errors=0, finish_reason=big, error=big, wall_time_s=0.0, agent_time_s=0.0,
                      grader_time_s=0.0, workspace="w", t_end=0.0, sandbox={"snapshot": {"error": big}},
                      output_tail=big)
    d = r.to_outcome("run").details
    assert len(json.dumps(d).encode()) <= 3 * RECORD_DETAILS_BYTES
    assert len(d["error"].encode()) <= RECORD_TEXT_BYTES + 64 and "bytes not kept" in d["error"]
    for text in (d["grader"]["log"], d["harness"]["finish_reason"], d["harness"]["output_tail"],
                 d["harness"]["sandbox"]["snapshot"]["error"]):
        assert len(text.encode()) <= RECORD_TEXT_BYTES + 64 and text.startswith("eee") and "bytes not kept" in text


def test_forged_or_flooded_runner_lines_fail_checks_not_the_grader(task, tmp_path):
    # Agent code writes malformed results on every descriptor the runner might use for them
    # (missing fields, wrong types, unknown names, a line without end), then floods its
    # output: the grader still grades, and those checks simply fail.
    (m0, m1), pkg = _names(task)
    files = repo_spec.reference_files(task)
    names = [f"import:{m0['import']}"] + [f"defines:{m0['import']}.{f['name']}" for f in m0["functions"]]
    forged = [{"check": n, "ok": "yes", "note": 3} for n in names] + [  # "yes" passed as true
        [1, 2], {"check": ["x"]}, {"check": names[0], "ok": True, "note": {"deep": [[[]]]}}] + [
        {"check": n} for n in names]  # no "ok": the grader crashed (verifier_error)
    lines = "".join(json.dumps(x) + "\n" for x in forged) + "{" * 100000
    files[m0["path"]] = (f"import os\nfor fd in range(1, 10):\n    try:\n        os.write(fd, {lines!r}.encode())\n"
                         "    except OSError:\n        pass\nos.write(2, b'x' * (8 << 20))\nos._exit(0)\n")
    _write(tmp_path, files)
    g = grade_in_process(task, tmp_path)
    failed = _failed(g)
    assert set(names[1:]) <= failed and g.score < 1.0
    assert not any(c["check"].startswith(f"case:{m1['import']}") for c in g.details["checks"] if not c["ok"])
