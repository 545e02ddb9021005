"""The recording proxy speaking a HF checkpoint's chat template: OpenAI and Anthropic requests
rendered with the Qwen3 / Llama-3 template, the model's family-syntax tool calls returned as
OpenAI ``tool_calls`` / Anthropic ``tool_use`` blocks, streamed and not. The "model" is a
FakeBackend that writes a scripted answer after whatever prompt it gets (no JAX engine).
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gyre_jax.serving import identity as P
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import load_tokenizer
from gyre_jax.testing.fake_backend import FakeBackend
from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer
from gyre_jax.trajectory.store import TrajectoryStore

ANSWERS = {
    "qwen3": 'Let me look.\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "x", "n": 2}}\n</tool_call>',
    "llama3": '{"name": "grep", "parameters": {"pattern": "x", "n": 2}}',
}
CONTENT = {"qwen3": "Let me look.", "llama3": ""}
TOOLS_OAI = [{"type": "function", "function": {"name": "grep", "description": "Search.",
                                               "parameters": {"type": "object"}}}]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find x."}]


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def served(request, tmp_path_factory):
    family = request.param
    d = str(tmp_path_factory.mktemp(family))
    write_tiny_hf_tokenizer(d, family)
    tok = load_tokenizer(f"hf:{d}")
    answer = tok.encode_with_special(ANSWERS[family]) + [tok.stop_ids[0]]

    def script_for(req):
        n = len(req.prompt_ids)
        return lambda seq: answer[min(len(seq) - n, len(answer) - 1)]

    store = TrajectoryStore(str(tmp_path_factory.mktemp("store")), run_id="run1")

    async def build():
        return Proxy(Router([FakeBackend("A", vocab_size=tok.vocab_size, script_for=script_for, max_context=2048)]), tok, store,
                     ProxyConfig())

    st = ServerThread(build)
    st.start()
    yield family, tok, st, store
    st.stop()
    store.close()


async def _post(url, body, hdrs):
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=json.dumps(body), headers={"Content-Type": "application/json", **hdrs}) as r:
            return r.status, await r.text()


def _call(st, path, body, rollout, k=0):
    h = P.call_headers(run_id="run1", rollout_id=rollout, task_id="t", group_id="g", agent_id=0,
                       parent_agent_id=None, role="main", call_index=k, attempt=0)
    return asyncio.run(_post(st.url + path, body, h))


def _sse(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_openai_tool_calls_from_the_family_syntax(served):
    family, tok, st, store = served
    body = {"model": "gyre", "messages": MSGS, "tools": TOOLS_OAI, "max_tokens": 200}
    status, text = _call(st, "/v1/chat/completions", body, f"oai-{family}")
    assert status == 200, text
    msg = json.loads(text)["choices"][0]["message"]
    assert (msg["content"] or "") == CONTENT[family]
    (tc,) = msg["tool_calls"]
    assert tc["function"]["name"] == "grep" and json.loads(tc["function"]["arguments"]) == {"pattern": "x", "n": 2}
    assert json.loads(text)["choices"][0]["finish_reason"] == "tool_calls"
    (rec,) = store.calls(f"oai-{family}")  # the prompt the model saw is the template's rendering
    assert rec.prompt_ids.tolist() == tok.render_chat(MSGS, [{"name": "grep", "description": "Search.",
                                                              "parameters": {"type": "object"}}])
    # streamed: the same content and call
    status, text = _call(st, "/v1/chat/completions", {**body, "stream": True}, f"oai-s-{family}")
    assert status == 200, text
    chunks = _sse(text)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    calls = [t for c in chunks if c.get("choices") for t in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert content == CONTENT[family]
    assert calls and calls[0]["function"]["name"] == "grep"
    assert json.loads("".join(t["function"].get("arguments") or "" for t in calls)) == {"pattern": "x", "n": 2}


def test_anthropic_tool_use_from_the_family_syntax(served):
    family, tok, st, _ = served
    body = {"model": "gyre", "system": "Be brief.", "messages": [{"role": "user", "content": "Find x."}],
            "tools": [{"name": "grep", "description": "Search.", "input_schema": {"type": "object"}}],
            "max_tokens": 200}
    status, text = _call(st, "/v1/messages", body, f"ant-{family}")
    assert status == 200, text
    out = json.loads(text)
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    texts = "".join(b["text"] for b in out["content"] if b["type"] == "text")
    assert texts == CONTENT[family] and len(uses) == 1
    assert uses[0]["name"] == "grep" and uses[0]["input"] == {"pattern": "x", "n": 2}
    assert out["stop_reason"] == "tool_use"
