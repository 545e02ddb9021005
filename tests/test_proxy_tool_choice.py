"""tool_choice and tool-call ids in each chat format (ours, Qwen3's, Llama-3's), without a server:
the forced opening is a prefix of the call the template renders, the forced + generated ids parse
back to that call, and the ids a client sees render back to the model's tokens."""
from __future__ import annotations

import numpy as np
import pytest

from gyre_jax.serving.api_common import CallIds, ChatCall, OutputText, forced_call_prefix, tool_choice_plan
from gyre_jax.serving.tokenizer import QUOTED_ID, ByteTokenizer, is_invented_call_id, load_tokenizer
from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

TOOLS = [{"name": "grep", "description": "", "parameters": {}}, {"name": "ls", "description": "", "parameters": {}}]
CALL = {"name": "ls", "arguments": {"path": "src", "n": 2}}


@pytest.fixture(scope="module", params=["byte", "qwen3", "llama3"])
def tok(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer()
    d = str(tmp_path_factory.mktemp(request.param))
    write_tiny_hf_tokenizer(d, request.param)
    return load_tokenizer(f"hf:{d}")


def _call(tok, forced=(), stops=(), parse_tools=True, stop_ids=()):
    return ChatCall(api="openai.chat", model="m", prompt_ids=np.zeros(1, np.int32), max_tokens=None, temperature=1.0,
                    top_p=1.0, seed=None, stop_ids=tuple(tok.stop_ids) + tuple(stop_ids), stream=False,
                    parse_tools=parse_tools, forced_ids=tuple(forced), stop_strings=tuple(stops))


def _events(tok, call, ids):
    out = OutputText(tok, call, CallIds(tok, "abc123", "call"))
    evs = [e for t in ids for e in out.feed(t)] + out.finish()
    return evs, out


def test_named_choice_forces_the_opening_and_name_then_parses_back(tok):
    full = tok.render_tool_call(CALL)
    forced, stop_extra, parse_tools = tool_choice_plan(tok, "named", "ls", TOOLS, "tool_choice")
    assert list(forced) == forced_call_prefix(tok, "ls") and stop_extra == () and parse_tools
    assert full[:len(forced)] == list(forced) and list(forced[:len(tok.tool_call_open_ids())]) == tok.tool_call_open_ids()
    assert '"ls"' in tok.decode(forced) and len(forced) < len(full)
    rest = full[len(forced):] + [tok.stop_ids[0]]
    evs, _ = _events(tok, _call(tok, forced), rest)
    (call,) = [v for k, v in evs if k == "tool_call"]
    assert (call["name"], call["arguments"]) == ("ls", CALL["arguments"]) and is_invented_call_id(call["id"])
    # the client's call (with its invented id) renders back to exactly the forced + generated tokens
    assert tok.render_tool_call(call) == full


def test_required_with_several_tools_forces_only_the_opening(tok):
    forced, _, _ = tool_choice_plan(tok, "required", None, TOOLS, "tool_choice")
    assert list(forced) == tok.tool_call_open_ids()
    with pytest.raises(Exception, match="no tools"):
        tool_choice_plan(tok, "required", None, [], "tool_choice")
    with pytest.raises(Exception, match="'nope' is not among"):
        tool_choice_plan(tok, "named", "nope", TOOLS, "tool_choice.function.name")


def test_none_choice_emits_no_call(tok):
    _, stop_extra, parse_tools = tool_choice_plan(tok, "none", None, TOOLS, "tool_choice")
    ids = tok.encode("hm ") + tok.render_tool_call(CALL) + [tok.stop_ids[0]]
    if stop_extra:  # a special opening token: generation stops there
        assert stop_extra == (tok.tool_call_open_ids()[0],)
        ids = ids[:ids.index(stop_extra[0]) + 1]
    evs, _ = _events(tok, _call(tok, parse_tools=parse_tools, stop_ids=stop_extra), ids)
    assert all(k == "text" for k, _ in evs)


def test_model_ids_pass_unchanged_and_invented_ones_are_unique_per_response():
    tok = ByteTokenizer()
    ids = tok.render_tool_call({**CALL, "id": "toolu_own"}) + tok.render_tool_call(CALL) + [tok.stop_ids[0]]
    a = [v["id"] for k, v in _events(tok, _call(tok), ids)[0] if k == "tool_call"]
    out = OutputText(tok, _call(tok), CallIds(tok, "ffff0000", "toolu"))
    b = [v["id"] for t in ids for k, v in out.feed(t) if k == "tool_call"]
    assert a[0] == b[0] == "toolu_own" and is_invented_call_id(a[1]) and is_invented_call_id(b[1]) and a[1] != b[1]
    assert b[1].startswith("toolu_")


@pytest.mark.parametrize("model_id", ["call_gy0123_4", "toolu_gyab_0", "gyq_call_gy1_0", "gyq_x"])
def test_model_ids_that_look_invented_survive_the_round_trip(model_id):
    """An id the model wrote that looks like one the proxy invents (or like its escape) reaches the
    client escaped, and the client's echo renders the model's own tokens again."""
    tok = ByteTokenizer()
    ids = tok.render_tool_call({**CALL, "id": QUOTED_ID + model_id}) + [tok.stop_ids[0]]  # the model writes model_id
    assert f'"id":"{model_id}"}}' in tok.decode(ids)
    call = [v for k, v in _events(tok, _call(tok), ids)[0] if k == "tool_call"][0]
    assert call["id"] != model_id and call["id"].endswith(model_id)
    assert not is_invented_call_id(call["id"])
    assert tok.render_tool_call(call) + [tok.stop_ids[0]] == ids


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_match():
    tok = ByteTokenizer()
    evs, out = _events(tok, _call(tok, stops=("END", "xy")), tok.encode("ab EN"))
    assert "".join(v for _, v in evs) == "ab EN" and out.hit is None  # no match: the held text comes out at the end
    out = OutputText(tok, _call(tok, stops=("END", "xy")), CallIds(tok, "", "call"))
    streamed = []
    for t in tok.encode("ab ENDxy more"):
        streamed += [v for _, v in out.feed(t)]
        if out.hit:
            break
    assert "".join(streamed) == "ab " and out.hit == "END"
    assert all("E" not in s for s in streamed)  # "E" was held back until it was known to start the stop
