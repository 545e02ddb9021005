"""Serve a model to any harness (job 'serve'): engines on the host's cells behind the router and the
recording proxy (OpenAI chat/completions + Anthropic messages), every call written to a trajectory store.

Command:
    python -m launch.main --config configs/serve.py --workdir /tmp/serve

Expected runtime: ready in ~15-30 s on 2 CPU cores (JetStream's import and the engines' compiles), then
serves until Ctrl-C / SIGTERM, which stops it cleanly. Expected result: it prints the two base URLs
(OpenAI ``http://127.0.0.1:PORT/v1``, Anthropic ``http://127.0.0.1:PORT``) and a working example per
client (openai SDK, anthropic SDK, Claude Code env vars, mini-swe-agent) with the rollout key
``gyre:<run>:<rollout>``; the calls are recorded under /tmp/serve/store. The default model is the tiny
random one (it answers noise); a checkpoint goes in ``--config.model.hf_path``.
Examples: ``--config.proxy.port=8000``, ``--config.proxy.auth_token=$(openssl rand -hex 16)``,
``--config.proxy.model_aliases=claude-*`` (Claude Code asks for its own model names).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "serve"  # gyre_jax.jobs name -> gyre_jax.serving.serve_job.run
    c.seed = 0  # random init of the tiny model
    c.num_cpu_devices = 2  # host devices on CPU (set before JAX starts); one engine per cell
    c.run_id = "serve"  # calls are recorded under this run id (the rollout key's <run>)
    c.model = ml_collections.ConfigDict(dict(
        # A Hugging Face checkpoint directory (config.json, safetensors, tokenizer files): its shape, weights,
        # tokenizer and chat template are served (only max_seq_len below applies). Empty: the tiny random model
        # with the byte tokenizer.
        hf_path="",
        # With hf_path: variables for its chat template in every prompt, as JSON, e.g. '{"enable_thinking": false}'
        # (Qwen3 without reasoning); a request's own chat_template_kwargs go over them.
        chat_template_kwargs="",
        vocab_size=272,  # byte tokenizer: 256 bytes + 11 special tokens, rounded up
        d_model=64,  # residual width
        n_layers=2,  # decoder blocks
        n_heads=4,  # query heads
        n_kv_heads=2,  # grouped-query attention
        head_dim=16,
        d_ff=128,  # SwiGLU hidden width
        max_seq_len=8192,  # longest context (prompt + answer): mini-swe-agent's first prompt is ~3.1k byte tokens
    ))
    c.cells = ml_collections.ConfigDict(dict(
        cell_size=1,  # devices per cell: one engine per cell
        serve_tensor=1,  # tensor-parallel degree of each engine
        max_slots=8,  # concurrent decode slots per engine
        tokens_per_call=8,  # decode steps per engine call (amortizes JetStream's host work on CPU)
        # Long prompts (Claude Code's first request is ~76K byte tokens: set model.max_seq_len=98304 and
        # max_slots=1 on a small machine) are prefilled in chunks of this many tokens (a power of two).
        prefill_chunk=4096,
        kv_budget_gib=0.0,  # > 0: refuse at start a decode cache (max_slots x max_seq_len) larger than this
    ))
    c.proxy = ml_collections.ConfigDict(dict(
        host="127.0.0.1",  # loopback only; 0.0.0.0 exposes it (then set auth_token)
        port=0,  # 0 = any free port (printed)
        model_name="gyre",  # the model id clients ask for
        model_aliases="",  # comma-separated fnmatch patterns also served, e.g. "claude-*" for Claude Code
        auth_token="",  # empty = no auth; else every request needs it (>= 8 characters)
        max_tokens_cap=512,  # per call
        clamp_max_tokens=True,  # a too large max_tokens is reduced to what fits (Claude Code asks for 32000)
    ))
    return c
