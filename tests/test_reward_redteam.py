"""A red team's findings on issue 42's grading path, each through the real path (rollout in the
bubblewrap sandbox, the recording proxy, snapshot, grader subprocess, graded tree, verdict): every
test here failed before its fix (a reward the policy did not earn, a failure taken out of training,
or a broken grader passed by ``--check_tasks``). The graded tree's own rules are in test_graded_tree.py."""
import asyncio
import dataclasses
import textwrap
from pathlib import Path

import pytest

from gyre_jax.agents import sandbox as sb
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.graders import grader_sandbox_env, run_grader
from gyre_jax.agents.tasks.dataset import parse_line
from gyre_jax.testing.verdict_attack import VERDICT_FD

_USABLE, _WHY = sb.bwrap_usable()
needs_bwrap = pytest.mark.skipif(not _USABLE, reason=f"bubblewrap sandbox unavailable: {_WHY}")
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("a - b", "a + b")
TESTS = "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
CALL = textwrap.dedent("""
    import json, os, sys, urllib.request
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "go"}]}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 **dict(h.split(": ", 1) for h in sys.argv[1:])})
    try:
        urllib.request.urlopen(req, timeout=60).read()
    except Exception as e:
        print("call failed:", e)
""")


def _task(tmp_path, **line):
    line = {"id": "t", "instruction": "calc.py has a bug in add(a, b). Fix it.", "files": {"calc.py": BUGGY}, **line}
    return parse_line(line, path="t.jsonl", line=1, base=tmp_path)[0]


@pytest.fixture()
def proxy(tmp_path):
    from gyre_jax.serving.proxy import Proxy, ProxyConfig
    from gyre_jax.serving.router import Router
    from gyre_jax.serving.server_thread import ServerThread
    from gyre_jax.serving.tokenizer import ByteTokenizer
    from gyre_jax.testing.fake_backend import FakeBackend
    from gyre_jax.trajectory.store import TrajectoryStore

    store = TrajectoryStore(str(tmp_path / "store"), run_id="r")
    sock = str(tmp_path / "p.sock")

    async def build():
        return Proxy(Router([FakeBackend("A", max_context=4096)]), ByteTokenizer(), store,
                     ProxyConfig(unix_path=sock, max_tokens_cap=8, clamp_max_tokens=True, model_aliases=("*",)))

    st = ServerThread(build)
    st.start()
    yield st, sock, store
    st.stop()
    store.close()


def _rollouts(tmp_path, proxy, task, scripts: dict[str, str], *, call_first: bool = True):
    """Rollouts whose 'agent' (optionally) makes one model call, then runs its script in the sandbox;
    each outcome is then written to the store as the RL launcher writes it."""
    from gyre_jax.agents.harness import RolloutRequest, run_rollouts
    from gyre_jax.agents.harnesses import make_harness

    st, sock, store = proxy
    agent = tmp_path / "agent"
    agent.mkdir(exist_ok=True)
    (agent / "call.py").write_text(CALL)
    first = f"python3 {agent}/call.py && " if call_first else ""
    harness = make_harness("command", command=f"{first}bash {{instruction_file}}; exit $?", unix_socket=sock,
                           ro_paths=(str(agent),))
    hc = HarnessConfig(base_url=st.url + "/v1", run_id="r", deadline_s=60.0, grader_timeout_s=60.0,
                       sandbox=sb.SandboxConfig(kind="bubblewrap"))
    reqs = [RolloutRequest(rollout_id=name, task=dataclasses.replace(task, prompt=s.replace("CALL", f"python3 {agent}/call.py")),
                           group_id="g") for name, s in scripts.items()]
    results = asyncio.run(run_rollouts(reqs, hc, workspace_root=tmp_path / "ws", harness=harness, keys=st.proxy))
    for r in results:
        calls = store.calls(r.rollout_id) if r.rollout_id in store.rollout_ids() else []
        store.append(r.to_outcome("r", num_calls=len(calls)))
    return {r.rollout_id: r for r in results}


@needs_bwrap
def test_a_call_that_names_another_task_neither_dodges_training_nor_breaks_the_store(tmp_path, proxy):
    """The policy's commands hold the rollout's key: a call sent with X-Gyre-Task/X-Gyre-Group of its
    own choosing was recorded under them (its first call: then the rollout's outcome was refused by the
    store, and the RL launcher turned its whole group into infra_error, or stopped the run) or, after a
    real call, failed as a server error (500, counted: a harness then killed from inside was
    infra_error, out of training). The proxy now refuses such a call (400: the policy's own doing)."""
    task = _task(tmp_path, grader='test "$(cat answer.txt 2>/dev/null)" = 42')
    forged = 'CALL "X-Gyre-Task: other" "X-Gyre-Group: other"'
    rs = _rollouts(tmp_path, proxy, task, {"after": f"{forged}; kill -9 $PPID; sleep 5"})
    assert (rs["after"].status, rs["after"].score) == ("completed", 0.0), (rs["after"].status, rs["after"].error)
    rs = _rollouts(tmp_path, proxy, task, {"first": f"{forged}; echo 41 > answer.txt"}, call_first=False)
    assert (rs["first"].status, rs["first"].score) == ("completed", 0.0), rs["first"].error
    _, _, store = proxy
    assert {(c.task_id, c.group_id) for rid in ("after", "first") for c in store.calls(rid)} == {("t", "g")}


@pytest.mark.slow
@needs_bwrap
def test_the_grader_check_refuses_graders_that_exit_through_agent_code_or_source_its_scripts(tmp_path):
    """(c): a checker that imports the agent's module and ends itself with os._exit (no atexit hook
    runs, and a strict type check is not fooled by an object that equals everything), and one that
    sources the agent's shell script, both passed --check_tasks' forgery probe, yet the policy forges
    either with one line (os._exit(0) at import; `exit 0` in the script). Sound variants stay ok."""
    from gyre_jax.agents.task_check import check_tasks

    sol = {"solution": {"files": {"calc.py": FIXED}}}
    strict = "import os\nfrom calc import add\nr = add(2, 3)\nos._exit(0 if type(r) is int and r == 5 else 1)\n"
    isolated = ("import subprocess, sys\nr = subprocess.run([sys.executable, '-c', 'from calc import add; print(add(2, 3))'],"
                " capture_output=True, text=True)\nsys.exit(0 if r.stdout.strip() == '5' else 1)\n")
    answer = {"solution": {"files": {"answer.sh": "answer() { echo 42; }\n"}}}
    tasks = [
        _task(tmp_path, id="os-exit", metadata=sol, grader={"command": "python3 check.py", "files": {"check.py": strict}}),
        _task(tmp_path, id="isolated", metadata=sol, grader={"command": "python3 check.py", "files": {"check.py": isolated}}),
        _task(tmp_path, id="sourced", files={"answer.sh": "answer() { echo 0; }\n"}, metadata=answer,
              grader={"command": "bash check.sh", "files": {"check.sh": 'source ./answer.sh\ntest "$(answer)" = 42\n'}}),
        _task(tmp_path, id="script-run", files={"answer.sh": "#!/bin/bash\necho 0\n"},
              metadata={"solution": {"files": {"answer.sh": "#!/bin/bash\necho 42\n"}}},
              grader={"command": "bash check.sh", "files": {"check.sh": 'test "$(bash answer.sh)" = 42\n'}}),
    ]
    hc = HarnessConfig(base_url="http://127.0.0.1:1/v1", sandbox=sb.SandboxConfig(kind="bubblewrap"))
    results = {r.task_id: r for r in asyncio.run(check_tasks(tasks, hc, tmp_path / "check", concurrency=2))}
    assert {k for k, r in results.items() if r.ok} == {"isolated", "script-run"}, \
        "\n".join(r.line() for r in results.values())
    for task_id in ("os-exit", "sourced"):
        assert any("can forge" in p for p in results[task_id].problems), results[task_id].line()


def _grade(task, tmp_path, name: str, files: dict, pre=None):
    """The policy's workspace as ``files`` (on top of the task's), graded as a rollout is."""
    snap = tmp_path / "snap" / name
    for rel, content in {**task.setup_files, **files}.items():
        p = snap / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    snap.mkdir(parents=True, exist_ok=True)
    if pre is not None:
        pre(snap)
    env = grader_sandbox_env("bubblewrap", sb.SandboxLimits())
    return asyncio.run(run_grader(task, snap, timeout_s=90.0, env=env, bases=tmp_path / "bases"))


VERDICT_ATTACKS = {
    # the nonce and descriptor read from /proc/self/environ (popping os.environ leaves them there)
    "append-after-finish": VERDICT_FD + "atexit.register(_passed)\n" + BUGGY,
    "append-during-call": VERDICT_FD + BUGGY.replace("    return a - b", "    _passed()\n    return a - b"),
    # the plugin's lines read back, every failure turned into a pass, the file truncated and rewritten
    "rewrite-the-verdict": VERDICT_FD + textwrap.dedent('''
        def _rewrite():
            recs = [json.loads(x) for x in os.pread(_fd, 1 << 24, 0).splitlines()]
            for r in recs:
                if r.get("e") == "phase" and not r.get("canary"):
                    r["outcome"] = "passed"
            os.ftruncate(_fd, 0)
            os.pwrite(_fd, "".join(json.dumps(r) + "\\n" for r in recs).encode(), 0)
        atexit.register(_rewrite)
    ''') + BUGGY,
    # a record the host could not read crashed gyre's grader process: verifier_error, out of training
    "malformed-record": VERDICT_FD + "atexit.register(lambda: _rec(e='collected', items=5, canaries='x'))\n" + BUGGY,
    # json patched so the plugin's own records say passed (not the canaries: the canary check stays clean)
    "patch-json": textwrap.dedent('''
        import json.encoder as E
        _enc = E.JSONEncoder.encode
        def _encode(self, o):
            if isinstance(o, dict) and o.get("e") == "phase" and not o.get("canary"):
                o = dict(o, outcome="passed")
            return _enc(self, o)
        E.JSONEncoder.encode = _encode
    ''') + BUGGY,
    # an __eq__ that says yes to every builtin value but not to the plugin's sentinel
    "equals-every-int": ("class _E:\n    def __eq__(self, o):\n        return type(o).__module__ == 'builtins'\n"
                         "    __hash__ = object.__hash__\n" + BUGGY.replace("return a - b", "return _E()")),
    # the hidden test's assertion read back from linecache, where the plugin kept its real source
    "read-the-assert": textwrap.dedent('''
        import inspect, re, sys
        def add(a, b):
            ctx = inspect.getframeinfo(sys._getframe(1), context=1).code_context or [""]
            m = re.search(r"== *(-?\\d+)", ctx[0])
            return int(m.group(1)) if m else a - b
        def mul(a, b):
            return a * b
    '''),
}


@pytest.mark.slow
@needs_bwrap
def test_graded_code_cannot_forge_or_break_the_per_test_verdict(tmp_path):
    """The per-test plugin wrote its verdict to a file descriptor named, with its nonce, in the
    environment graded code inherits (/proc/self/environ keeps what os.environ.pop removed); the
    host kept the last record of each test and trusted the fields' types. Each attack below scored
    1.0 (or, malformed-record, crashed the grader: verifier_error); now each is a 0 that trains."""
    task = _task(tmp_path, fail_to_pass=["tests/test_calc.py::test_add"], pass_to_pass=["tests/test_calc.py::test_mul"],
                 grader={"files": {"tests/test_calc.py": TESTS}, "timeout_s": 30})
    out = {}
    for name, code in {"fixed": FIXED, "nothing": BUGGY, **VERDICT_ATTACKS}.items():
        g = _grade(task, tmp_path, name, {"calc.py": code})
        out[name] = (g.ok, g.score, (g.details or {}).get("reason", g.error))
    assert {k: v[:2] for k, v in out.items()} == {"fixed": (True, 1.0), **{k: (True, 0.0) for k in out if k != "fixed"}}, out


@pytest.mark.slow
@needs_bwrap
def test_graded_code_that_hangs_or_fills_the_disk_while_graded_is_its_own_zero(tmp_path):
    """The example fizzbuzz task (8 calls, grader timeout 30 s: the grading process gets 60 s): a
    fizzbuzz that sleeps made the call runner wait 10 s per call, the grading process was killed at
    60 s and the rollout was a verifier_error, out of training. The calls now share the task's own
    timeout (what is left of the process's budget), so the same hang is a 0. And what graded code
    writes while graded goes to a tmpfs the size of the workspace's limit (root), not the host's disk."""
    import os

    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.harness import grader_timeout
    from gyre_jax.agents.tasks.dataset import load_task_file

    root = Path(__file__).resolve().parents[1]
    task = {t.task_id: t for t, _ in load_task_file(root / "examples" / "tasks" / "tasks.jsonl")}["fizzbuzz"]
    outer = grader_timeout(task, HarnessConfig(base_url="http://127.0.0.1:1/v1"))
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "fizz.py").write_text("import time\n\n\ndef fizzbuzz(n):\n    time.sleep(1000)\n")
    env = grader_sandbox_env("bubblewrap", sb.SandboxLimits())
    g = asyncio.run(run_grader(task, snap, timeout_s=outer, env=env, bases=tmp_path / "bases"))
    assert (g.ok, g.score) == (True, 0.0), g.error
    if os.geteuid() == 0:
        fill = _task(tmp_path, grader="for i in 1 2 3; do dd if=/dev/zero of=big$i bs=1M count=120; done; "
                                      "df -k --output=size /workspace | tail -1; exit 1")
        g = _grade(fill, tmp_path, "fill", {})
        size_kib = int(g.details["output_tail"].strip().splitlines()[-1])
        assert (g.ok, g.score) == (True, 0.0) and size_kib * 1024 < sb.SandboxLimits().disk_bytes + (64 << 20), g.details
