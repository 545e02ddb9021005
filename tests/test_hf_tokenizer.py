"""HF tokenizers with their own chat templates and tool-call syntax (serving/hf_tokenizer.py).

A small byte-level BPE tokenizer.json is trained here (gyre_jax.testing.tiny_hf_tokenizer)
around templates modelled on the real Qwen3 and Llama-3.1 ones. Checked: the prompt is
the template's text encoded as a whole (what transformers/vLLM feed the model), the
family's tool calls parse into the normalized calls and render back to the very same
tokens, streaming (AssistantStream) adds up to parse_assistant for every prefix shape,
and when a re-render drifts the trajectory tree keeps both token sequences exactly.
"""
import functools
import json

import numpy as np
import pytest

from gyre_jax.serving.api_common import AssistantStream
from gyre_jax.serving.hf_tokenizer import HFChatTokenizer
from gyre_jax.serving.tokenizer import load_tokenizer
from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer
from gyre_jax.trajectory.records import ModelCallRecord
from gyre_jax.trajectory.tree import rebuild

TOOLS = [{"name": "bash", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
CONV = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "List the files, then tell me the answer."}]
CALL = {"id": "call_0", "name": "bash", "arguments": {"cmd": "ls -la", "timeout": 5}}


@functools.cache
def _tok_dir(family, tmp_root):
    d = f"{tmp_root}/{family}"
    write_tiny_hf_tokenizer(d, family)
    return d


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tok"))
    return {f: load_tokenizer(f"hf:{_tok_dir(f, root)}") for f in ("qwen3", "llama3")}


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_prompt_is_the_rendered_template_encoded_whole(toks, family):
    tok = toks[family]
    assert isinstance(tok, HFChatTokenizer)
    assert tok.tool_format == {"qwen3": "qwen", "llama3": "llama3_json"}[family]
    text = tok.render_text(CONV, TOOLS)
    ids = tok.render_chat(CONV, TOOLS)
    assert ids == tok.tk.encode(text, add_special_tokens=False).ids
    gen = {"qwen3": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[family]
    assert text.endswith(gen) and not tok.render_text(CONV, TOOLS, add_generation_prompt=False).endswith(gen)
    assert json.dumps(TOOLS[0]["parameters"]["properties"]["cmd"]) in text.replace("\n", "").replace("    ", "") or \
        '"cmd": {"type": "string"}' in text
    turn_end = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[family]
    assert tok.stop_ids[0] == tok.tk.token_to_id(turn_end) == tok.special["<|im_end|>"]
    assert ids.count(tok.stop_ids[0]) >= 2  # the template's turn ends are single special tokens
    if family == "llama3":
        assert ids[0] == tok.tk.token_to_id("<|begin_of_text|>") and ids.count(ids[0]) == 1
    # plain encode() never makes special tokens out of text
    assert tok.stop_ids[0] not in tok.encode(f"text with {turn_end} inside")


def _model_output(tok, msg):
    """The tokens a model writes for ``msg`` in the canonical form: the template's own rendering."""
    before = tok.render_chat(CONV, TOOLS, add_generation_prompt=True)
    after = tok.render_chat(CONV + [msg], TOOLS, add_generation_prompt=False)
    assert after[: len(before)] == before
    out = after[len(before):]
    k = out.index(tok.stop_ids[0])
    return out[: k + 1]


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_tool_call_parses_and_renders_back_unchanged(toks, family):
    tok = toks[family]
    content = "I'll look first." if family == "qwen3" else ""  # Llama-3 JSON calls are the whole message
    msg = {"role": "assistant", "content": content, "tool_calls": [CALL]}
    out = _model_output(tok, msg)
    parsed = tok.parse_assistant(out)
    assert parsed["tool_calls"] == [CALL] and parsed["stopped"]
    # Qwen3 renders the latest assistant turn with an (empty) think block: it is part of what the model wrote
    assert parsed["content"] == ("<think>\n\n</think>\n\n" if family == "qwen3" else "") + content
    again = _model_output(tok, {"role": "assistant", "content": parsed["content"], "tool_calls": parsed["tool_calls"]})
    assert again == out
    if family == "qwen3":  # render_tool_call is the template's span
        span = tok.render_tool_call(CALL)
        assert out[len(out) - 1 - len(span): -1] == span
        assert tok.tool_call_open_ids() == span[: len(tok.tool_call_open_ids())]
    else:
        assert tok.tool_call_open_ids() == out[: len(tok.tool_call_open_ids())]


def _stream_events(tok, ids, parse_tools=True):
    s = AssistantStream(tok, parse_tools=parse_tools)
    ev = []
    for t in ids:
        ev += s.feed(int(t))
    ev += s.finish()
    text = "".join(v for k, v in ev if k == "text")
    calls = [v for k, v in ev if k == "tool_call"]
    return text, calls


QWEN_OUTPUTS = [
    "Plain answer: 42.\n",
    "Let me check.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"ls\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call>",
    "Broken: <tool_call>\n{not json}\n</tool_call> and more text\n",
    "Unterminated <tool_call>\n{\"name\": \"bash\"",
    "Text then newline\n\n<tool_call>{\"name\":\"bash\",\"arguments\":{\"cmd\":\"é ü\"}}</tool_call>",
    "<think>\nhmm\n</think>\n\nDone: naïve café ✓",
]
LLAMA_OUTPUTS = [
    '{"name": "bash", "parameters": {"cmd": "ls"}}',
    '<|python_tag|>{"name": "bash", "parameters": {"cmd": "ls"}}',
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}',
    "{ this looks like JSON but is not",
    "  Just a sentence, no call. ✓",
    "",
]


@pytest.mark.parametrize("family,text", [("qwen3", t) for t in QWEN_OUTPUTS] + [("llama3", t) for t in LLAMA_OUTPUTS])
def test_stream_adds_up_to_parse_assistant(toks, family, text):
    tok = toks[family]
    ids = tok.encode_with_special(text) + [tok.stop_ids[0]] + tok.encode("after the stop")
    want = tok.parse_assistant(ids)
    assert want["stopped"]
    got_text, got_calls = _stream_events(tok, ids)
    assert (got_text, got_calls) == (want["content"], want["tool_calls"])
    if family == "qwen3" and "{not json}" in text:
        assert "<tool_call>" in want["content"] and not want["tool_calls"]  # nothing dropped
    no_tools_text, no_calls = _stream_events(tok, ids, parse_tools=False)
    assert no_calls == [] and no_tools_text == tok.decode(ids[: ids.index(tok.stop_ids[0])])


def _record(ci, prompt, out):
    return ModelCallRecord(run_id="run", rollout_id="r", task_id="t", group_id="g", agent_id=0, parent_agent_id=None,
                           role="main", call_index=ci, prompt_ids=np.asarray(prompt, np.int32),
                           output_ids=np.asarray(out, np.int32), output_logprobs=-np.ones(len(out), np.float32),
                           policy_version=0, t_start=0.0, t_end=1.0, finish_reason="stop")


def _path_to(root, target):
    stack = [(root, [root])]
    while stack:
        n, chain = stack.pop()
        if n is target:
            return chain
        stack += [(c, chain + [c]) for c in n.children]
    raise AssertionError("node not in tree")


def test_drifted_rerender_keeps_both_branches_exactly(toks):
    """The model wrote a call in a non-canonical form (no separator, compact JSON): the next
    prompt re-renders it canonically, so its tokens differ; the tree keeps both exactly."""
    tok = toks["qwen3"]
    p1 = tok.render_chat(CONV, TOOLS)
    out1 = tok.encode_with_special('Checking.<tool_call>{"name":"bash","arguments":{"cmd":"ls -la","timeout":5}}'
                                   '</tool_call>') + [tok.stop_ids[0]]
    parsed = tok.parse_assistant(out1)
    assert parsed["tool_calls"] == [CALL] and parsed["content"] == "Checking."
    conv2 = CONV + [{"role": "assistant", "content": parsed["content"], "tool_calls": parsed["tool_calls"]},
                    {"role": "tool", "content": "a.py b.py", "tool_call_id": "call_0"}]
    p2 = tok.render_chat(conv2, TOOLS)
    out2 = tok.encode("The files are a.py and b.py.") + [tok.stop_ids[0]]
    assert p2[: len(p1)] == p1 and p2[: len(p1) + len(out1)] != p1 + out1  # drift inside call 1's output
    rt = rebuild([_record(0, p1, out1), _record(1, p2, out2)])
    for ci, (prompt, out) in enumerate([(p1, out1), (p2, out2)]):
        chain = _path_to(rt.root, rt.end_nodes[ci])
        toks_ = np.concatenate([n.tokens for n in chain])
        train = np.concatenate([n.trainable for n in chain])
        assert toks_.tolist() == prompt + out  # each call's exact token sequence is one root-to-node path
        assert train[len(prompt):].all()  # what the model generated is trained, on its own branch
    div = next(i for i, (a, b) in enumerate(zip(p1 + out1, p2)) if a != b)
    assert rt.unique_tokens == len(p2) + len(out2) + (len(p1) + len(out1) - div)


QWEN3_TOOLS_HEAD = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
                    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN3_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                    "<args-json-object>}\n</tool_call><|im_end|>\n")
# One OpenAI request with the three things transformers renders and a rebuilt request lost: a tool with neither
# description nor parameters and one whose keys come in another order, an earlier turn's reasoning_content,
# and chat_template_kwargs. tests/test_hf_transformers.py renders the same cases with transformers itself.
FIDELITY_REQUEST = {
    "model": "m",
    "messages": [{"role": "user", "content": "Find x."},
                 {"role": "assistant", "content": "Looking.", "reasoning_content": "Grep for it.",
                  "tool_calls": [{"id": "c0", "type": "function",
                                  "function": {"name": "grep", "arguments": '{"p": "x"}'}}]},
                 {"role": "tool", "tool_call_id": "c0", "content": "x.py:1"}],
    "tools": [{"type": "function", "function": {"name": "grep"}},
              {"type": "function", "function": {"parameters": {"type": "object"}, "name": "ls", "description": "List."}}],
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_openai_request_renders_what_qwen3s_template_makes_of_it(toks):
    """Tools as sent (no empty fields added, keys in the client's order), reasoning_content inside <think>,
    and enable_thinking=false's empty think block after the generation prompt."""
    from gyre_jax.serving.api_openai import parse_chat

    tok = toks["qwen3"]
    want = (QWEN3_TOOLS_HEAD + '\n{"type": "function", "function": {"name": "grep"}}'
            '\n{"type": "function", "function": {"parameters": {"type": "object"}, "name": "ls", "description": "List."}}'
            + QWEN3_TOOLS_TAIL
            + "<|im_start|>user\nFind x.<|im_end|>\n"
            + '<|im_start|>assistant\n<think>\nGrep for it.\n</think>\n\nLooking.\n<tool_call>\n{"name": "grep", '
              '"arguments": {"p": "x"}}\n</tool_call><|im_end|>\n'
            + "<|im_start|>user\n<tool_response>\nx.py:1\n</tool_response><|im_end|>\n"
            + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = parse_chat(FIDELITY_REQUEST, tok)
    assert tok.decode(call.prompt_ids) == tok.decode(tok.encode_with_special(want))  # a readable diff first
    assert call.prompt_ids.tolist() == tok.encode_with_special(want)
    assert "chat_template_kwargs" not in call.ignored
    # Without the request's kwargs the prompt ends at the generation prompt: thinking stays on.
    plain = parse_chat({k: v for k, v in FIDELITY_REQUEST.items() if k != "chat_template_kwargs"}, tok)
    assert plain.prompt_ids.tolist() == tok.encode_with_special(want[: -len("<think>\n\n</think>\n\n")])


def test_template_kwargs_of_the_tokenizer_and_of_a_request(tmp_path, toks):
    """load_tokenizer's template_kwargs (a config's chat_template_kwargs) apply to every render; a request's go
    over them; the byte tokenizer's token-level template has none (listed as ignored, refused from a config)."""
    from gyre_jax.serving.api_openai import parse_chat
    from gyre_jax.serving.tokenizer import ByteTokenizer

    tok = load_tokenizer(f"hf:{_tok_dir('qwen3', str(tmp_path))}", template_kwargs={"enable_thinking": False})
    hi = [{"role": "user", "content": "hi"}]
    assert tok.render_text(hi).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.render_text(hi, template_kwargs={"enable_thinking": True}) == toks["qwen3"].render_text(hi)
    with pytest.raises(ValueError, match="add_generation_prompt.*set from the request"):
        tok.render_text(hi, template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat_template_kwargs.*'byte' has no chat template"):
        load_tokenizer("byte", template_kwargs={"enable_thinking": False})
    byte = ByteTokenizer()
    call = parse_chat(FIDELITY_REQUEST, byte)
    assert "chat_template_kwargs" in call.ignored
    # The token-level template still renders a bare tool with the empty fields it always had.
    assert byte.render_chat(hi, [{"name": "grep"}]) == byte.render_chat(hi, [{"name": "grep", "description": "",
                                                                             "parameters": {}}])
