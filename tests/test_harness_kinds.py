"""Bring your own agent: a harness is a command (run inside the rollout's sandbox, reaching only
the proxy) or a Python function; tasks come from a JSONL file graded by a command.

A live proxy on loopback (and its unix socket) over a fake model that always answers
"hello", a real TrajectoryStore, real bubblewrap sandboxes, real grader subprocesses. Network
checks only ever target 127.0.0.1 on this machine.
"""
import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from gyre_jax.agents import sandbox as sb
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.harness import RolloutRequest, run_rollouts
from gyre_jax.agents.harnesses import make_harness
from gyre_jax.agents.task_sources import DatasetSource, make_source
from gyre_jax.agents.tasks import dataset
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.fake_backend import FakeBackend
from gyre_jax.trajectory import vocab
from gyre_jax.trajectory.store import TrajectoryStore

_USABLE, _WHY = sb.bwrap_usable()
needs_bwrap = pytest.mark.skipif(not _USABLE, reason=f"bubblewrap sandbox unavailable: {_WHY}")
TOK = ByteTokenizer()
IM_END = TOK.special["<|im_end|>"]
RUN = "byoa"


def _reply_backend(text: str = "hello") -> FakeBackend:
    ids = TOK.encode(text) + [IM_END]

    def script_for(req):
        n0 = len(req.prompt_ids)
        return lambda seq: ids[min(len(seq) - n0, len(ids) - 1)]

    return FakeBackend("A", script_for=script_for, max_context=4096)


@pytest.fixture()
def proxy(tmp_path):
    store = TrajectoryStore(str(tmp_path / "store"), run_id=RUN)
    sock = str(tmp_path / "proxy.sock")

    async def build():
        return Proxy(Router([_reply_backend()]), TOK, store,
                     ProxyConfig(auth_token="run-secret-123", unix_path=sock, max_tokens_cap=64))

    st = ServerThread(build)
    st.start()
    yield st, store, sock
    st.stop()
    store.close()


def _task_file(tmp_path, lines) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def _config(url, **kw):
    return HarnessConfig(base_url=url + "/v1", run_id=RUN, deadline_s=kw.pop("deadline_s", 60.0),
                         grader_timeout_s=60.0, sandbox=sb.SandboxConfig(kind=kw.pop("sandbox", "bubblewrap")), **kw)


AGENT = textwrap.dedent("""
    import json, os, socket
    from openai import OpenAI
    llm = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    r = llm.chat.completions.create(model=os.environ["GYRE_MODEL"], max_tokens=8,
                                    messages=[{"role": "user", "content": open(os.environ["GYRE_INSTRUCTION_FILE"]).read()}])
    open("answer.txt", "w").write(r.choices[0].message.content)
    probe = {"cwd": os.getcwd(), "instruction": os.environ.get("GYRE_INSTRUCTION"),
             "key_is_issued": os.environ["OPENAI_API_KEY"].startswith("gk-"), "host_port": None}
    try:  # the proxy's TCP port on the host: unreachable from the sandbox's own network namespace
        socket.create_connection(("127.0.0.1", int(os.environ["HOST_PORT"])), timeout=2).close()
        probe["host_port"] = "reached"
    except OSError as e:
        probe["host_port"] = type(e).__name__
    open("probe.json", "w").write(json.dumps(probe))
""")


@needs_bwrap
def test_command_harness_runs_in_sandbox_reaches_only_the_proxy_and_is_graded(proxy, tmp_path):
    st, store, sock = proxy
    port = st.url.rsplit(":", 1)[1]
    path = _task_file(tmp_path, [{"id": "say-hello", "instruction": "Say hello.",
                                  "grader": 'test "$(cat answer.txt)" = hello'}])
    (task, _), = dataset.load_task_file(path)
    agent_dir = tmp_path / "agent"  # the agent's own code, read-only (under the host's /tmp: over the sandbox's)
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(AGENT)
    harness = make_harness("command", command=f"python {agent_dir}/agent.py; touch {agent_dir}/x 2>/dev/null; true",
                           unix_socket=sock, env={"HOST_PORT": port}, ro_paths=(str(agent_dir),))
    reqs = [RolloutRequest(rollout_id=f"g0-{k}", task=task, group_id="g0") for k in range(2)]
    results = asyncio.run(run_rollouts(reqs, _config(st.url), workspace_root=tmp_path / "ws", harness=harness,
                                       keys=st.proxy))
    for r in results:
        assert (r.status, r.score, r.exit_code, r.harness_kind) == ("completed", 1.0, 0, "command"), r.error
        probe = json.loads((tmp_path / "ws" / ".snapshots" / r.rollout_id / "probe.json").read_text())
        assert probe == {"cwd": "/workspace", "instruction": "Say hello.", "key_is_issued": True,
                         "host_port": "ConnectionRefusedError"}
        (rec,) = store.calls(r.rollout_id)  # recorded under its own rollout, by its key alone
        assert (rec.run_id, rec.task_id, rec.group_id, rec.call_index) == (RUN, "say-hello", "g0", 0)
        assert TOK.decode(rec.output_ids.tolist()).startswith("hello")
    assert not st.proxy._keys  # every key revoked at its rollout's end
    assert sorted(os.listdir(agent_dir)) == ["agent.py"]  # read-only inside


_PEER_ATTACK = r"""P='{"model":"gyre","prompt":[1,2],"max_tokens":2}'
c() { curl -s -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' "$@" -d "$P" "$OPENAI_BASE_URL/completions"; }
echo "DERIVED=$(c -H 'Authorization: Bearer gyre:byoa:peer-0') OWNKEY=$(c -H "Authorization: Bearer $OPENAI_API_KEY" \
  -H 'X-Gyre-Run: byoa' -H 'X-Gyre-Rollout: peer-0') HEADERS=$(c -H 'X-Gyre-Run: byoa' -H 'X-Gyre-Rollout: peer-0') \
  SESSION=$(c -H 'X-Claude-Code-Session-Id: peer-0') OWN=$(c -H "Authorization: Bearer $OPENAI_API_KEY")"
echo done > answer.txt"""


@needs_bwrap
@pytest.mark.parametrize("auth_token", [None, "run-secret-123"], ids=["auth-off", "auth-on"])
def test_from_inside_a_sandbox_no_call_reaches_a_peer_rollout(tmp_path, auth_token):
    """A rollout's command, through the real sandbox and bridge, tries to put a call into a running peer's
    record: the peer's key derived from its id (``gyre:<run>:<peer>``), its own key with the peer's headers,
    the headers alone, Claude Code's session header. Every one is refused, with auth on or off (the proxy's
    default config): the only credential that names a rollout is the random key the proxy issued for it."""
    store = TrajectoryStore(str(tmp_path / "store"), run_id=RUN)
    sock = str(tmp_path / "proxy.sock")

    async def build():
        return Proxy(Router([_reply_backend()]), TOK, store,
                     ProxyConfig(auth_token=auth_token, unix_path=sock, max_tokens_cap=64))

    st = ServerThread(build)
    st.start()
    try:
        peer_key = st.proxy.issue(RUN, "peer-0", "t", "g0")  # a peer rollout running beside it
        path = _task_file(tmp_path, [{"id": "t", "instruction": "x", "grader": "test -f answer.txt"}])
        (task, _), = dataset.load_task_file(path)
        harness = make_harness("command", command=_PEER_ATTACK, unix_socket=sock)
        r, = asyncio.run(run_rollouts([RolloutRequest(rollout_id="atk-0", task=task, group_id="g0")],
                                      _config(st.url), workspace_root=tmp_path / "ws", harness=harness,
                                      keys=st.proxy))
        log = open(r.log_path).read()
        assert r.status == "completed", (r.error, log)
        assert "DERIVED=401 OWNKEY=403 HEADERS=401 SESSION=401 OWN=200" in " ".join(log.split()), log
        assert "peer-0" not in store.rollout_ids() and len(store.calls("atk-0")) == 1
        assert peer_key.startswith("gk-") and "peer-0" not in peer_key  # random, not derived from the id
    finally:
        st.stop()
        store.close()


@needs_bwrap
def test_command_harness_failures_are_recorded_statuses_never_scores(proxy, tmp_path):
    st, _, sock = proxy
    path = _task_file(tmp_path, [{"id": "t", "instruction": "x", "grader": "test -f answer.txt",
                                  "timeout_s": 4}])
    (task, _), = dataset.load_task_file(path)
    cases = {
        # garbage flooding its output, then a non-zero exit: infra_error with the exit code, output bounded
        "flood": ("python -c \"import sys; sys.stdout.write('garbage ' * 2_000_000); sys.exit(3)\"",
                  vocab.STATUS_INFRA_ERROR, "exited with code 3"),
        # hangs past the task's 4 s deadline (and its process ignores SIGTERM): timeout, graded on the workspace
        "hang": ("echo partial > answer.txt; trap '' TERM; sleep 300 # gyre-hang-marker", vocab.STATUS_TIMEOUT,
                 None),
        "missing": ("no-such-agent-cli --task x", vocab.STATUS_INFRA_ERROR, "exited with code 127"),
    }
    for name, (command, want, why) in cases.items():
        harness = make_harness("command", command=command, unix_socket=sock, output_bytes=4096)
        r, = asyncio.run(run_rollouts([RolloutRequest(rollout_id=f"{name}-0", task=task, group_id=name)],
                                      _config(st.url), workspace_root=tmp_path / name, harness=harness,
                                      keys=st.proxy))
        assert r.status == want, (name, r.status, r.error)
        if want == vocab.STATUS_INFRA_ERROR:
            assert r.score is None and "harness failed" in r.error and why in r.error
            assert len(open(r.log_path).read()) < 3 * 4096 and len(r.output_tail) <= 2048
        else:
            assert r.score == 1.0 and r.agent_time_s < 30  # graded for partial credit on what it left
    flood = open(tmp_path / "flood" / ".logs" / "flood-0.log").read()
    assert flood.startswith("garbage garbage") and "bytes not kept" in flood
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, b"gyre-hang-marker")]


def _cmdline_has(pid: str, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


def test_python_harness_and_keys(proxy, tmp_path):
    st, store, _ = proxy
    path = _task_file(tmp_path, [{"id": "py", "instruction": "Say hello.", "grader": 'grep -q hello answer.txt'}])
    (task, _), = dataset.load_task_file(path)
    harness = make_harness("python", entry="gyre_jax.testing.scripted_harnesses:answer_once")
    ok, = asyncio.run(run_rollouts([RolloutRequest(rollout_id="py-0", task=task, group_id="py")],
                                   _config(st.url, sandbox="none"), workspace_root=tmp_path / "a", harness=harness,
                                   keys=st.proxy))
    assert (ok.status, ok.score, ok.calls, ok.finish_reason) == ("completed", 1.0, 1, "answered")
    assert len(store.calls("py-0")) == 1
    crash = make_harness("python", entry="gyre_jax.testing.scripted_harnesses:crash")
    bad, = asyncio.run(run_rollouts([RolloutRequest(rollout_id="py-1", task=task, group_id="py")],
                                    _config(st.url, sandbox="none"), workspace_root=tmp_path / "b", harness=crash,
                                    keys=st.proxy))
    assert bad.status == vocab.STATUS_INFRA_ERROR and "scripted harness crash" in bad.error and bad.score is None
    with pytest.raises(LookupError, match="no attribute 'nope'"):
        make_harness("python", entry="gyre_jax.testing.scripted_harnesses:nope")
    with pytest.raises(LookupError, match="unknown harness kind 'shell'; known"):
        make_harness("shell")
    # A key is good for its own rollout only, and for nothing once revoked.
    key = st.proxy.issue(RUN, "r-a", "t", "g")
    body = {"model": "gyre", "prompt": [1, 2], "max_tokens": 2}
    hdr = {"Authorization": f"Bearer {key}", "X-Gyre-Run": RUN, "X-Gyre-Rollout": "r-b"}
    assert _post(st.url + "/v1/completions", body, hdr)[0] == 403
    st.proxy.revoke(key)
    assert _post(st.url + "/v1/completions", body, {"Authorization": f"Bearer {key}"})[0] == 401
    assert _post(st.url + "/metrics", None, {})[0] in (401, 405)


def _post(url, body, headers):
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **headers},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---------------------------------------------------------------- the task file
def test_task_file_errors_name_line_and_field(tmp_path):
    good = {"id": "a", "instruction": "do it", "grader": "true"}
    cases = [
        ([good, "not json"], "tasks.jsonl:2: not valid JSON"),
        ([good, {**good, "id": "b", "grader": 5}], "tasks.jsonl:2: grader: must be a command string"),
        ([{**good, "files": {"../x": "y"}}], "tasks.jsonl:1: files: '../x' must be a relative path"),
        ([good, {**good}], "tasks.jsonl:2: id: 'a' is already used on line 1"),
        ([{**good, "instrucion": "typo"}], "tasks.jsonl:1: instrucion: unknown field"),
        ([{"id": "a", "grader": "true"}], "tasks.jsonl:1: instruction: missing"),
        ([{**good, "timeout_s": float("nan")}], "tasks.jsonl:1: timeout_s: must be a positive number"),
        ([{**good, "split": "test"}], "tasks.jsonl:1: split: must be one of"),
        ([{**good, "repo": "nowhere"}], "tasks.jsonl:1: repo: .*nowhere is not a directory"),
        ([{**good, "split": "eval"}], "tasks.jsonl: split: no task has split 'train'"),
    ]
    for lines, match in cases:
        path = tmp_path / "tasks.jsonl"
        path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
        with pytest.raises(dataset.TaskFileError, match=match):
            DatasetSource(str(path))


def test_task_file_grain_order_repo_and_splits(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "lib.py").write_text("v = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    first = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (repo / "lib.py").write_text("v = 2\n")
    subprocess.run(git + ["commit", "-qam", "two"], check=True)
    lines = [{"id": f"t{i}", "instruction": f"task {i}", "grader": "true"} for i in range(5)]
    lines += [{"id": "e0", "instruction": "held out", "grader": "true", "split": "eval"},
              {"id": "r", "instruction": "repo", "grader": "true", "repo": {"path": "repo", "commit": first}}]
    src = make_source("dataset", path=_task_file(tmp_path, lines), seed=3)
    assert [t.task_id for t in src.eval_tasks(10)] == ["e0"]
    epoch0 = [src.train_task(g).task_id for g in range(6)]
    epoch1 = [src.train_task(g).task_id for g in range(6, 12)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(["t0", "t1", "t2", "t3", "t4", "r"])
    assert epoch0 != epoch1  # reshuffled every epoch
    again = make_source("dataset", path=_task_file(tmp_path, lines), seed=3)
    assert [again.train_task(g).task_id for g in range(12)] == epoch0 + epoch1  # the group number IS the position
    (rtask,) = [t for t in src.train if t.task_id == "r"]
    from gyre_jax.agents.harness import prepare_workspace

    ws = prepare_workspace(tmp_path / "ws", "x", rtask)
    assert (ws / "lib.py").read_text() == "v = 1\n"  # checked out at the task's commit
    with pytest.raises(LookupError, match="no scripted demonstrations"):
        src.demo_tasks(1)


@pytest.mark.parametrize("command,verdict,score,fault", [
    ("exit 0", "exit_code", 1.0, None),
    ("exit 1", "exit_code", 0.0, None),
    ("echo '{\"score\": 0.25}' > $GYRE_VERDICT", "file", 0.25, None),
    ("echo '{\"score\": 0.25}'", "exit_code", 1.0, "prints a score"),  # stdout is never a score
    ("echo '{\"score\": 1}' > $GYRE_VERDICT; exit 1", "file", 0.0, None),  # a non-zero exit is always 0
    ("echo '{\"score\": 1.5}' > $GYRE_VERDICT", "file", 0.0, "must hold"),
    ("echo '{\"error\": \"fixture missing\"}' > $GYRE_VERDICT", "file", 0.0, "fixture missing"),
    ("true", "file", 0.0, "without writing"),
    ("no-such-test-runner", "exit_code", 0.0, "could not run"),
    ("sleep 30", "exit_code", 0.0, None),
])
def test_grader_command_scoring(tmp_path, command, verdict, score, fault):
    """A command grader's verdict (verdict_command): its exit status, or $GYRE_VERDICT; every failure of
    the command is a 0, with a grader fault named where the grader itself looks broken."""
    from gyre_jax.agents.graders import grade_in_process
    from gyre_jax.agents.tasks.base import Task

    task = Task(task_id="g", family="dataset", prompt="p", grader=dataset.GRADER, hidden_files={"hidden.txt": "h"},
                params={"grader_mode": "command", "grader_command": command, "grader_verdict": verdict,
                        "grader_timeout_s": 1.0})
    ws = tmp_path / "snap"
    ws.mkdir()
    g = grade_in_process(task, ws)
    assert g.score == score, g.details
    assert g.details.get("timed_out", False) == (command == "sleep 30")
    assert (g.details["grader_fault"] is None) == (fault is None), g.details["grader_fault"]
    assert fault is None or fault in g.details["grader_fault"]
    assert not (ws / "hidden.txt").exists()  # hidden files go into the graded tree, never the snapshot


def test_a_kind_registered_first_keeps_the_built_in_kinds():
    """A user's registration before any make_harness (its module imported at start-up) used to
    leave the registry non-empty, so the built-in kinds were never added: 'builtin' was unknown."""
    code = textwrap.dedent("""
        import json
        from gyre_jax.agents.harnesses import HARNESS_KINDS, make_harness
        HARNESS_KINDS.register("toy", summary="a test's")(lambda options, **_: object())
        make_harness("builtin")
        print(json.dumps(HARNESS_KINDS.names()))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert {"builtin", "command", "python", "toy"} <= set(json.loads(p.stdout.splitlines()[-1]))
