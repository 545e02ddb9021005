"""Optional (slow): our import and export against transformers' own forward on the same files.

torch + transformers are not dependencies (5.6 GB): point ``GYRE_TORCH_PYTHON`` at a Python
that has them (``python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch
transformers safetensors numpy``, see ../shared/FACTS.md); the test runs it in a subprocess
on the checkpoint directory and skips when no such Python is found. Checked per family:
transformers' logits on the tiny checkpoint equal ours (float32), and transformers loads
our save_pretrained export and gives the same logits again (the export is servable). The
chat-template checks need transformers and jinja2 only (no torch): ``pip install transformers
jinja2`` in a venv is enough for ``-k request_fields``.

    GYRE_TORCH_PYTHON=/tmp/torchvenv/bin/python pytest -m slow tests/test_hf_transformers.py
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gyre_jax.model.hf import load_pretrained, save_pretrained
from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint

pytestmark = pytest.mark.slow
TORCH_PY = os.environ.get("GYRE_TORCH_PYTHON", sys.executable)
SCRIPT = """
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids, pos = json.loads(sys.argv[2]), json.loads(sys.argv[3])
with torch.no_grad():
    out = m(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])).logits[0]
np.save(sys.argv[4], out.double().numpy())
"""


def _our_logits(cfg, params, ids, pos):
    import jax

    from gyre_jax.model import Transformer

    L = len(ids)
    row = lambda a: np.asarray(a, np.int32)[None]  # noqa: E731
    out = jax.jit(Transformer(cfg).apply)(params, row(ids), row(pos), row(np.ones(L)), row(np.full(L, L)))
    return np.asarray(out)[0, :, : cfg.vocab_size]


def _torch_ok() -> bool:
    try:
        r = subprocess.run([TORCH_PY, "-c", "import torch, transformers"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _hf_logits(path, ids, pos, tmp):
    out = os.path.join(tmp, "logits.npy")
    subprocess.run([TORCH_PY, "-c", SCRIPT, path, json.dumps(ids), json.dumps(pos), out], check=True, timeout=600,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return np.load(out)


@pytest.mark.parametrize("family,over,edit", [
    ("qwen2", {}, {}), ("qwen3", {}, {}), ("qwen3", {"tie": False}, {}), ("llama3", {"hidden_size": 64}, {}),
    # no field: untied, lm_head used (not dropped)
    pytest.param("qwen3", {"tie": False}, {"tie_word_embeddings": None}, id="qwen3-no-tie-field"),
    # true beside a stored head that differs: untied
    pytest.param("qwen3", {"tie": False}, {"tie_word_embeddings": True}, id="qwen3-stale-tie-field"),
])
def test_logits_match_transformers(tmp_path, family, over, edit):
    if not _torch_ok():
        pytest.skip(f"{TORCH_PY} cannot import torch and transformers (set GYRE_TORCH_PYTHON)")
    src = str(tmp_path / "src")
    hf_cfg, _ = write_tiny_hf_checkpoint(src, family, seed=5, **over)
    if edit:  # config.json as other writers leave it (None: the field is absent)
        with open(os.path.join(src, "config.json")) as f:
            on_disk = json.load(f)
        on_disk.update(edit)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump({k: v for k, v in on_disk.items() if v is not None}, f)
    ids = [int(x) for x in np.random.default_rng(1).integers(0, hf_cfg["vocab_size"], 10)]
    pos = [int(p) + (40 if family == "llama3" else 0) for p in range(10)]
    want = _hf_logits(src, ids, pos, str(tmp_path))
    cfg, params = load_pretrained(src)
    np.testing.assert_allclose(_our_logits(cfg, params, np.array(ids), np.array(pos)), want, rtol=1e-5, atol=1e-5)
    out = str(tmp_path / "out")
    save_pretrained(params, cfg, out, like=src)
    np.testing.assert_array_equal(_hf_logits(out, ids, pos, str(tmp_path)), want)


TEMPLATE_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
msgs, tools = json.loads(sys.argv[2]), json.loads(sys.argv[3])
ids = tok.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
print(json.dumps(list(ids)))
"""


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_chat_template_ids_match_transformers(tmp_path, family):
    """Our render_chat == transformers' apply_chat_template(tokenize=True) on the same files."""
    if not _torch_ok():
        pytest.skip(f"{TORCH_PY} cannot import torch and transformers (set GYRE_TORCH_PYTHON)")
    from gyre_jax.serving.tokenizer import load_tokenizer
    from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

    d = str(tmp_path)
    write_tiny_hf_tokenizer(d, family)
    tok = load_tokenizer(f"hf:{d}")
    call = {"id": "c0", "name": "grep", "arguments": {"pattern": "x", "n": 2}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find x, then say done."},
            {"role": "assistant", "content": "Looking." if family == "qwen3" else "", "tool_calls": [call]},
            {"role": "tool", "content": "x.py:1", "tool_call_id": "c0"}]
    tools = [{"name": "grep", "description": "Search.", "parameters": {"type": "object"}}]
    hf_msgs = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
    hf_msgs[2]["tool_calls"] = [{"type": "function", "id": "c0",
                                 "function": {"name": "grep", "arguments": call["arguments"]}}]
    hf_tools = [{"type": "function", "function": t} for t in tools]
    r = subprocess.run([TORCH_PY, "-c", TEMPLATE_SCRIPT, d, json.dumps(hf_msgs), json.dumps(hf_tools)], check=True,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert tok.render_chat(msgs, tools) == json.loads(r.stdout.strip().splitlines()[-1])


TEMPLATE_KW_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
msgs, tools, kw = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
ids = tok.apply_chat_template(msgs, tools=tools or None, tokenize=True, add_generation_prompt=True,
                              return_dict=False, **kw)
print(json.dumps(list(ids)))
"""


def _transformers_ok() -> bool:
    """Templates need transformers and jinja2 only (no torch)."""
    try:
        r = subprocess.run([TORCH_PY, "-c", "import transformers, jinja2"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.parametrize("case", ["bare_and_reordered_tools", "reasoning_content", "enable_thinking_false"])
def test_request_fields_render_as_transformers_renders_them(tmp_path, case):
    """The cases of tests/test_hf_tokenizer.py's FIDELITY_REQUEST, one at a time, through the OpenAI API
    parser: our prompt ids == transformers' apply_chat_template(tokenize=True) on the request's own
    messages, tools and chat_template_kwargs."""
    if not _transformers_ok():
        pytest.skip(f"{TORCH_PY} cannot import transformers and jinja2 (set GYRE_TORCH_PYTHON)")
    from gyre_jax.serving.api_openai import parse_chat
    from gyre_jax.serving.tokenizer import load_tokenizer
    from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer
    from tests.test_hf_tokenizer import FIDELITY_REQUEST

    d = str(tmp_path)
    write_tiny_hf_tokenizer(d, "qwen3")
    body = dict(FIDELITY_REQUEST)
    if case != "bare_and_reordered_tools":
        body.pop("tools")
    if case != "enable_thinking_false":
        body.pop("chat_template_kwargs")
    if case != "reasoning_content":
        body["messages"] = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in body["messages"]]
    ours = parse_chat(body, load_tokenizer(f"hf:{d}")).prompt_ids.tolist()
    # transformers takes the OpenAI shapes as they are, except arguments as an object (Qwen3's template
    # prints a string verbatim, an object with tojson: the API layer parses the string).
    msgs = json.loads(json.dumps(body["messages"]))
    for m in msgs:
        for tc in m.get("tool_calls", ()):
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    r = subprocess.run([TORCH_PY, "-c", TEMPLATE_KW_SCRIPT, d, json.dumps(msgs), json.dumps(body.get("tools", [])),
                        json.dumps(body.get("chat_template_kwargs", {}))], check=True, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert ours == json.loads(r.stdout.strip().splitlines()[-1])
