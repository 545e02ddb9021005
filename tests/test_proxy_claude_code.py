"""The real Claude Code CLI, unchanged, pointed at the proxy (offline).

Needs the CLI: ``npm install @anthropic-ai/claude-code`` (then ``node install.cjs``
in the package folder) and ``GYRE_CLAUDE_BIN=/path/to/bin/claude.exe`` (or
``claude`` on PATH); skipped otherwise. The model behind the proxy is a scripted
fake, so the first test checks the API surface: request parsing (system turns,
24 tools, tool_result), streamed events, the tool round trip, and one record per
call. The second sends the CLI's real first request (~76K byte tokens) to the tiny
real model behind ``python -m launch.main --config configs/serve.py``: the engine
prefills it in chunks (blockwise attention) and the CLI gets an answer it parses.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.fake_backend import FakeBackend
from gyre_jax.trajectory.store import TrajectoryStore

CLAUDE = os.environ.get("GYRE_CLAUDE_BIN") or shutil.which("claude")
TOK = ByteTokenizer()
GEN = [TOK.special["<|im_start|>"]] + TOK.encode("assistant\n")
FINAL = TOK.encode("the tool said gyre-tool-ok") + [TOK.special["<|im_end|>"]]


def tool_answer(model_id):
    tc = {"name": "Bash", "arguments": {"command": "echo gyre-tool-ok", "description": "echo"}}
    return TOK.render_tool_call({**tc, "id": model_id} if model_id else tc) + [TOK.special["<|im_end|>"]]


def make_script(tool):
    def script(seq):
        """First turn: call Bash; once a tool result with its output is in the prompt: answer."""
        seq = [int(t) for t in seq]
        for i in range(len(seq) - len(GEN), -1, -1):
            if seq[i:i + len(GEN)] == GEN:
                answer = FINAL if b"gyre-tool-ok\n" in bytes(t for t in seq[:i] if t < 256) else tool
                return answer[min(len(seq) - i - len(GEN), len(answer) - 1)]
        return TOK.special["<|im_end|>"]
    return script


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed (set GYRE_CLAUDE_BIN)")
@pytest.mark.parametrize("model_id", ["toolu_01", "call_x1", None])  # the model's own id, or none (invented)
def test_claude_code_cli_runs_a_tool_through_the_proxy(tmp_path, model_id):
    store = TrajectoryStore(str(tmp_path / "store"), run_id="cc")
    TOOL = tool_answer(model_id)

    async def build():
        return Proxy(Router([FakeBackend("A", script=make_script(TOOL), max_context=1_000_000)]), TOK, store,
                     ProxyConfig(model_aliases=("claude-*",), clamp_max_tokens=True, max_tokens_cap=4096))

    st = ServerThread(build)
    url = st.start()
    try:
        home = tmp_path / "home"
        home.mkdir()
        env = dict(os.environ, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="gyre:cc:rollout-1",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", HOME=str(home))
        p = subprocess.run([CLAUDE, "-p", "use the Bash tool to echo something", "--allowedTools", "Bash"],
                           env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        st.stop()
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "the tool said gyre-tool-ok" in p.stdout
    calls = store.calls("rollout-1")
    assert [c.call_index for c in calls] == [0, 1]
    assert calls[0].output_ids.tolist() == TOOL and calls[0].finish_reason == "tool_calls"
    assert calls[1].output_ids.tolist() == FINAL and calls[1].finish_reason == "stop"
    # the second prompt holds the first call's tool call and the tool's real output
    assert b"gyre-tool-ok\n" in bytes(t for t in calls[1].prompt_ids.tolist() if t < 256)
    first, second = calls[0].sequence.tolist(), calls[1].prompt_ids.tolist()
    shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(first))
    print(f"\ncall 1 prompt+output {len(first)} tokens; call 2 prompt {len(second)} tokens; shared prefix {shared}")
    assert shared == len(first)  # re-rendered exactly: the rollout's calls form one prefix-sharing path
    store.close()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed (set GYRE_CLAUDE_BIN)")
def test_claude_code_first_request_is_prefilled_by_the_real_engine(tmp_path):
    """The serve command with a 96K context answers the CLI's ~76K-token first request (several minutes on CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "launch.main", "--config", "configs/serve.py", "--workdir", str(tmp_path / "serve"),
           "--config.num_cpu_devices=1", "--config.model.max_seq_len=98304", "--config.cells.max_slots=1",
           "--config.cells.kv_budget_gib=1.0", "--config.proxy.model_aliases=claude-*", "--config.proxy.max_tokens_cap=8",
           "--config.run_id=cc"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    out, url, t0 = [], None, time.time()
    try:
        while "engines ready" not in "".join(out[-1:]):
            try:
                out.append(lines.get(timeout=max(0.1, 300 - (time.time() - t0))))
            except queue.Empty:
                pytest.fail("serve did not get ready in 300 s:\n" + "".join(out))
            m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", out[-1])
            url = m.group(1) if m else url
        home = tmp_path / "home"
        home.mkdir()
        cc_env = dict(os.environ, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="gyre:cc:rollout-long",
                      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", HOME=str(home),
                      API_TIMEOUT_MS="1800000", CLAUDE_CODE_MAX_RETRIES="0")
        t1 = time.time()
        p = subprocess.run([CLAUDE, "-p", "say hi"], env=cc_env, capture_output=True, text=True, timeout=1800,
                           cwd=tmp_path)
        answer_s = time.time() - t1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The random tiny model rarely ends its turn within the 8-token cap: then the CLI read the whole stream
    # up to message_delta's stop_reason "max_tokens" and says so (exit 1), which is a parsed answer too.
    parsed = p.returncode == 0 or "output token maximum" in p.stdout
    assert parsed, (p.returncode, p.stdout[-2000:], p.stderr[-2000:], "".join(out[-30:]))
    store = TrajectoryStore(str(tmp_path / "serve" / "store"), run_id="cc", writable=False)
    calls = store.calls("rollout-long")
    assert len(calls) >= 1
    first = calls[0]
    print(f"\nfirst request: {len(first.prompt_ids)} prompt tokens, {len(first.output_ids)} output tokens, "
          f"CLI answered in {answer_s:.0f} s; stdout {p.stdout.strip()[:80]!r}")
    assert len(first.prompt_ids) > 65_000  # the CLI's real system prompt and 24 tool schemas, as byte tokens
    assert 1 <= len(first.output_ids) <= 8
    assert first.finish_reason == ("length" if p.returncode else "stop"), (first.finish_reason, p.returncode)
    store.close()


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed (set GYRE_CLAUDE_BIN)")
def test_claude_code_as_a_command_harness_in_the_rollout_sandbox(tmp_path):
    """Claude Code as the run's harness (harness.kind=command): the CLI runs inside the rollout's
    bubblewrap sandbox, reaches only the proxy (its unix socket, bridged to the sandbox's own
    loopback), its calls are recorded under the rollout's issued key, its Bash tool acts in the
    workspace, and the task's command grades what it left there."""
    import asyncio
    import json

    from gyre_jax.agents import sandbox as sb
    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.harness import RolloutRequest, run_rollouts
    from gyre_jax.agents.harnesses import make_harness
    from gyre_jax.agents.tasks import dataset

    ok, why = sb.bwrap_usable()
    if not ok:
        pytest.skip(f"bubblewrap sandbox unavailable: {why}")
    tc = {"name": "Bash", "arguments": {"command": "echo gyre-tool-ok | tee out.txt", "description": "echo"}}
    tool = TOK.render_tool_call(tc) + [TOK.special["<|im_end|>"]]
    store = TrajectoryStore(str(tmp_path / "store"), run_id="ccrun")
    sock = str(tmp_path / "p.sock")

    async def build():
        return Proxy(Router([FakeBackend("A", script=make_script(tool), max_context=1_000_000)]), TOK, store,
                     ProxyConfig(auth_token="run-secret-123", unix_path=sock, model_aliases=("*",),
                                 clamp_max_tokens=True, max_tokens_cap=4096))

    st = ServerThread(build)
    st.start()
    try:
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"id": "echo", "instruction": "Use the Bash tool to echo gyre-tool-ok into out.txt.",
                                     "grader": "grep -q gyre-tool-ok out.txt"}) + "\n")
        (task, _), = dataset.load_task_file(str(tasks))
        claude = os.path.realpath(CLAUDE)
        harness = make_harness(
            "command", command=f'{claude} -p "$(cat {{instruction_file}})" --allowedTools Bash', unix_socket=sock,
            ro_paths=(os.path.dirname(claude),), memory_bytes=32 << 30,
            env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"})
        hc = HarnessConfig(base_url=st.url + "/v1", run_id="ccrun", sandbox=sb.SandboxConfig(kind="bubblewrap"),
                           deadline_s=240.0, grader_timeout_s=60.0)
        r, = asyncio.run(run_rollouts([RolloutRequest(rollout_id="cc-0", task=task, group_id="g")], hc,
                                      workspace_root=str(tmp_path / "ws"), harness=harness, keys=st.proxy))
    finally:
        st.stop()
    assert (r.status, r.score, r.exit_code) == ("completed", 1.0, 0), (r.error, r.output_tail[-3000:])
    assert "the tool said gyre-tool-ok" in r.output_tail
    calls = store.calls("cc-0")
    assert [c.call_index for c in calls] == [0, 1] and calls[0].output_ids.tolist() == tool
    assert calls[1].output_ids.tolist() == FINAL
    first, second = calls[0].sequence.tolist(), calls[1].prompt_ids.tolist()
    assert second[:len(first)] == first  # one prefix-sharing path
    store.close()
