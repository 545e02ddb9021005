"""Benchmark: tokens/s served through the proxy + JetStream orchestrator, against a
plain jitted decode loop on the same model and batch.

* served: the recording proxy (aiohttp, loopback) -> router -> one cell
  (JetStreamBackend: GyreEngine under JetStream's Driver threads). A client in a
  separate process (as a real harness would be) sends ``--batch`` concurrent
  ``/v1/completions`` requests (token-id prompts of ``--prompt_len``, greedy,
  ``ignore_eos``, ``--new_tokens`` each), waits for all, and the server records
  every call into a real TrajectoryStore. Tokens/s = generated tokens / wall time
  from first request to last response, prefill and HTTP included. Run twice:
  whole responses, and streamed (SSE, one event per token).
* plain: the limit. The same prompts prefilled into the same KV cache (same
  slots, same cache length), then ``lax.fori_loop`` over ``--new_tokens`` steps of
  decode_step + the same sampler (token and log-prob), one jitted program;
  timed without prefill.

Rounds: one warm-up (compiles), then ``--rounds`` timed rounds; medians.
Final line: JSON with served_tokens_per_s (whole responses), plain_tokens_per_s,
ratio, and the streamed numbers. Target: ratio >= 0.8.

    /work/venv/bin/python tools/bench_serving.py                 # ~2-3 min on 2 CPU cores
    /work/venv/bin/python tools/bench_serving.py --d_model 128 --n_layers 2 --rounds 2   # quick
    /work/venv/bin/python tools/bench_serving.py --profile_mock  # JetStream's own TestEngine in its Driver
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=8)
    p.add_argument("--n_kv_heads", type=int, default=4)
    p.add_argument("--d_ff", type=int, default=2048)
    p.add_argument("--max_len", type=int, default=512, help="KV cache length per slot")
    p.add_argument("--batch", type=int, default=16, help="slots = concurrent requests")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens_per_call", type=int, default=8, help="decode steps per engine generate call")
    p.add_argument("--profile_mock", action="store_true", help="time JetStream's TestEngine through its Driver")
    p.add_argument("--client", nargs=5, metavar=("URL", "BATCH", "PROMPT_LEN", "NEW", "STREAM"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- client (runs in its own process) -------------------------------------------------
def client_main(url, batch, prompt_len, new, stream):
    import asyncio

    import aiohttp
    import numpy as np

    async def one(s, i):
        prompt = [int(x) for x in np.random.RandomState(i).randint(0, 256, prompt_len)]
        body = {"model": "gyre", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                "stream": stream, "return_token_ids": True}
        hdr = {"X-Gyre-Run": "bench", "X-Gyre-Rollout": f"r{i}-{time.time_ns()}", "X-Gyre-Task": "t",
               "X-Gyre-Group": "g"}
        async with s.post(url + "/v1/completions", json=body, headers=hdr) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            if not stream:
                return len((await r.json())["choices"][0]["token_ids"])
            n = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    n += len(json.loads(line[6:])["choices"][0].get("token_ids", []))
            return n

    async def main():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(s, i) for i in range(batch)))
            return sum(counts), time.perf_counter() - t0

    tokens, wall = asyncio.run(main())
    print(json.dumps({"tokens": tokens, "wall_s": wall}))


def run_client(url, a, stream: bool) -> tuple[int, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", url, str(a.batch), str(a.prompt_len),
                          str(a.new_tokens), str(int(stream))], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["tokens"], r["wall_s"]


# ---- plain jitted decode loop ---------------------------------------------------------
def plain_tokens_per_s(cfg, params, a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gyre_jax.model import decode as D
    from gyre_jax.serving.sampling import sample_tokens

    s, m, n = a.batch, a.max_len, a.new_tokens
    cache = D.init_cache(cfg, s, m)
    prefill = jax.jit(lambda p, t: D.prefill(p, cfg, t)[1])
    insert = jax.jit(D.insert, donate_argnums=0)
    prompts = [np.random.RandomState(i).randint(0, 256, a.prompt_len).astype(np.int32) for i in range(s)]
    for i, pr in enumerate(prompts):
        cache = insert(cache, prefill(params, pr[:-1]), i)
    last = jnp.asarray([pr[-1] for pr in prompts], jnp.int32)
    temp, top_p = jnp.zeros((s,), jnp.float32), jnp.ones((s,), jnp.float32)
    seed = jnp.zeros((s,), jnp.int32)

    @jax.jit
    def loop(params, cache, tok):
        def body(i, carry):
            cache, tok, acc = carry
            logits, cache = D.decode_step(params, cfg, tok, cache)
            tok, lp = sample_tokens(logits, temp, top_p, seed, jnp.full((s,), i, jnp.int32))
            return cache, tok, acc + lp.sum()

        return jax.lax.fori_loop(0, n, body, (cache, tok, jnp.float32(0)))

    jax.block_until_ready(loop(params, cache, last))  # compile + warm-up
    times = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(params, cache, last))
        times.append(time.perf_counter() - t0)
    return s * n / statistics.median(times), statistics.median(times)


# ---- served ---------------------------------------------------------------------------
def served_tokens_per_s(cfg, params, a, workdir):
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.jetstream_backend import JetStreamBackend
    from gyre_jax.serving.proxy import Proxy, ProxyConfig
    from gyre_jax.serving.router import Router
    from gyre_jax.serving.server_thread import ServerThread
    from gyre_jax.serving.tokenizer import ByteTokenizer
    from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore

    store = TrajectoryStore(workdir, run_id="bench", config=StoreConfig(fsync="never"))
    engine = GyreEngine(cfg, params, max_slots=a.batch, max_len=a.max_len, name="cell0",
                        tokens_per_call=a.tokens_per_call)

    async def build():
        return Proxy(Router([JetStreamBackend(engine)]), ByteTokenizer(), store,
                     ProxyConfig(max_tokens_cap=a.max_len))

    st = ServerThread(build)
    url = st.start()
    out = {}
    try:
        for stream in (False, True):
            run_client(url, a, stream)  # warm-up: compiles every prefill bucket and the step
            rates = []
            for r in range(a.rounds):
                steps0, gen_s0 = engine.counters["generate_steps"], engine.counters["generate_s"]
                tokens, wall = run_client(url, a, stream)
                if tokens != a.batch * a.new_tokens:
                    raise RuntimeError(f"served {tokens} tokens, expected {a.batch * a.new_tokens}")
                steps = engine.counters["generate_steps"] - steps0
                rates.append(tokens / wall)
                print(f"  served {'stream' if stream else 'whole '} round {r}: {tokens} tokens in {wall:.2f}s = "
                      f"{tokens / wall:,.0f} tok/s ({steps} generate steps, "
                      f"{1e3 * (engine.counters['generate_s'] - gen_s0) / max(steps, 1):.2f} ms/step in generate())",
                      flush=True)
            out[stream] = statistics.median(rates)
        assert store.stats().calls == 2 * (a.rounds + 1) * a.batch
    finally:
        st.stop()
        store.close()
    return out[False], out[True]


def profile_mock():
    """JetStream's own TestEngine through its Driver: per-call engine time vs wall time."""
    import asyncio

    from gyre_jax.serving.jetstream_compat import orchestrator
    from jetstream.core.proto import jetstream_pb2
    from jetstream.engine import mock_engine

    calls = []

    class Timed(mock_engine.TestEngine):
        def _timed(self, name, fn, *a, **kw):
            import jax

            t = time.perf_counter()
            r = jax.block_until_ready(fn(*a, **kw))
            calls.append((name, time.perf_counter() - t))
            return r

        def prefill(self, **kw):
            return self._timed("prefill", super().prefill, **kw)

        def generate(self, params, ds):
            return self._timed("generate", super().generate, params, ds)

        def insert(self, p, ds, slot):
            return self._timed("insert", super().insert, p, ds, slot)

    eng = Timed(batch_size=8, cache_length=32, weight=2.0)
    params = eng.load_params()
    driver = orchestrator.Driver(prefill_engines=[eng], generate_engines=[eng], prefill_params=[params],
                                 generate_params=[params], interleaved_mode=True)
    orch = orchestrator.LLMOrchestrator(driver=driver)

    async def go():
        req = jetstream_pb2.DecodeRequest(max_tokens=4, text_content=jetstream_pb2.DecodeRequest.TextContent(text="AB"))
        return [r async for r in orch.Decode(req)]

    t0 = time.perf_counter()
    asyncio.run(go())
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    driver.stop()
    stop_s = time.perf_counter() - t1
    by = {}
    for k, v in calls:
        by.setdefault(k, []).append(v)
    engine_s = sum(v for _, v in calls)
    print(f"{'call':10s} {'n':>3s} {'total s':>8s}")
    for k, v in by.items():
        print(f"{k:10s} {len(v):3d} {sum(v):8.2f}")
    print(f"request wall {wall:.2f}s, engine calls {engine_s:.2f}s, orchestrator overhead {wall - engine_s:.3f}s, "
          f"Driver.stop() {stop_s:.2f}s")
    print(json.dumps({"mock_request_wall_s": round(wall, 3), "mock_engine_s": round(engine_s, 3),
                      "orchestrator_overhead_s": round(wall - engine_s, 3), "driver_stop_s": round(stop_s, 3)}))


def main(argv=None):
    a = parse_args(argv)
    if a.client:
        url, batch, pl, new, stream = a.client
        return client_main(url, int(batch), int(pl), int(new), bool(int(stream)))
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    if a.profile_mock:
        return profile_mock()
    import tempfile

    from gyre_jax.model import ModelConfig, count_params, init_params

    if a.prompt_len + a.new_tokens > a.max_len - 1:
        raise SystemExit(f"--prompt_len + --new_tokens must be < --max_len ({a.max_len})")
    cfg = ModelConfig(vocab_size=272, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                      n_kv_heads=a.n_kv_heads, head_dim=a.d_model // a.n_heads, d_ff=a.d_ff, max_seq_len=a.max_len)
    params = init_params(cfg, jax.random.key(0))
    print(f"model: {count_params(params) / 1e6:.1f}M params (d_model {cfg.d_model}, {cfg.n_layers} layers, "
          f"{cfg.n_heads}/{cfg.n_kv_heads} heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}); batch {a.batch} slots, "
          f"cache {a.max_len}, prompt {a.prompt_len}, {a.new_tokens} new tokens per request, "
          f"{a.tokens_per_call} decode steps per engine call; "
          f"{jax.devices()[0].platform} x{os.cpu_count()} cores", flush=True)
    plain, plain_s = plain_tokens_per_s(cfg, params, a)
    print(f"  plain fori_loop: {a.batch * a.new_tokens} tokens in {plain_s:.2f}s = {plain:,.0f} tok/s "
          f"({1e3 * plain_s / a.new_tokens:.2f} ms/step)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        whole, streamed = served_tokens_per_s(cfg, params, a, d)
    print(f"\n{'path':34s} {'tokens/s':>10s} {'vs plain':>9s}")
    print(f"{'plain jitted decode loop':34s} {plain:10,.0f} {1.0:9.2f}")
    print(f"{'proxy+orchestrator, whole':34s} {whole:10,.0f} {whole / plain:9.2f}")
    print(f"{'proxy+orchestrator, streamed SSE':34s} {streamed:10,.0f} {streamed / plain:9.2f}")
    print(json.dumps({"served_tokens_per_s": round(whole, 1), "plain_tokens_per_s": round(plain, 1),
                      "ratio": round(whole / plain, 3), "served_stream_tokens_per_s": round(streamed, 1),
                      "ratio_stream": round(streamed / plain, 3), "batch": a.batch, "new_tokens": a.new_tokens,
                      "tokens_per_call": a.tokens_per_call,
                      "params_m": round(count_params(params) / 1e6, 2)}))


if __name__ == "__main__":
    main()
