"""Benchmark: tokens/s served through the proxy + JetStream orchestrator, against a
plain jitted decode loop on the same model and batch.

Five ways of producing the same batch x new_tokens greedy tokens from the same
prompts (token ids of ``--prompt_len``, ``ignore_eos``):

  plain       the limit: prompts prefilled into the KV cache (same slots, same
              cache length), then ONE jitted ``lax.fori_loop`` over new_tokens steps
              of decode_step + the same sampler (token and log-prob); prefill not timed.
  engine API  GyreEngine's prefill / insert / generate from one Python loop (no
              JetStream threads): the cost of one jitted call per tokens_per_call steps.
  Driver      JetStreamBackend: the engine under JetStream's Driver threads, driven
              from asyncio, no HTTP.
  served      the recording proxy (aiohttp, loopback) -> router -> one cell, a client
              in a separate process (as a real harness would be) sending ``--batch``
              concurrent ``/v1/completions`` requests; every call is recorded into a
              TrajectoryStore. Whole responses, and streamed (SSE, one event per
              token). Wall time from first request to last response: prefill, HTTP
              and recording included.

Each way is warmed up once (compiles), then timed in ``--rounds`` interleaved
rounds (so load drift on a shared machine hits all alike); medians. Final line:
JSON with served_tokens_per_s (whole responses), plain_tokens_per_s, ratio, and
the other rows. Target: ratio >= 0.8.

Measured on 2 shared CPU cores (15.9M-param model, batch 16, 256 new tokens, load
~3): plain 447 tok/s; engine API 454 (1.01); Driver 393 (0.88); served whole 377
(0.84); streamed 473 (1.06, noise). With --tokens_per_call 1 every engine path
drops to ~0.53 of plain, the Python-loop one included: the loss is the
standalone per-step jitted call, not JetStream. On a tiny model (~1 ms/step) the
fixed per-request costs (16 prefill calls, HTTP) dominate: ratio ~0.3-0.5.

    python tools/bench_serving.py                 # ~5 min on 2 CPU cores
    python tools/bench_serving.py --d_model 128 --n_layers 2 --d_ff 512 --rounds 2   # smaller
    python tools/bench_serving.py --quick         # a smoke run: 2 slots of a 1-layer model, 8 tokens each
    python tools/bench_serving.py --profile_mock  # JetStream's own TestEngine in its Driver
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchkit  # noqa: E402 (tools/, beside this script)

QUICK = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_len=64, batch=2, prompt_len=8, new_tokens=8,
             rounds=1, tokens_per_call=4)


def parse_args(argv=None, bench=None):
    bench = bench or benchkit.Bench(__file__, __doc__, quick=QUICK)
    p = bench.parser
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
    return bench.parse(argv)


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
            with benchkit.Stopwatch() as sw:
                counts = await asyncio.gather(*(one(s, i) for i in range(batch)))
            return sum(counts), sw.s

    tokens, wall = asyncio.run(main())
    print(json.dumps({"tokens": tokens, "wall_s": wall}))


def run_client(url, a, stream: bool) -> tuple[int, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", url, str(a.batch), str(a.prompt_len),
                          str(a.new_tokens), str(int(stream))], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["tokens"], r["wall_s"]


# ---- the five ways of producing the same tokens ----------------------------------------
# Each is an object with warm() and run() -> seconds for batch x new_tokens tokens;
# main() times them interleaved, round by round, so load drift hits all alike.
def _prompts(a):
    import numpy as np

    return [np.random.RandomState(i).randint(0, 256, a.prompt_len).astype(np.int32) for i in range(a.batch)]


class Plain:
    """The limit: the same prompts in the same KV cache (same slots, same length),
    then lax.fori_loop over new_tokens steps of decode_step + the same sampler
    (token and log-prob), one jitted program; prefill not timed."""

    name = "plain jitted decode loop"

    def __init__(self, cfg, params, a):
        import jax
        import jax.numpy as jnp

        from gyre_jax.model import decode as D
        from gyre_jax.serving.sampling import sample_tokens

        s, n = a.batch, a.new_tokens
        cache = D.init_cache(cfg, s, a.max_len)
        prefill = jax.jit(lambda p, t: D.prefill(p, cfg, t)[1])
        insert = jax.jit(D.insert, donate_argnums=0)
        prompts = _prompts(a)
        for i, pr in enumerate(prompts):
            cache = insert(cache, prefill(params, pr[:-1]), i)
        self.args = (params, cache, jnp.asarray([pr[-1] for pr in prompts], jnp.int32))
        temp, top_p, seed = jnp.zeros((s,), jnp.float32), jnp.ones((s,), jnp.float32), jnp.zeros((s,), jnp.int32)

        @jax.jit
        def loop(params, cache, tok):
            def body(i, carry):
                cache, tok, acc = carry
                logits, cache = D.decode_step(params, cfg, tok, cache)
                tok, lp = sample_tokens(logits, temp, top_p, seed, jnp.full((s,), i, jnp.int32))
                return cache, tok, acc + lp.sum()

            return jax.lax.fori_loop(0, n, body, (cache, tok, jnp.float32(0)))

        self.loop, self.jax = loop, jax

    def warm(self):
        self.run()

    def run(self):
        return benchkit.timed(lambda: self.jax.block_until_ready(self.loop(*self.args)))[1]


class EngineApi:
    """GyreEngine's Engine API (prefill, insert, generate) from one Python loop:
    the cost of a jitted call per tokens_per_call steps, without JetStream's threads."""

    name = "engine API, one Python loop"

    def __init__(self, engine, a):
        self.e, self.a = engine, a

    def warm(self):
        self.run()

    def run(self):
        import jax

        from gyre_jax.serving.backend import SamplingParams
        from gyre_jax.serving.engine_state import PrefillInput

        e, a = self.e, self.a
        ds = e.init_decode_state()
        with benchkit.Stopwatch() as sw:
            for i, p in enumerate(_prompts(a)):
                inp = PrefillInput(f"api-{i}-{time.time_ns()}", p[:-1], int(p[-1]), 0,
                                   SamplingParams(max_tokens=a.new_tokens, temperature=0.0))
                ds = e.insert(e.prefill(params=e.params_ref, padded_tokens=inp, true_length=0), ds, i)
            for _ in range(-(-a.new_tokens // e.tokens_per_call)):
                ds, res = e.generate(e.params_ref, ds)
            jax.block_until_ready(res.data)
        return sw.s


class Driver:
    """JetStreamBackend (JetStream's Driver threads) driven from asyncio, no HTTP."""

    name = "JetStream Driver (no HTTP)"

    def __init__(self, engine, a):
        from gyre_jax.serving.jetstream_backend import JetStreamBackend

        self.b, self.a = JetStreamBackend(engine), a

    def warm(self):
        self.run()

    def run(self):
        import asyncio

        from gyre_jax.serving.backend import GenerateRequest, SamplingParams

        a = self.a

        async def go():
            sw = benchkit.Stopwatch.started()
            streams = [self.b.submit(GenerateRequest(request_id=f"drv-{i}-{time.time_ns()}", prompt_ids=p,
                                                     sampling=SamplingParams(max_tokens=a.new_tokens, temperature=0.0)))
                       for i, p in enumerate(_prompts(a))]

            async def drain(st):
                n = 0
                async for _ in st:
                    n += 1
                return n

            n = sum(await asyncio.gather(*(drain(st) for st in streams)))
            assert n == a.batch * a.new_tokens, n
            return sw.s

        return asyncio.run(go())

    def close(self):
        self.b._driver.stop()


class Served:
    """The recording proxy (aiohttp, loopback) -> router -> one cell; the client in
    its own process; every call recorded into a TrajectoryStore."""

    def __init__(self, engine, a, workdir, stream: bool, server=None):
        from gyre_jax.serving.jetstream_backend import JetStreamBackend
        from gyre_jax.serving.proxy import Proxy, ProxyConfig
        from gyre_jax.serving.router import Router
        from gyre_jax.serving.server_thread import ServerThread
        from gyre_jax.serving.tokenizer import ByteTokenizer
        from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore

        self.a, self.stream, self.engine = a, stream, engine
        self.name = "proxy+orchestrator, " + ("streamed SSE" if stream else "whole")
        if server is None:
            self.store = TrajectoryStore(workdir, run_id="bench", config=StoreConfig(fsync="never"))

            async def build():
                return Proxy(Router([JetStreamBackend(engine)]), ByteTokenizer(), self.store,
                             ProxyConfig(max_tokens_cap=a.max_len))

            server = ServerThread(build)
            server.start()
        self.server = server

    def warm(self):
        self.run()

    def run(self):
        steps0 = self.engine.counters["generate_steps"]
        tokens, wall = run_client(self.server.url, self.a, self.stream)
        if tokens != self.a.batch * self.a.new_tokens:
            raise RuntimeError(f"served {tokens} tokens, expected {self.a.batch * self.a.new_tokens}")
        self.steps = self.engine.counters["generate_steps"] - steps0
        return wall

    def close(self):
        if not self.stream:
            return
        self.server.stop()
        self.store.close()


def profile_mock(bench):
    """JetStream's own TestEngine through its Driver: per-call engine time vs wall time."""
    import asyncio

    from jetstream.core.proto import jetstream_pb2
    from jetstream.engine import mock_engine

    from gyre_jax.serving.jetstream_compat import orchestrator

    calls = []

    class Timed(mock_engine.TestEngine):
        def _timed(self, name, fn, *a, **kw):
            import jax

            t = time.perf_counter()
            r = jax.block_until_ready(fn(*a, **kw))
            calls.append((name, t, time.perf_counter()))
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
    t_end = time.perf_counter()
    wall = t_end - t0
    driver.stop()
    stop_s = time.perf_counter() - t_end
    by = {}
    for k, a_, b_ in calls:  # engine time inside the request's wall time only
        by.setdefault(k, []).append(max(0.0, min(b_, t_end) - max(a_, t0)))
    engine_s = sum(sum(v) for v in by.values())
    print(f"{'call':10s} {'n':>3s} {'s in request':>12s}")
    for k, v in by.items():
        print(f"{k:10s} {sum(x > 0 for x in v):3d} {sum(v):12.2f}")
    print(f"request wall {wall:.2f}s, engine calls {engine_s:.2f}s, orchestrator overhead {wall - engine_s:.3f}s, "
          f"Driver.stop() {stop_s:.2f}s")
    return bench.emit({"mock_request_wall_s": round(wall, 3), "mock_engine_s": round(engine_s, 3),
                       "orchestrator_overhead_s": round(wall - engine_s, 3), "driver_stop_s": round(stop_s, 3)},
                      sizes={"batch_size": 8, "cache_length": 32, "max_tokens": 4})


def main(argv=None):
    bench = benchkit.Bench(__file__, __doc__, quick=QUICK)
    a = parse_args(argv, bench)
    if a.client:
        url, batch, pl, new, stream = a.client
        return client_main(url, int(batch), int(pl), int(new), bool(int(stream)))
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    if a.profile_mock:
        return profile_mock(bench)
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
    from gyre_jax.serving.engine import GyreEngine

    def engine():  # engines with one config share their compiled programs
        return GyreEngine(cfg, params, max_slots=a.batch, max_len=a.max_len, tokens_per_call=a.tokens_per_call)

    tmp = tempfile.TemporaryDirectory()
    served_engine = engine()
    whole = Served(served_engine, a, tmp.name, stream=False)
    ways = [Plain(cfg, params, a), EngineApi(engine(), a), Driver(engine(), a), whole,
            Served(served_engine, a, tmp.name, stream=True, server=whole.server)]
    ways[-1].store = whole.store
    for w in ways:
        w.warm()  # compiles (every prefill bucket, the step)
    times = {w.name: [] for w in ways}
    try:
        for r in range(a.rounds):
            for w in ways:
                times[w.name].append(w.run())
                extra = f" ({w.steps} decode steps)" if isinstance(w, Served) else ""
                print(f"  round {r} {w.name:34s} {a.batch * a.new_tokens / times[w.name][-1]:10,.0f} tok/s{extra}",
                      flush=True)
    finally:
        for w in ways:
            if hasattr(w, "close"):
                w.close()
        tmp.cleanup()
    rate = {k: a.batch * a.new_tokens / benchkit.median(v) for k, v in times.items()}
    plain = rate[ways[0].name]
    print(f"\n{'path (median of ' + str(a.rounds) + ' rounds)':34s} {'tokens/s':>10s} {'vs plain':>9s}")
    for k, v in rate.items():
        print(f"{k:34s} {v:10,.0f} {v / plain:9.2f}")
    w_, s_ = rate[ways[3].name], rate[ways[4].name]
    return bench.emit({"served_tokens_per_s": round(w_, 1), "plain_tokens_per_s": round(plain, 1),
                      "ratio": round(w_ / plain, 3), "served_stream_tokens_per_s": round(s_, 1),
                      "ratio_stream": round(s_ / plain, 3), "engine_api_tokens_per_s": round(rate[ways[1].name], 1),
                      "driver_tokens_per_s": round(rate[ways[2].name], 1), "batch": a.batch,
                      "new_tokens": a.new_tokens, "tokens_per_call": a.tokens_per_call,
                      "params_m": round(count_params(params) / 1e6, 2)},
                     sizes=dict(d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                                d_ff=a.d_ff, max_len=a.max_len, batch=a.batch, prompt_len=a.prompt_len,
                                new_tokens=a.new_tokens, rounds=a.rounds, tokens_per_call=a.tokens_per_call))


if __name__ == "__main__":
    main()
