"""The proxy driven by the official ``openai`` and ``anthropic`` SDKs (clients no one here wrote).

A live server on loopback over a scripted fake model (``agent_script``: a pure function of the
conversation, so every expected token is known here), a real TrajectoryStore. Covers multi-turn
tool use with 100% prefix sharing in both APIs (the ids the model wrote, and ones it did not),
tool_choice, streaming, text stop sequences, n=2, models.retrieve, malformed rollout keys and
JSON errors on every route.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer, is_invented_call_id
from gyre_jax.testing.fake_backend import FakeBackend, default_script
from gyre_jax.trajectory.store import TrajectoryStore

TOK = ByteTokenizer()
IM_END = TOK.special["<|im_end|>"]
OPEN = TOK.special["<|tool_call|>"]
GEN_PROMPT = [TOK.special["<|im_start|>"]] + TOK.encode("assistant\n")
TOOLS_OA = [{"type": "function", "function": {"name": n, "description": "d", "parameters": {"type": "object"}}}
            for n in ("grep", "ls")]
TOOLS_AN = [{"name": n, "description": "d", "input_schema": {"type": "object"}} for n in ("grep", "ls")]


def call_answer(k: int, name: str = "grep") -> list[int]:
    """The model's k-th tool call: the first one writes its own id, the others none."""
    tc = {"name": name, "arguments": {"pattern": f"p{k}"}}
    if k == 0:
        tc["id"] = "call_x1"
    return TOK.render_tool_call(tc)


def agent_target(seq: list[int], done: list[int]) -> list[int]:
    text = TOK.decode(seq)
    if "STOPTEST" in text:
        return TOK.encode("alpha beta END gamma") + [IM_END]
    if "tool please" not in text:
        return TOK.encode("plain answer") + [IM_END]
    if done[:1] == [OPEN]:  # tool_choice forced the opening (and maybe the name): continue that call
        m = re.match(r'\{"name":"([a-z]+)"', TOK.decode(done))
        return call_answer(1, m.group(1) if m else "grep") + [IM_END]
    k = seq.count(TOK.special["<|tool_result|>"])
    return (TOK.encode("ok ") + call_answer(k) + [IM_END]) if k < 2 else TOK.encode("all done") + [IM_END]


def agent_script(seq):
    seq = [int(t) for t in seq]
    start = max(i for i in range(len(seq) - len(GEN_PROMPT) + 1) if seq[i:i + len(GEN_PROMPT)] == GEN_PROMPT)
    done = seq[start + len(GEN_PROMPT):]
    target = agent_target(seq, done)
    if target[:len(done)] == done and len(done) < len(target):
        return target[len(done)]
    return default_script(seq)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = TrajectoryStore(str(tmp_path_factory.mktemp("store")), run_id="run1")

    async def build():
        cells = [FakeBackend(n, script=agent_script, max_context=2048) for n in ("A", "B")]
        return Proxy(Router(cells), TOK, store, ProxyConfig(max_tokens_cap=256))

    st = ServerThread(build)
    st.start()
    yield st, store
    st.stop()
    store.close()


def oa(st, rollout):
    return openai.OpenAI(base_url=st.url + "/v1", api_key=f"gyre:run1:{rollout}", max_retries=0)


def an(st, rollout):
    return anthropic.Anthropic(base_url=st.url, api_key=f"gyre:run1:{rollout}", max_retries=0)


def raw(method, url, body=None):
    """(status, JSON body) of a plain HTTP request."""
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_one_path(store, rollout, n_calls):
    """Every call's prompt extends the previous call's prompt + output: 100% of those tokens shared."""
    calls = store.calls(rollout)
    assert [c.call_index for c in calls] == list(range(n_calls))
    for a, b in zip(calls, calls[1:]):
        prev = a.prompt_ids.tolist() + a.output_ids.tolist()
        assert b.prompt_ids.tolist()[:len(prev)] == prev, f"call {b.call_index} does not extend call {a.call_index}"
    return calls


def test_openai_multi_turn_tool_use_is_one_path(served):
    st, store = served
    c = oa(st, "oa-tools")
    msgs = [{"role": "user", "content": "tool please"}]
    ids = []
    for turn in range(3):
        r = c.chat.completions.create(model="gyre", messages=msgs, tools=TOOLS_OA, max_tokens=120)
        m = r.choices[0].message
        if turn == 2:
            assert m.content == "all done" and not m.tool_calls and r.choices[0].finish_reason == "stop"
            break
        assert r.choices[0].finish_reason == "tool_calls" and m.content == "ok "
        (tc,) = m.tool_calls
        assert tc.function.name == "grep" and json.loads(tc.function.arguments) == {"pattern": f"p{turn}"}
        ids.append(tc.id)
        msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": f"hit {turn}"}]
    assert ids[0] == "call_x1"  # the model's own id, unchanged
    assert is_invented_call_id(ids[1]) and ids[1].startswith("call_")  # invented: not rendered back
    assert_one_path(store, "oa-tools", 3)


def test_anthropic_multi_turn_tool_use_is_one_path(served):
    st, store = served
    c = an(st, "an-tools")
    msgs = [{"role": "user", "content": "tool please"}]
    ids = []
    for turn in range(3):
        r = c.messages.create(model="gyre", messages=msgs, tools=TOOLS_AN, max_tokens=120)
        if turn == 2:
            assert [b.type for b in r.content] == ["text"] and r.content[0].text == "all done"
            break
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
        use = r.content[1]
        assert use.name == "grep" and use.input == {"pattern": f"p{turn}"}
        ids.append(use.id)
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hit"}]}]
    assert ids[0] == "call_x1"  # no toolu_ rewrite: the client echoes what the model wrote
    assert is_invented_call_id(ids[1]) and ids[1].startswith("toolu_")
    assert_one_path(store, "an-tools", 3)


def test_streaming_equals_whole_in_both_sdks(served):
    st, _ = served
    c = oa(st, "oa-stream")
    msgs = [{"role": "user", "content": "tool please"}]
    chunks = list(c.chat.completions.create(model="gyre", messages=msgs, tools=TOOLS_OA, max_tokens=120, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert text == "ok " and len(calls) == 1 and calls[0].id == "call_x1"
    assert json.loads(calls[0].function.arguments) == {"pattern": "p0"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with an(st, "an-stream").messages.stream(model="gyre", messages=msgs, tools=TOOLS_AN, max_tokens=120) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].id == "call_x1"
    assert final.content[1].input == {"pattern": "p0"}


@pytest.mark.parametrize("choice,name", [("required", "grep"), ({"type": "function", "function": {"name": "ls"}}, "ls")])
def test_openai_tool_choice_forces_a_call(served, choice, name):
    st, store = served
    rollout = f"oa-choice-{name}"
    r = oa(st, rollout).chat.completions.create(model="gyre", messages=[{"role": "user", "content": "tool please"}],
                                                tools=TOOLS_OA, tool_choice=choice, max_tokens=120)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == name and json.loads(tc.function.arguments) == {"pattern": "p1"}
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "tool_calls"
    (rec,) = store.calls(rollout)
    full = TOK.render_tool_call({"name": name, "arguments": {"pattern": "p1"}}) + [IM_END]
    forced = rec.prompt_ids.tolist()[-(len(full) - len(rec.output_ids)):]
    # the forced opening is prompt (the model did not choose it); forced + generated is the whole call
    assert forced + rec.output_ids.tolist() == full and forced[0] == OPEN
    assert TOK.decode(forced).startswith('{"name":"' + name + '"') or choice == "required"


def test_tool_choice_none_and_anthropic_choices(served):
    st, store = served
    msgs = [{"role": "user", "content": "tool please"}]
    r = oa(st, "oa-none").chat.completions.create(model="gyre", messages=msgs, tools=TOOLS_OA, tool_choice="none",
                                                  max_tokens=120)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "ok "
    (rec,) = store.calls("oa-none")
    assert rec.output_ids.tolist() == TOK.encode("ok ") + [OPEN]  # generation stopped at the call's opening
    c = an(st, "an-choice")
    r = c.messages.create(model="gyre", messages=msgs, tools=TOOLS_AN, max_tokens=120,
                          tool_choice={"type": "tool", "name": "ls"})
    assert [b.type for b in r.content] == ["tool_use"] and r.content[0].name == "ls"
    raw = c.messages.with_raw_response.create(model="gyre", messages=msgs, tools=TOOLS_AN, max_tokens=120,
                                              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert raw.parse().content[0].name == "grep"
    assert "tool_choice.disable_parallel_tool_use" in raw.headers["X-Gyre-Ignored-Fields"]
    r = c.messages.create(model="gyre", messages=msgs, tools=TOOLS_AN, max_tokens=120, tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "ok "
    raw = oa(st, "oa-ignored").chat.completions.with_raw_response.create(
        model="gyre", messages=msgs, tools=TOOLS_OA, max_tokens=120, parallel_tool_calls=False, user="u",
        extra_body={"response_format": {"type": "text"}})
    assert raw.headers["X-Gyre-Ignored-Fields"] == "parallel_tool_calls,response_format,user"
    with pytest.raises(openai.BadRequestError, match="'nope' is not among"):
        oa(st, "oa-bad").chat.completions.create(model="gyre", messages=msgs, tools=TOOLS_OA, max_tokens=9,
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})


def test_stop_sequences_cut_text_and_record_tokens_as_generated(served):
    st, store = served
    msgs = [{"role": "user", "content": "STOPTEST"}]
    r = oa(st, "oa-stop").chat.completions.create(model="gyre", messages=msgs, stop=["END", "zzz"], max_tokens=60)
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    chunks = list(oa(st, "oa-stop").chat.completions.create(model="gyre", messages=msgs, stop="ND g", max_tokens=60,
                                                             stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "alpha beta E"
    m = an(st, "an-stop").messages.create(model="gyre", messages=msgs, stop_sequences=["beta"], max_tokens=60)
    assert m.content[0].text == "alpha " and m.stop_reason == "stop_sequence" and m.stop_sequence == "beta"
    # tokens up to the one that completed the stop string, exactly as generated
    assert [c.output_ids.tolist() for c in store.calls("oa-stop")] == [TOK.encode("alpha beta END"),
                                                                       TOK.encode("alpha beta END g")]
    assert [c.finish_reason for c in store.calls("oa-stop")] == ["stop", "stop"]
    assert store.calls("an-stop")[0].output_ids.tolist() == TOK.encode("alpha beta")


def test_n_samples_are_calls_of_one_rollout(served):
    st, store = served
    r = oa(st, "oa-n").chat.completions.create(model="gyre", messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=30)
    assert [ch.index for ch in r.choices] == [0, 1] and {ch.message.content for ch in r.choices} == {"plain answer"}
    recs = store.calls("oa-n")
    assert [c.call_index for c in recs] == [0, 1]
    assert recs[0].prompt_ids.tolist() == recs[1].prompt_ids.tolist()
    chunks = list(oa(st, "oa-n").chat.completions.create(model="gyre", messages=[{"role": "user", "content": "hi"}],
                                                          n=3, max_tokens=30, stream=True))
    texts = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in range(3)}
    assert texts == {i: "plain answer" for i in range(3)}
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1, 2]
    assert [c.call_index for c in store.calls("oa-n")] == [0, 1, 2, 3, 4]


def test_models_retrieve_bad_keys_and_json_errors_everywhere(served):
    st, _ = served
    assert oa(st, "m").models.retrieve("gyre").id == "gyre"
    assert an(st, "m").models.retrieve("gyre").id == "gyre"
    with pytest.raises(openai.NotFoundError, match="'gpt-9' not found"):
        oa(st, "m").models.retrieve("gpt-9")
    msgs = [{"role": "user", "content": "hi"}]
    bad_key = "gyre:run1:my rollout x"
    with pytest.raises(openai.BadRequestError, match=re.escape(repr(bad_key))):
        openai.OpenAI(base_url=st.url + "/v1", api_key=bad_key, max_retries=0).chat.completions.create(
            model="gyre", messages=msgs, max_tokens=3)
    with pytest.raises(anthropic.BadRequestError, match="rollout id 'x:y'|3 parts"):
        anthropic.Anthropic(base_url=st.url, api_key="gyre:run1:x:y", max_retries=0).messages.create(
            model="gyre", messages=msgs, max_tokens=3)
    # unknown paths and wrong methods: the API's own JSON error shape, not plain text
    status, body = raw("GET", st.url + "/v1/nope")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = raw("GET", st.url + "/v1/chat/completions")
    assert status == 405 and "POST" in body["error"]["message"]
    status, body = raw("GET", st.url + "/v1/messages")
    assert status == 405 and body["type"] == "error"
    status, body = raw("POST", st.url + "/v1/messages/nope", {})
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"


def test_a_silent_prefill_gets_keepalives_that_both_sdks_ignore(tmp_path):
    """A long prompt's prefill sends no token for minutes: the stream hears a keep-alive every
    stream_keepalive_s (Anthropic `ping` events, OpenAI SSE comments), and the SDKs read the
    reply as if there had been none."""
    import asyncio

    store = TrajectoryStore(str(tmp_path / "store"), run_id="ka")
    proxy_box = []

    async def slow_first_token(req, k):  # "prefill": no first token until the client heard 2 pings
        if k == 0:
            before = proxy_box[0].counters["stream_keepalives"]
            while proxy_box[0].counters["stream_keepalives"] < before + 2:
                await asyncio.sleep(0.01)

    async def build():
        p = Proxy(Router([FakeBackend("A", script=agent_script, max_context=2048, before_token=slow_first_token)]),
                  TOK, store, ProxyConfig(max_tokens_cap=64, stream_keepalive_s=0.05))
        proxy_box.append(p)
        return p

    st = ServerThread(build)
    st.start()
    try:
        raw = urllib.request.Request(st.url + "/v1/chat/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "gyre", "stream": True, "max_tokens": 16,
                                                      "messages": [{"role": "user", "content": "hi"}]}).encode())
        body = urllib.request.urlopen(raw, timeout=30).read().decode()
        assert body.count(": keep-alive\n\n") >= 2 and body.rstrip().endswith("data: [DONE]")
        oa = openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0)
        text = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model="gyre", stream=True, max_tokens=16, messages=[{"role": "user", "content": "hi"}]) if c.choices)
        an = anthropic.Anthropic(base_url=st.url, api_key="x", max_retries=0)
        with an.messages.stream(model="gyre", max_tokens=16, messages=[{"role": "user", "content": "hi"}]) as s:
            kinds = [ev.type for ev in s]
            an_text = s.get_final_message().content[0].text
        assert text == an_text == "plain answer"
        assert "ping" not in kinds or kinds.count("ping") >= 2  # the SDK passes pings through as events
        assert proxy_box[0].counters["stream_keepalives"] >= 6
    finally:
        st.stop()
        store.close()
