"""Proxy API surfaces, bad input and security, on fake backends (no JAX engine).

A live aiohttp server on loopback, a real aiohttp client, a real TrajectoryStore.
The fake "model" is a pure function of the tokens, so every expected output and
record is computed independently here.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from gyre_jax.serving import identity as P
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.fake_backend import FakeBackend, default_script
from gyre_jax.trajectory.store import TrajectoryStore

TOK = ByteTokenizer()
TOOL_ANSWER = (TOK.encode("ok ") + TOK.render_tool_call({"name": "grep", "arguments": {"pattern": "x"}, "id": "c1"})
               + [TOK.special["<|im_end|>"]])
GEN_PROMPT = [TOK.special["<|im_start|>"]] + TOK.encode("assistant\n")


def script(seq):
    """Answers with a tool call when asked to, else the default hash model."""
    seq = [int(t) for t in seq]
    if bytes(t for t in seq if t < 256).find(b"please call a tool") >= 0:
        for i in range(len(seq) - len(GEN_PROMPT), -1, -1):
            if seq[i:i + len(GEN_PROMPT)] == GEN_PROMPT:
                return TOOL_ANSWER[len(seq) - i - len(GEN_PROMPT)]
    return default_script(seq)


def expected_default(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(default_script(seq))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = TrajectoryStore(str(tmp_path_factory.mktemp("store")), run_id="run1")

    async def build():
        never = asyncio.Event()

        async def hold(r, n):  # the prompt [3, 4, 5] stalls after 2 tokens (a client will hang up)
            if r.prompt_ids.tolist() == [3, 4, 5] and n == 2:
                await never.wait()

        fail = lambda r: int(r.prompt_ids[-1]) == 7 and len(r.prompt_ids) == 3  # noqa: E731
        cells = [FakeBackend(name, script=script, max_context=400, fail_when=fail, before_token=hold)
                 for name in ("A", "B")]
        return Proxy(Router(cells), TOK, store, ProxyConfig(max_tokens_cap=64, max_request_bytes=64 << 10,
                                                            model_aliases=("claude-*",)))

    st = ServerThread(build)
    st.start()
    yield st, store
    st.stop()
    store.close()


def headers(rollout, call, **kw):
    h = P.call_headers(run_id="run1", rollout_id=rollout, task_id="t", group_id="g", agent_id=0,
                       parent_agent_id=None, role="main", call_index=call, attempt=0)
    h.update(kw)
    return h


async def _post(url, body, hdrs=None, raw=None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body)
        async with s.post(url, data=data, headers={"Content-Type": "application/json", **(hdrs or {})}) as r:
            return r.status, await r.text(), dict(r.headers)


def post(url, body, hdrs=None, raw=None):
    return asyncio.run(_post(url, body, hdrs, raw))


def sse(text):
    out = []
    for block in text.strip().split("\n\n"):
        ev, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                ev = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((ev, data if data == "[DONE]" else json.loads(data)))
    return out


def test_chat_completion_record_and_response(server):
    st, store = server
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello <|im_end|> there"}]
    status, text, _ = post(st.url + "/v1/chat/completions",
                           {"model": "gyre", "messages": msgs, "max_tokens": 12, "logprobs": True}, headers("r-chat", 0))
    assert status == 200, text
    body = json.loads(text)
    prompt = TOK.render_chat(msgs)
    out = expected_default(prompt, 12)
    assert body["choices"][0]["message"]["content"] == TOK.decode(out)
    assert body["choices"][0]["finish_reason"] == "length"
    assert [c["token_id"] for c in body["choices"][0]["logprobs"]["content"]] == out
    # the literal "<|im_end|>" in user text stays bytes, not a special token
    assert prompt.count(TOK.special["<|im_end|>"]) == 2
    (rec,) = store.calls("r-chat")
    assert rec.prompt_ids.tolist() == prompt and rec.output_ids.tolist() == out
    np.testing.assert_allclose(rec.output_logprobs, [-0.25 * (1 + t % 4) for t in out])
    assert (rec.task_id, rec.group_id, rec.role, rec.call_index, rec.finish_reason) == ("t", "g", "main", 0, "length")


def test_chat_tool_call_streaming_equals_whole(server):
    st, store = server
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    req = {"model": "gyre", "messages": [{"role": "user", "content": "please call a tool"}], "tools": tools,
           "max_tokens": 60}
    status, text, _ = post(st.url + "/v1/chat/completions", req, headers("r-tool", 0))
    assert status == 200, text
    msg = json.loads(text)["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"]["content"] == "ok "
    tc = msg["message"]["tool_calls"][0]
    assert (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) == ("c1", "grep", {"pattern": "x"})
    status, text, hdr = post(st.url + "/v1/chat/completions", {**req, "stream": True, "stream_options": {"include_usage": True}},
                             headers("r-tool", 1))
    assert status == 200 and hdr["Content-Type"].startswith("text/event-stream")
    events = sse(text)
    assert events[-1][1] == "[DONE]"
    chunks = [e[1] for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert content == "ok " and len(calls) == 1 and calls[0]["function"]["name"] == "grep"
    assert finishes == ["tool_calls"] and chunks[-1]["usage"]["completion_tokens"] == len(TOOL_ANSWER)
    recs = store.calls("r-tool")
    assert [r.call_index for r in recs] == [0, 1]
    for r in recs:
        assert r.output_ids.tolist() == TOOL_ANSWER and r.finish_reason == "tool_calls"
    # the next turn renders the assistant turn back to exactly the generated ids
    turn2 = TOK.render_chat([{"role": "user", "content": "please call a tool"},
                             {"role": "assistant", "content": "ok ", "tool_calls": [
                                 {"id": "c1", "name": "grep", "arguments": {"pattern": "x"}}]}], [
        {"name": "grep", "description": "", "parameters": {"type": "object"}}], add_generation_prompt=False)
    assert turn2[:len(recs[0].sequence)] == recs[0].sequence.tolist()


def test_completions_token_ids_stream_and_whole(server):
    st, store = server
    prompt = [5, 6, 300 - 40, 9, 10]
    status, text, _ = post(st.url + "/v1/completions", {"model": "gyre", "prompt": prompt, "max_tokens": 7,
                                                        "return_token_ids": True}, headers("r-comp", 0))
    assert status == 200, text
    out = expected_default(prompt, 7)
    ch = json.loads(text)["choices"][0]
    assert ch["token_ids"] == out and ch["text"] == TOK.decode(out) and ch["finish_reason"] == "length"
    status, text, _ = post(st.url + "/v1/completions", {"model": "gyre", "prompt": prompt, "max_tokens": 7,
                                                        "stream": True, "return_token_ids": True}, headers("r-comp", 1))
    ev = [e[1] for e in sse(text)]
    assert ev[-1] == "[DONE]"
    assert [t for c in ev[:-1] for t in c["choices"][0].get("token_ids", [])] == out
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == TOK.decode(out)
    assert [r.output_ids.tolist() for r in store.calls("r-comp")] == [out, out]


def test_anthropic_messages_stream_events_and_record(server):
    st, store = server
    req = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True, "system": [{"type": "text", "text": "sys"}],
           "tools": [{"name": "grep", "input_schema": {"type": "object"}}],
           "messages": [{"role": "user", "content": [{"type": "text", "text": "please call a tool"}]}],
           "metadata": {"user_id": "u"}}
    key = P.api_key("run1", "r-anth")
    status, text, hdr = post(st.url + "/v1/messages?beta=true", req,
                             {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": "s"})
    assert status == 200, text
    names = [e[0] for e in sse(text)]
    names = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]  # one delta per byte of text
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    ev = [e[1] for e in sse(text)]
    text_deltas = [e["delta"]["text"] for e in ev if e["type"] == "content_block_delta" and e["index"] == 0]
    tool = [e for e in ev if e["type"].startswith("content_block") and e["index"] == 1]
    assert "".join(text_deltas) == "ok "
    assert tool[0]["content_block"]["name"] == "grep" and json.loads(tool[1]["delta"]["partial_json"]) == {"pattern": "x"}
    assert ev[-2]["delta"]["stop_reason"] == "tool_use" and ev[-2]["usage"]["output_tokens"] == len(TOOL_ANSWER)
    assert "metadata" in hdr["X-Gyre-Ignored-Fields"]
    (rec,) = store.calls("r-anth")
    assert rec.output_ids.tolist() == TOOL_ANSWER and rec.finish_reason == "tool_calls" and rec.task_id == "unknown"
    # tool_result round trip (non-streamed)
    req2 = {**req, "stream": False, "messages": req["messages"] + [
        {"role": "assistant", "content": [{"type": "text", "text": "ok "},
                                          {"type": "tool_use", "id": "toolu_c1", "name": "grep", "input": {"pattern": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "content": "found"}]}]}
    status, text, _ = post(st.url + "/v1/messages", req2, {"x-api-key": key})
    body = json.loads(text)
    assert status == 200 and body["type"] == "message" and body["stop_reason"] == "tool_use"
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"] and body["content"][1]["input"] == {"pattern": "x"}
    recs = store.calls("r-anth")
    assert [r.call_index for r in recs] == [0, 1]
    tail = TOK.render_chat([{"role": "tool", "tool_call_id": "toolu_c1", "content": "found"}],
                           add_generation_prompt=True)[1:]  # without <|bos|>
    assert recs[1].prompt_ids.tolist()[-len(tail):] == tail


@pytest.mark.parametrize("path,body,raw,status,needle", [
    ("/v1/chat/completions", None, b'{"model": "gyre", "messages": [', 400, "malformed JSON at line 1"),
    ("/v1/chat/completions", [1, 2], None, 400, "must be a JSON object"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, None, 404, "'nope' not found"),
    ("/v1/chat/completions", {"model": "gyre", "messages": [{"role": "user", "content": "x" * 500}]}, None, 400,
     "context limit is 400 tokens"),
    ("/v1/chat/completions", {"model": "gyre", "messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, None,
     400, "cap of 64"),
    ("/v1/chat/completions", {"model": "gyre", "messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "gyre", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     None, 400, "temperature"),
    ("/v1/completions", {"model": "gyre", "prompt": [1, 99999]}, None, 400, "prompt[1]: token id 99999"),
    ("/v1/messages", {"model": "gyre", "messages": [{"role": "user", "content": "x"}]}, None, 400, "max_tokens: required"),
    ("/v1/messages", {"model": "gyre", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     None, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", None, b"x" * (70 << 10), 413, "byte limit"),
    ("/v1/completions", {"model": "gyre", "prompt": [1, 2], "echo": True}, None, 400, "echo: not supported"),
    ("/v1/chat/completions", {"model": "gyre", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": 7, "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": 7, "content": "y"}]}, None, 400, "id"),
    ("/v1/messages/count_tokens", None, b'{"model": "gyre", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "surrogate"),
    ("/v1/completions", {"model": "gyre", "prompt": [1, 2], "best_of": 2}, None, 400, "best_of: not supported"),
    ("/v1/chat/completions", None, b'{"model": "gyre", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "too deeply"),
])
def test_bad_input_is_named(server, path, body, raw, status, needle):
    st, _ = server
    got, text, _ = post(st.url + path, body, raw=raw)
    assert got == status, text
    assert needle in text


def test_bad_binding_header(server):
    st, _ = server
    got, text, _ = post(st.url + "/v1/chat/completions", {"model": "gyre", "messages": [{"role": "user", "content": "x"}]},
                        {P.HEADER_AGENT: "abc"})
    assert got == 400 and "X-Gyre-Agent" in text


def test_engine_error_fails_one_call_only(server):
    st, store = server

    async def go():
        bad = _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [1, 2, 7], "max_tokens": 3}, headers("r-err", 0))
        good = _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [1, 2, 8], "max_tokens": 3}, headers("r-ok", 0))
        bad_s = _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [1, 2, 7], "max_tokens": 3, "stream": True},
                      headers("r-err", 1))
        return await asyncio.gather(bad, good, bad_s)

    (s1, t1, _), (s2, _, _), (s3, t3, _) = asyncio.run(go())
    assert s1 == 500 and "injected failure" in t1
    assert s2 == 200
    assert s3 == 200 and "injected failure" in sse(t3)[-1][1]["error"]["message"]
    with pytest.raises(KeyError):
        store.calls("r-err")
    assert len(store.calls("r-ok")) == 1
    status, text, _ = asyncio.run(_get(st.url + "/health"))
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_failed_samples_of_n_record_nothing_and_free_their_slots(server):
    st, store = server
    for stream in (False, True):
        status, text, _ = post(st.url + "/v1/completions", {"model": "gyre", "prompt": [1, 2, 7], "max_tokens": 3,
                                                             "n": 2, "stream": stream}, {"x-api-key": "gyre:run1:r-n-err"})
        assert "injected failure" in text and status == (200 if stream else 500)
    with pytest.raises(KeyError):
        store.calls("r-n-err")
    st.run(_drained(st))
    assert sum(b.num_active() for b in st.proxy.router.cells.values()) == 0


async def _get(url, hdrs=None):
    async with aiohttp.ClientSession() as s:
        async with s.get(url, headers=hdrs or {}) as r:
            return r.status, await r.text(), dict(r.headers)


def test_models_health_metrics_and_loopback(server):
    st, _ = server
    assert st.proxy.cfg.host == "127.0.0.1" and st.url.startswith("http://127.0.0.1:")
    status, text, _ = asyncio.run(_get(st.url + "/v1/models"))
    assert status == 200 and json.loads(text)["data"][0]["id"] == "gyre"
    status, text, _ = asyncio.run(_get(st.url + "/metrics"))
    assert status == 200 and "gyre_records_written " in text and 'gyre_cell_prefill_tokens{cell="A"}' in text


def test_client_disconnect_mid_stream_is_not_recorded(server):
    st, store = server
    gone0 = st.proxy.counters["calls_unrecorded_client_gone"]

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(st.url + "/v1/completions", json={"model": "gyre", "prompt": [3, 4, 5], "max_tokens": 60,
                                                                 "stream": True}, headers=headers("r-gone", 0)) as r:
                await r.content.readline()  # first chunk, then hang up while the call is stalled
        # a later call on the same server works
        return await _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [3, 4], "max_tokens": 2},
                           headers("r-after", 0))

    assert asyncio.run(go())[0] == 200
    st.run(_drained(st))
    with pytest.raises(KeyError):
        store.calls("r-gone")
    assert sum(b.num_active() for b in st.proxy.router.cells.values()) == 0
    assert st.proxy.counters["calls_unrecorded_client_gone"] - gone0 == 1  # counted once


async def _drained(st):
    for _ in range(1000):  # the server notices the hang-up at its next write
        if st.proxy._inflight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("call still in flight after the client left")


def test_auth_token_and_rollout_keys(tmp_path):
    store = TrajectoryStore(str(tmp_path / "s"), run_id="runA")

    async def build():
        return Proxy(Router([FakeBackend("A")]), TOK, store, ProxyConfig(auth_token="s3cret-token"))

    st = ServerThread(build)
    st.start()
    try:
        body = {"model": "gyre", "prompt": [1, 2], "max_tokens": 2}
        assert post(st.url + "/v1/completions", body)[0] == 401
        assert post(st.url + "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        # the guessable gyre:run:rollout form is not a credential when auth is on
        assert post(st.url + "/v1/completions", body, {"Authorization": "Bearer " + P.api_key("runA", "x")})[0] == 401
        assert asyncio.run(_get(st.url + "/v1/models"))[0] == 401
        ok = post(st.url + "/v1/completions", body, {"Authorization": "Bearer s3cret-token", **headers("r1", 0),
                                                     P.HEADER_RUN: "runA"})
        assert ok[0] == 200, ok[1]
        key = st.proxy.register_rollout("runA", "r2", "taskX", "groupY")
        assert post(st.url + "/v1/completions", body, {"x-api-key": key})[0] == 200
        (rec,) = store.calls("r2")
        assert (rec.run_id, rec.task_id, rec.group_id, rec.call_index) == ("runA", "taskX", "groupY", 0)
        # a call for another run than the store's is refused before any token is generated
        bad = post(st.url + "/v1/completions", body, {"Authorization": "Bearer s3cret-token", **headers("r3", 0)})
        assert bad[0] == 400 and "this server records run 'runA'" in bad[1]
        # a first attempt of a call number already recorded is refused before generation (was: generated,
        # then the store refused the record: a 500)
        h = {"Authorization": "Bearer s3cret-token", **headers("r1", 0), P.HEADER_RUN: "runA"}
        dup = post(st.url + "/v1/completions", {**body, "prompt": [9, 9]}, h)
        assert dup[0] == 409 and "call 0 of rollout 'r1' is already recorded" in dup[1]
    finally:
        st.stop()
        store.close()


def test_fuzzed_requests_never_crash_the_server(server):
    """Valid bodies with one field replaced by a random JSON value (or removed),
    and random binding headers: every answer is a named 4xx or a 200, never a 500."""
    st, _ = server
    rs = np.random.RandomState(0)
    values = [None, 0, -1, 1.5, 2**40, "", "x" * 300, [], [1, "a"], {}, {"a": [None]}, True, float("nan")]
    bodies = {
        "/v1/chat/completions": {"model": "gyre", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
                                 "tools": [{"type": "function", "function": {"name": "f"}}], "temperature": 0.5},
        "/v1/completions": {"model": "gyre", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True},
        "/v1/messages": {"model": "gyre", "max_tokens": 3, "system": "s",
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    }
    hdr_names = [P.HEADER_AGENT, P.HEADER_ROLE, P.HEADER_CALL, P.HEADER_PARENT_AGENT, P.HEADER_RUN]

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for i in range(120):
                path = list(bodies)[i % 3]
                body = json.loads(json.dumps(bodies[path]))
                key = rs.choice(sorted(body))
                if rs.rand() < 0.2:
                    del body[key]
                else:
                    body[key] = values[rs.randint(len(values))]
                if rs.rand() < 0.3 and isinstance(body.get("messages"), list) and body["messages"]:
                    body["messages"][0]["content"] = values[rs.randint(len(values))]
                h = headers(f"fuzz-{i}", i)
                if rs.rand() < 0.3:
                    h[rs.choice(hdr_names)] = str(values[rs.randint(len(values))])
                data = json.dumps(body, allow_nan=True)
                async with s.post(st.url + path, data=data, headers={"Content-Type": "application/json", **h}) as r:
                    out.append((path, key, r.status, await r.text()))
        return out

    for path, key, status, text in asyncio.run(go()):
        assert status in (200, 400, 404), (path, key, status, text[:300])
        if status != 200:
            assert "error" in json.loads(text)
    assert asyncio.run(_get(st.url + "/health"))[0] == 200


def test_call_numbers_continue_from_the_store_after_a_restart(tmp_path):
    """A rollout that goes on after the server restarted on the same store gets the next call number, not a
    second call 0 (which the store refuses after the model has generated: a 500 before)."""
    store = TrajectoryStore(str(tmp_path / "store"), run_id="run1")

    async def build():
        return Proxy(Router([FakeBackend("A", script=script, max_context=400)]), TOK, store,
                     ProxyConfig(max_tokens_cap=64))

    h = headers("r-restart", 0)
    del h[P.HEADER_CALL]  # no call number: the proxy numbers the rollout's calls itself
    body = {"model": "gyre", "prompt": [1, 2, 3], "max_tokens": 2}
    for _ in range(2):  # the same harness, before and after a restart of the server
        st = ServerThread(build)
        st.start()
        try:
            status, text, _ = post(st.url + "/v1/completions", body, h)
        finally:
            st.stop()
        assert status == 200, text
    assert [c.call_index for c in store.calls("r-restart")] == [0, 1]
    store.close()


def test_identity_conflicts_are_refused_before_generation(tmp_path):
    """Conflicts the store would refuse only after the model generated (a 500) are answered 409/400
    before any token: a first attempt of a call number already recorded (also after a restart of the
    server on the same store), a task or group that changes within a rollout, a call of a finished
    rollout, an agent that is its own parent. No prompt token reaches an engine for any of them."""
    from gyre_jax.trajectory.records import RolloutOutcome
    store = TrajectoryStore(str(tmp_path / "store"), run_id="run1")

    async def build():
        return Proxy(Router([FakeBackend("A", script=script, max_context=400)]), TOK, store,
                     ProxyConfig(max_tokens_cap=64))

    body = {"model": "gyre", "prompt": [1, 2, 3], "max_tokens": 2}
    url = "/v1/completions"
    for restart in range(2):
        st = ServerThread(build)
        st.start()
        try:
            if restart == 0:
                assert post(st.url + url, body, headers("rc", 0))[0] == 200
                store.append(RolloutOutcome(run_id="run1", rollout_id="done", task_id="t", group_id="g",
                                            status="completed", score=1.0, details={}, policy_versions=(),
                                            t_end=1.0, num_calls=0))
            tokens = st.proxy.counters["prompt_tokens"]
            cases = [
                (headers("rc", 0), 409, "call 0 of rollout 'rc' is already recorded"),
                (headers("rc", 1, **{P.HEADER_TASK: "other"}), 409, "belongs to task 't'"),
                (headers("rc", 1, **{P.HEADER_GROUP: "other"}), 409, "belongs to group 'g'"),
                (headers("done", 0), 409, "is finished"),
                (headers("rc", 1, **{P.HEADER_ROLE: "subagent", P.HEADER_AGENT: "2", P.HEADER_PARENT_AGENT: "2"}),
                 400, "not its own parent"),
            ]
            for h, status, needle in cases:
                got, text, _ = post(st.url + url, body, h)
                assert got == status and needle in text, (restart, needle, got, text)
            assert st.proxy.counters["prompt_tokens"] == tokens  # nothing was generated for them
            # a retry of a recorded call is still served (not recorded twice); the next number is new
            assert post(st.url + url, body, headers("rc", 0, **{P.HEADER_ATTEMPT: "1"}))[0] == 200
        finally:
            st.stop()
    assert [c.call_index for c in store.calls("rc")] == [0]
    store.close()


def test_a_rollouts_key_routes_its_calls_to_its_lora_adapter(tmp_path):
    """Multi-LoRA (rl/build.py sets Proxy.adapter_of from the group id): every call of a rollout samples with
    its group's adapter, whatever the client sends; without adapter_of, adapter 0."""
    store = TrajectoryStore(str(tmp_path / "s"), run_id="runA")
    seen: list[tuple[str, int]] = []

    class Recording(FakeBackend):
        def submit(self, request):
            seen.append((request.cache_key, request.sampling.adapter))
            return super().submit(request)

    async def build():
        p = Proxy(Router([Recording("A")]), TOK, store, ProxyConfig(auth_token="tok-12345678"))
        p.adapter_of = lambda b: int(b.group_id[1:]) % 3
        return p

    st = ServerThread(build)
    st.start()
    try:
        body = {"model": "gyre", "prompt": [1, 2], "max_tokens": 2}
        for group in ("g00004", "g00005", "g00004"):
            key = st.proxy.register_rollout("runA", f"{group}-r", "task", group)
            assert post(st.url + "/v1/completions", body, {"x-api-key": key})[0] == 200
        assert [a for _, a in seen] == [1, 2, 1] and seen[0][0].startswith("runA/g00004-r")
        st.proxy.adapter_of = None
        key = st.proxy.register_rollout("runA", "g00005-s", "task", "g00005")
        assert post(st.url + "/v1/completions", body, {"x-api-key": key})[0] == 200
        assert seen[-1][1] == 0
    finally:
        st.stop()
        store.close()
