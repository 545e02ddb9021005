"""`python -m launch.main --config configs/serve.py`: a real subprocess, asked in both API formats over HTTP,
then stopped with SIGTERM; the calls it answered are in its trajectory store."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from gyre_jax.trajectory.store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _post(url, body, key):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_serve_command_answers_both_apis_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "launch.main", "--config", "configs/serve.py", "--workdir", str(tmp_path),
           "--config.num_cpu_devices=1", "--config.model.max_seq_len=256"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    out, url, t0 = [], None, time.time()
    try:
        while "engines ready" not in "".join(out[-1:]):
            try:
                out.append(lines.get(timeout=max(0.1, 180 - (time.time() - t0))))
            except queue.Empty:
                pytest.fail("serve did not get ready in 180 s:\n" + "".join(out))
            m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", out[-1])
            url = m.group(1) if m else url
        text = "".join(out)
        for needle in ("OpenAI SDK:", "Anthropic SDK:", "ANTHROPIC_BASE_URL=", "mini -m openai/gyre", "gyre:serve:"):
            assert needle in text, needle
        key = "gyre:serve:r-curl"
        chat = _post(url + "/v1/chat/completions",
                     {"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, key)
        # The random-init model samples: it may draw its end token before the limit (seen once in a
        # CI run: 3 of 4). Then the reply must say it stopped; otherwise it used exactly the limit.
        assert chat["object"] == "chat.completion"
        n_chat, why = chat["usage"]["completion_tokens"], chat["choices"][0]["finish_reason"]
        assert (n_chat, why) == (4, "length") or (1 <= n_chat < 4 and why == "stop"), chat
        msg = _post(url + "/v1/messages",
                    {"model": "gyre", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}, key)
        assert msg["type"] == "message"
        n_msg, why = msg["usage"]["output_tokens"], msg["stop_reason"]
        assert (n_msg, why) == (3, "max_tokens") or (1 <= n_msg < 3 and why == "end_turn"), msg
        # n=2: the prompt is prefilled once (the engine's prefix cache), each sample only feeds its last token
        before = _metric(url, 'gyre_cell_prefill_tokens{cell="cell0"}')
        two = _post(url + "/v1/chat/completions", {"model": "gyre", "max_tokens": 2, "n": 2,
                                                  "messages": [{"role": "user", "content": "twice"}]}, "gyre:serve:r-n")
        assert [c["index"] for c in two["choices"]] == [0, 1]
        assert _metric(url, 'gyre_cell_prefill_tokens{cell="cell0"}') - before == two["usage"]["prompt_tokens"] - 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while not lines.empty():
        out.append(lines.get())
    assert "stopped cleanly; 4 calls recorded" in "".join(out), "".join(out[-20:])
    store = TrajectoryStore(str(tmp_path / "store"), run_id="serve", writable=False)
    calls = store.calls("r-curl")
    # The store holds exactly the tokens each reply reported (an early end token included: CI saw 1 of 3).
    assert [(c.call_index, len(c.output_ids)) for c in calls] == [(0, n_chat), (1, n_msg)]
    assert [c.call_index for c in store.calls("r-n")] == [0, 1]
    store.close()


@pytest.mark.parametrize("fmt", ["dir", "gguf"])
def test_serve_builds_on_a_hf_checkpoint(tmp_path, fmt):
    """config.model.hf_path: the checkpoint's shape, weights, tokenizer and chat template are served
    (in-process: build_server, one call through the real proxy, recorded with the template's prompt).
    ``gguf``: the same checkpoint as one .gguf file (weights, tokenizer and template from its metadata)."""
    import importlib.util

    from gyre_jax.serving.serve_job import build_server
    from gyre_jax.serving.tokenizer import load_tokenizer
    from gyre_jax.testing.tiny_hf_checkpoint import write_tiny_hf_checkpoint
    from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

    ck = str(tmp_path / "ck")
    n = write_tiny_hf_tokenizer(ck, "qwen3")
    hf_cfg, tensors = write_tiny_hf_checkpoint(ck, "qwen3", vocab_size=n + 1, seed=1)
    if fmt == "gguf":
        pytest.importorskip("gguf")
        from gyre_jax.testing.tiny_gguf import gguf_tokenizer_fields, write_tiny_gguf

        ref_dir, ck = ck, str(tmp_path / "m.gguf")
        write_tiny_gguf(ck, hf_cfg, tensors, tokenizer=gguf_tokenizer_fields(ref_dir))
    spec = importlib.util.spec_from_file_location("serve_cfg", os.path.join(ROOT, "configs", "serve.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.model.hf_path, c.model.max_seq_len = ck, 256
    c.cells.update(dict(cell_size=8, serve_tensor=2, max_slots=2, tokens_per_call=4))
    server, store, tok = build_server(c, str(tmp_path / "w"))
    try:
        url = server.start()
        messages = [{"role": "user", "content": "hi"}]
        chat = _post(url + "/v1/chat/completions", {"model": "gyre", "max_tokens": 3, "messages": messages},
                     "gyre:serve:r-hf")
        assert chat["usage"]["completion_tokens"] <= 3
    finally:
        server.stop()
    [call] = store.calls("r-hf")
    ref = load_tokenizer(f"hf:{ck}")
    if fmt == "gguf":  # the file's tokenizer is the directory's
        d = load_tokenizer(f"hf:{ref_dir}")
        assert ref.render_chat(messages) == d.render_chat(messages) and ref.stop_ids == d.stop_ids
    assert list(call.prompt_ids) == ref.render_chat(messages) and type(tok) is type(ref)
    store.close()
