"""The real Claude Code CLI, unchanged, pointed at the proxy (offline).

Needs the CLI: ``npm install @anthropic-ai/claude-code`` (then ``node install.cjs``
in the package folder) and ``GYRE_CLAUDE_BIN=/path/to/bin/claude.exe`` (or
``claude`` on PATH); skipped otherwise. The model behind the proxy is a scripted
fake (the CLI's first prompt is ~76k byte tokens, beyond the tiny CPU model), so
this checks the API surface: request parsing (system turns, 24 tools,
tool_result), streamed events, the tool round trip, and one record per call.
"""
from __future__ import annotations

import os
import shutil
import subprocess

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
