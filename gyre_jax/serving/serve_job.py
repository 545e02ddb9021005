"""Job 'serve' (configs/serve.py): the model behind the recording proxy, for any harness, until stopped.

One JetStream engine per cell of this host's devices, the router over them, the proxy in front
(OpenAI + Anthropic APIs), every call written to ``<workdir>/store``. Prints the base URLs and an
example per client, then waits for SIGINT/SIGTERM and shuts the server, engines and store down.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import jax
import numpy as np

from gyre_jax.distributed import ensure_cpu_devices
from gyre_jax.errors import ConfigError
from gyre_jax.serving import identity

EXAMPLE_ROLLOUT = "rollout-0"


def _model_config(c):
    """The tiny model's ModelConfig from config.model (a checkpoint's comes from its config.json)."""
    from gyre_jax.model.config import ModelConfig

    m = dict(c.model)
    m.pop("hf_path", None)
    m.pop("chat_template_kwargs", None)
    try:
        return ModelConfig(**m)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.model: {e}") from None


def _model(c, cells):
    """(ModelConfig, params, tokenizer): a Hugging Face checkpoint (its shape, weights, tokenizer and chat
    template; only config.model.max_seq_len is taken from the config) or the tiny random model."""
    from gyre_jax.cells.mesh import Role
    from gyre_jax.model import init_params
    from gyre_jax.serving.tokenizer import ByteTokenizer, chat_template_kwargs, load_tokenizer

    hf_path = str(c.model.get("hf_path", "") or "")
    try:
        template_kw = chat_template_kwargs(c.model.get("chat_template_kwargs"), "config.model.chat_template_kwargs")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not hf_path:
        if template_kw:
            raise ConfigError(f"config.model.chat_template_kwargs={template_kw} needs config.model.hf_path (the "
                              "byte tokenizer's chat template takes no variables)")
        mc = _model_config(c)
        tok = ByteTokenizer()
        if tok.vocab_size > mc.vocab_size:
            raise ConfigError(f"config.model.vocab_size={mc.vocab_size} < the tokenizer's {tok.vocab_size} ids")
        return mc, init_params(mc, jax.random.key(c.seed)), tok
    from gyre_jax.model.hf import load_pretrained

    try:
        tok = load_tokenizer(f"hf:{hf_path}", template_kwargs=template_kw)
        # Loaded once onto the first cell's serving mesh; every engine puts them in its own shardings.
        mc, params = load_pretrained(hf_path, mesh=cells[0].mesh(Role.ROLLOUT), max_seq_len=int(c.model.max_seq_len),
                                     vocab_pad_multiple=int(c.cells.serve_tensor))
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"config.model.hf_path={hf_path!r}: {e}") from None
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"config.model.hf_path={hf_path!r}: the tokenizer has {tok.vocab_size} ids, the model "
                          f"{mc.vocab_size}")
    return mc, params, tok


def _proxy_config(c, model_name_default: str = "gyre"):
    from gyre_jax.serving.proxy import ProxyConfig

    p = c.proxy
    aliases = tuple(a.strip() for a in str(p.model_aliases or "").split(",") if a.strip())
    try:
        return ProxyConfig(host=p.host, port=int(p.port), model_name=p.model_name or model_name_default,
                           model_aliases=aliases, auth_token=p.auth_token or None, max_tokens_cap=int(p.max_tokens_cap),
                           clamp_max_tokens=bool(p.clamp_max_tokens))
    except ValueError as e:
        raise ConfigError(f"config.proxy: {e}") from None


def build_server(c, workdir: str):
    """(ServerThread not yet started, TrajectoryStore): engines on the cells, router, proxy."""
    from gyre_jax.cells.mesh import CellConfig, Role, split_cells
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.jetstream_backend import JetStreamBackend
    from gyre_jax.serving.proxy import Proxy
    from gyre_jax.serving.router import Router
    from gyre_jax.serving.server_thread import ServerThread
    from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore

    identity.check_id(c.run_id, "config.run_id")
    pc = _proxy_config(c)
    try:
        cells = split_cells(CellConfig(cell_size=c.cells.cell_size, serve_tensor=c.cells.serve_tensor,
                                       serve_expert=c.cells.get("serve_expert", 1)))
    except ValueError as e:
        raise ConfigError(f"config.cells: {e}") from None
    mc, params, tok = _model(c, cells)
    store = TrajectoryStore(os.path.join(workdir, "store"), run_id=c.run_id,
                            config=StoreConfig(vocab_size=mc.vocab_size))
    special = (tok.special["<|bos|>"], tok.special["<|eos|>"], tok.special["<|pad|>"])

    async def build():
        backends = [JetStreamBackend(GyreEngine(mc, params, mesh=cell.mesh(Role.ROLLOUT), max_slots=c.cells.max_slots,
                                                max_len=mc.max_seq_len, name=f"cell{cell.index}", special_ids=special,
                                                tokens_per_call=c.cells.tokens_per_call,
                                                prefill_chunk=c.cells.get("prefill_chunk", 4096),
                                                kv_budget_bytes=_kv_budget(c),
                                                kv_cache=c.cells.get("kv_cache", "contiguous"),
                                                page_size=c.cells.get("page_size", 16),
                                                kv_pages=c.cells.get("kv_pages", 0) or None), name=f"cell{cell.index}")
                    for cell in cells]
        return Proxy(Router(backends), tok, store, pc)

    return ServerThread(build), store, tok


def _kv_budget(c) -> int | None:
    gib = float(c.cells.get("kv_budget_gib", 0.0))
    return int(gib * 2**30) if gib > 0 else None


def _warm(server, tok) -> None:
    """One 2-token call per engine, so the first client does not wait for the compiles."""
    from gyre_jax.serving.backend import GenerateRequest, SamplingParams

    prompt = np.asarray(tok.render_chat([{"role": "user", "content": "hi"}]), np.int32)

    async def one(b, i):
        async for _ in b.submit(GenerateRequest(request_id=f"warm-{i}", prompt_ids=prompt,
                                                sampling=SamplingParams(max_tokens=2))):
            pass

    async def all_():
        await asyncio.gather(*(one(b, i) for i, b in enumerate(server.proxy.router.cells.values())))

    server.run(all_(), timeout=600)


def usage_text(url: str, model: str, run_id: str, auth_token: str | None) -> str:
    """What a user pastes into each client (printed at start)."""
    key = identity.api_key(run_id, EXAMPLE_ROLLOUT)
    auth = "" if auth_token is None else (
        f"\n  auth is on: send the token as the key ({auth_token[:4]}...), tie calls to rollouts with the "
        f"{identity.HEADER_RUN}/{identity.HEADER_ROLLOUT} headers")
    return f"""gyre serve: ready at {url}
  OpenAI base URL:    {url}/v1   (POST /chat/completions, /completions; GET /models)
  Anthropic base URL: {url}      (POST /v1/messages)
  model: {model!r}; metrics: {url}/metrics; health: {url}/health
  Rollout key convention: api key gyre:<run>:<rollout> (run must be {run_id!r}); calls are numbered per rollout
  and recorded once each; or headers {identity.HEADER_RUN}, {identity.HEADER_ROLLOUT}, {identity.HEADER_CALL}, ...{auth}

OpenAI SDK:
  from openai import OpenAI
  c = OpenAI(base_url="{url}/v1", api_key="{key}")
  print(c.chat.completions.create(model="{model}", max_tokens=16,
        messages=[{{"role": "user", "content": "hi"}}]).choices[0].message.content)
Anthropic SDK:
  from anthropic import Anthropic
  c = Anthropic(base_url="{url}", api_key="{key}")
  print(c.messages.create(model="{model}", max_tokens=16, messages=[{{"role": "user", "content": "hi"}}]).content)
Claude Code (serve with --config.proxy.model_aliases='claude-*'):
  ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY={key} CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude -p "say hi"
mini-swe-agent (litellm; its first prompt is ~3.1k tokens):
  OPENAI_API_BASE={url}/v1 OPENAI_API_KEY={key} MSWEA_COST_TRACKING=ignore_errors LITELLM_LOCAL_MODEL_COST_MAP=True \\
    MSWEA_CONFIGURED=true mini -m openai/{model} -t "say hi" -y -l 0 -c mini.yaml -c agent.step_limit=5
curl:
  curl -s {url}/v1/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 8, "messages": [{{"role": "user", "content": "hi"}}]}}'
Stop with Ctrl-C (SIGINT) or SIGTERM."""


def run(config, workdir: str) -> None:
    t0 = time.perf_counter()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    ensure_cpu_devices(config.num_cpu_devices)
    server, store, tok = build_server(config, workdir)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = server.start()
        _warm(server, tok)
        proxy = server.proxy
        print(usage_text(url, proxy.cfg.model_name, config.run_id, proxy.cfg.auth_token), flush=True)
        print(f"serve: {len(proxy.router.cells)} engines ready in {time.perf_counter() - t0:.1f}s; "
              f"recording to {store.directory}", flush=True)
        while not stop.wait(1.0):
            pass
        print("serve: stopping (signal)", flush=True)
        recorded = proxy.counters.get("records_written", 0)
    finally:
        server.stop()
        store.close()
        for s, h in previous.items():
            signal.signal(s, h)
    print(f"serve: stopped cleanly; {recorded} calls recorded", flush=True)
