"""The RL loop on a Hugging Face checkpoint: configs/qwen3_8b.py and configs/llama3_8b.py with
``--config.model.hf_path`` pointing at a tiny checkpoint written here (random weights in the
exact HF layout, a BPE tokenizer.json trained here, the family's chat template). The real
stack runs (cells, JetStream engines, the HTTP proxy rendering the checkpoint's template
and parsing its tool-call syntax, the harness, the elastic step) for one step, and the
policy comes back out as a HF checkpoint that loads again.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from gyre_jax import jobs
from gyre_jax.errors import ConfigError
from gyre_jax.model.hf import load_pretrained
from gyre_jax.rl.config import RLConfig
from gyre_jax.serving.tokenizer import load_tokenizer
from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint
from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def tiny_checkpoint(path, family):
    """A checkpoint directory: weights + config.json + tokenizer files; an odd vocab (padding is exercised)."""
    n = write_tiny_hf_tokenizer(str(path), "qwen3" if family != "llama3" else "llama3")
    write_tiny_hf_checkpoint(str(path), family, vocab_size=n + 1, seed=1)
    return str(path)


def tiny_rl_config(name, hf_path, steps=1):
    c = _config(name)
    c.steps = steps
    c.progress = False
    c.checkpoint_every = 1
    c.first_last = 1
    # The tools section of the template is ~540 (Qwen3) / ~830 (Llama-3) tokens with the tiny BPE vocabulary.
    n = 1024 if name.startswith("llama") else 768
    c.model.update(dict(hf_path=hf_path, max_seq_len=n, remat=False, dtype="float32", param_dtype="float32"))
    c.cells.update(dict(cell_size=4, train_tensor=2, serve_tensor=2, max_slots=4, max_len=n, tokens_per_call=4))
    c.scheduler.update(dict(groups_per_step=1, group_size=4, min_work_per_switch_s=0.0))
    c.task.update(dict(family="tiny", ops="copy", min_len=3, max_len=3))
    c.harness.update(dict(max_tokens=8, max_turns=1, deadline_s=30.0, request_timeout_s=30.0, grader_timeout_s=30.0,
                          system_prompt="Write the answer to answer.txt."))
    c.train.update(dict(row_len=n, micro_batch_rows=2, learning_rate=1e-3, work_s_per_row=0.05))
    c.eval.every = 0
    return c


def test_config_takes_the_shape_from_the_checkpoint(tmp_path):
    d = tiny_checkpoint(tmp_path / "ck", "qwen3")
    cfg = RLConfig.from_config(tiny_rl_config("qwen3_8b", d))
    assert cfg.hf_path == d and cfg.hf_export and cfg.model.qk_norm and not cfg.model.qkv_bias
    assert cfg.model.vocab_size == 407 and cfg.model.padded_vocab == 408  # tensor 2 splits the vocab
    assert cfg.model.max_seq_len == 768 and cfg.harness.send_tools_schema
    with pytest.raises(ConfigError, match="hf_path is empty"):
        RLConfig.from_config(tiny_rl_config("qwen3_8b", ""))
    c = tiny_rl_config("qwen3_8b", d)
    c.model.d_model = 64
    with pytest.raises(ConfigError, match=r"\['d_model'\] come from"):
        RLConfig.from_config(c)
    c = tiny_rl_config("qwen3_8b", d)
    c.cells.serve_tensor = 4
    with pytest.raises(ConfigError, match="cells.serve_tensor=4 does not divide the checkpoint's n_kv_heads=2"):
        RLConfig.from_config(c)
    with pytest.raises(ConfigError, match="config.model.hf_path=.*config.json"):
        RLConfig.from_config(tiny_rl_config("qwen3_8b", str(tmp_path)))


def test_config_takes_the_shape_from_a_gguf_file(tmp_path):
    """--config.model.hf_path=/path/model.gguf: the same model config as the checkpoint directory it was written
    from (the file's metadata), and the run's tokenizer from the file."""
    pytest.importorskip("gguf")
    from gyre_jax.rl.build import _tokenizer
    from gyre_jax.testing.tiny_gguf import gguf_tokenizer_fields, write_tiny_gguf
    from gyre_jax.testing.tiny_hf_checkpoint import tiny_hf_tensors

    d = tiny_checkpoint(tmp_path / "ck", "qwen3")
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    g = str(tmp_path / "m.gguf")
    write_tiny_gguf(g, hf, tiny_hf_tensors(hf, seed=1), tokenizer=gguf_tokenizer_fields(d))
    from_dir, from_file = (RLConfig.from_config(tiny_rl_config("qwen3_8b", p)) for p in (d, g))
    assert from_file.model == from_dir.model.replace(max_seq_len=from_file.model.max_seq_len)
    msgs = [{"role": "user", "content": "hi"}]
    assert _tokenizer(from_file).render_chat(msgs) == _tokenizer(from_dir).render_chat(msgs)


def test_external_config_composes_with_a_checkpoint(tmp_path):
    """configs/external.py's model section takes hf_path: the checkpoint's shape replaces the random model's
    (the shape fields it leaves at the tiny model's), the section's max_seq_len/dtype stay; configs/smol_agent.py
    is that with SmolLM2."""
    d = tiny_checkpoint(tmp_path / "ck", "qwen3")
    c = _config("external")
    c.model.hf_path = d
    cfg = RLConfig.from_config(c)
    assert cfg.hf_path == d and cfg.model.qk_norm and cfg.model.vocab_size == 407
    assert cfg.model.max_seq_len == c.model.max_seq_len and cfg.harness.kind == "command"
    c = _config("external")
    c.model.d_model = 64  # a config that sets a shape field of its own: a clash with the checkpoint is an error
    c.model.hf_path = d
    with pytest.raises(ConfigError, match="come from"):
        RLConfig.from_config(c)


def test_chat_template_kwargs_from_the_config_reach_the_runs_tokenizer(tmp_path):
    """config.model.chat_template_kwargs (JSON) is passed to the checkpoint's template in every render: Qwen3's
    non-thinking mode from the command line. A bad value or one without a checkpoint fails naming the field."""
    from gyre_jax.rl.build import _tokenizer

    d = tiny_checkpoint(tmp_path / "ck", "qwen3")
    c = tiny_rl_config("qwen3_8b", d)
    c.model.chat_template_kwargs = '{"enable_thinking": false}'
    cfg = RLConfig.from_config(c)
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert _tokenizer(cfg).render_text([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    c.model.chat_template_kwargs = '{"enable_thinking": false'
    with pytest.raises(ConfigError, match="config.model.chat_template_kwargs: not valid JSON"):
        RLConfig.from_config(c)
    demo = _config("demo")
    demo.model.chat_template_kwargs = '{"enable_thinking": false}'
    with pytest.raises(ConfigError, match="chat_template_kwargs=.*needs config.model.hf_path"):
        RLConfig.from_config(demo)


@pytest.mark.parametrize("name,family", [("qwen3_8b", "qwen3"),
                                         pytest.param("llama3_8b", "llama3", marks=pytest.mark.slow)])
def test_rl_step_on_a_hf_checkpoint_and_export(tmp_path, name, family):
    d = tiny_checkpoint(tmp_path / "ck", family)
    c = tiny_rl_config(name, d)
    summary = jobs.get(c.job)(c, str(tmp_path / "run"))
    wd = os.path.join(tmp_path, "run", "elastic")
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [0] and summary["statuses"] == {"completed": 4}
    # The proxy rendered the checkpoint's own template: every recorded prompt is its rendering.
    from gyre_jax.trajectory.store import TrajectoryStore

    tok = load_tokenizer(f"hf:{d}")
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl", writable=False) as store:
        calls = [c for r in store.rollout_ids() for c in store.calls(r)]
    assert calls
    turn_start = tok.tk.token_to_id("<|im_start|>" if family == "qwen3" else "<|start_header_id|>")
    for call in calls:
        assert turn_start in call.prompt_ids.tolist()
        assert int(call.prompt_ids.max()) < tok.vocab_size
    # The policy came back out as a HF checkpoint with the source's tokenizer files.
    out = os.path.join(wd, "hf_export")
    for fn in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(out, fn)), fn
    cfg2, params2 = load_pretrained(out)
    cfg1, params1 = load_pretrained(d)
    assert cfg2 == cfg1
    assert np.asarray(params2["params"]["embed"]).shape == (cfg1.vocab_size, 32)


@pytest.mark.slow
def test_warm_started_qwen3_checkpoint_makes_tool_calls_through_the_proxy(tmp_path):
    """SFT on the scripted demonstrations rendered with the Qwen3 template, then RL steps: the
    rollouts' tool calls are written in Qwen's <tool_call> syntax, parsed by the proxy and run
    by the harness (the graded workspaces earn reward)."""
    d = str(tmp_path / "ck")
    n = write_tiny_hf_tokenizer(d, "qwen3")
    write_tiny_hf_checkpoint(d, "qwen3", vocab_size=n + 1, seed=1, hidden_size=64, intermediate_size=128)
    c = tiny_rl_config("qwen3_8b", d, steps=2)
    c.harness.max_tokens = 80
    c.sft.update(dict(steps=300, rows=2, learning_rate=3e-3, demos=256))
    summary = jobs.get(c.job)(c, str(tmp_path / "run"))
    wd = os.path.join(tmp_path, "run", "elastic")
    from gyre_jax.trajectory.store import TrajectoryStore

    tok = load_tokenizer(f"hf:{d}")
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl", writable=False) as store:
        outs = [c.output_ids for r in store.rollout_ids() for c in store.calls(r)]
    open_id = tok.special["<|tool_call|>"]
    with_calls = [o for o in outs if tok.parse_assistant(o)["tool_calls"]]
    assert sum(open_id in o.tolist() for o in outs) >= len(outs) // 2, summary
    assert len(with_calls) >= len(outs) // 2
    assert summary["reward_last"] > 0


def test_sft_targets_are_the_templates_own_turns(tmp_path):
    """The warm start trains what the template renders for an assistant turn (Qwen3: empty think block,
    newline-separated <tool_call> spans), so a warm-started model's turns re-render to the same tokens;
    a template that cannot render a demonstration (Llama-3.1: one tool call per turn) is a ConfigError."""
    from gyre_jax.rl.sft import demo_examples
    from gyre_jax.serving.api_openai import parse_chat

    d = tiny_checkpoint(tmp_path / "q", "qwen3")
    cfg = RLConfig.from_config(tiny_rl_config("qwen3_8b", d))
    tok = load_tokenizer(f"hf:{d}")
    hc = cfg.harness
    [(prompt, target)] = demo_examples(cfg.task_source.demo_tasks(1), hc, tok)
    target = target.tolist()
    assert target[-1] in tok.stop_ids and tok.decode(target).startswith("<think>\n\n</think>\n\n")
    parsed = tok.parse_assistant(target)
    assert [c["name"] for c in parsed["tool_calls"]] == ["write_file", "finish"]
    body = {"model": hc.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    msg = {"role": "assistant", "content": parsed["content"], "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in parsed["tool_calls"]]}
    before = list(parse_chat(body, tok).prompt_ids)
    after = list(parse_chat({**body, "messages": body["messages"] + [msg]}, tok).prompt_ids)
    assert after[len(before): len(before) + len(target)] == target  # the re-render gives the trained tokens

    d = tiny_checkpoint(tmp_path / "l", "llama3")
    cfg = RLConfig.from_config(tiny_rl_config("llama3_8b", d))
    with pytest.raises(ConfigError, match="config.sft: demonstration of task .* one tool|single tool"):
        demo_examples(cfg.task_source.demo_tasks(1), cfg.harness, load_tokenizer(f"hf:{d}"))
