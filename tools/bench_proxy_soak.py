"""The recording proxy's memory under a long soak: does its RSS level off?

  python tools/bench_proxy_soak.py [--calls 20000] [--clients 32] [--calls-per-rollout 8]
  python tools/bench_proxy_soak.py --calls 4000 --tracemalloc 10   # also: top allocation growth
  python tools/bench_proxy_soak.py --backend engine --calls 4000 --every 500   # the real engine behind it

The server is its own process (so the RSS is the proxy's, not the clients'): the real Proxy
(aiohttp, 127.0.0.1) over a FakeBackend cell (a fast scripted model: the proxy's memory is
measured, not a model's) writing to a real TrajectoryStore in a temp dir. ``--backend engine``
puts the real serving stack there instead: a tiny random model in a GyreEngine (JetStream's
engine API, continuous batching, prefix cache, one slot per client) behind a JetStreamBackend,
so the RSS covers the engine, its driver threads and the recorded outputs as the RL job runs them. It takes commands on
stdin, as the RL job's rollout runner would act in the same process: ``issue`` a rollout key,
``finish`` a rollout (its outcome appended to the store, its key revoked), ``stats``.

``--clients`` concurrent clients (aiohttp) each run rollouts back to back: a rollout is
``--calls-per-rollout`` multi-turn chat calls with its secret key (prompts grow with the
conversation; every other call streams), then it finishes. Every ``--every`` calls the server's
RSS (/proc/PID/status VmRSS) and the sizes of its per-rollout structures are printed.

Prints a table, then ONE JSON line: calls, rollouts, clients, calls_per_rollout, rss_start_mb
(after a warm-up of --warmup calls), rss_end_mb, rss_slope_kb_per_1k_calls (least squares over
the second half), plateau (slope <= --plateau-kb), store_index_slope_kb_per_1k_calls (the
store's in-memory index, which by design grows with every record it holds: the deep size of its
Python objects at the end, per record, times 1,000; measured once, as walking it allocates),
plateau_besides_store_index (slope minus that <= --plateau-kb), calls_per_s, errors, the per-rollout
structures' sizes at the end (keys, registered, ledger, affinity, store_rollouts) and sizes (prompt
bytes, max_tokens). ``--tracemalloc N`` adds the N allocation sites that grew most over the
second half (Python objects only) to the table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

import benchkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUN = "soak"


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


# ---------------------------------------------------------------- server process
def deep_bytes(obj, seen=None) -> int:
    """Bytes of Python objects reachable from obj through containers and instance dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    n = sys.getsizeof(obj)
    if isinstance(obj, dict):
        n += sum(deep_bytes(k, seen) + deep_bytes(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        n += sum(deep_bytes(x, seen) for x in obj)
    elif hasattr(obj, "__dict__"):
        n += deep_bytes(vars(obj), seen)
    return n


async def _held(proxy) -> dict:  # read on the server's loop, where the structures change
    return proxy.held()


def _backend(kind: str, slots: int, max_len: int):
    from gyre_jax.testing.fake_backend import FakeBackend

    if kind == "fake":
        return FakeBackend("A", max_context=16384, capacity=64)
    import jax

    from gyre_jax.model import ModelConfig, init_params
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.jetstream_backend import JetStreamBackend

    jax.config.update("jax_num_cpu_devices", 1)
    cfg = ModelConfig(vocab_size=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                      max_seq_len=max_len)
    engine = GyreEngine(cfg, init_params(cfg, jax.random.key(0)), max_slots=slots, max_len=max_len, tokens_per_call=4)
    return JetStreamBackend(engine)


def serve(store_dir: str, trace: int, backend: str = "fake", slots: int = 32, max_len: int = 4096) -> None:
    import tracemalloc

    from gyre_jax.serving.proxy import Proxy, ProxyConfig
    from gyre_jax.serving.router import Router
    from gyre_jax.serving.server_thread import ServerThread
    from gyre_jax.serving.tokenizer import ByteTokenizer
    from gyre_jax.trajectory.records import RolloutOutcome
    from gyre_jax.trajectory.store import TrajectoryStore

    store = TrajectoryStore(store_dir, run_id=RUN)
    cell = _backend(backend, slots, max_len)

    async def build():
        return Proxy(Router([cell]), ByteTokenizer(), store,
                     ProxyConfig(auth_token="soak-token-" + os.urandom(8).hex(), require_binding=True))

    st = ServerThread(build)
    url = st.start()
    base = None
    print(json.dumps({"url": url}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "issue":  # rollout task group -> key
            out = {"key": st.proxy.issue(RUN, *args)}
        elif cmd == "finish":  # rollout task group key ncalls: what the rollout runner does at its end
            rid, task, group, key, n = args
            store.append(RolloutOutcome(run_id=RUN, rollout_id=rid, task_id=task, group_id=group, status="completed",
                                        score=1.0, t_end=time.time(), num_calls=int(n)))
            st.proxy.revoke(key)
            out = {}
        elif cmd == "stats":
            s = store.stats()
            out = {**st.run(_held(st.proxy)), "store_rollouts": s.rollouts, "store_calls": s.calls}
            if args == ["index"]:  # once, at the end: walking the index allocates, which would itself move RSS
                with store._lock:  # the store's in-memory index: by design one entry per record it holds
                    out["store_index_kb"] = round((deep_bytes(store._rollouts) + deep_bytes(store._outcome_order))
                                                  / 1024, 1)
        elif cmd == "trace_start" and trace:
            tracemalloc.start(4)
            base = tracemalloc.take_snapshot()
            out = {}
        elif cmd == "trace_top" and trace and base is not None:
            diff = tracemalloc.take_snapshot().compare_to(base, "traceback")
            out = {"top": [{"kb": round(d.size_diff / 1024, 1), "count": d.count_diff,
                            "where": " <- ".join(f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else os.path.basename(f.filename)}:{f.lineno}"
                                                 for f in reversed(d.traceback))}  # the allocating line first
                           for d in diff[:trace]]}
        else:
            out = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(out), flush=True)
    st.stop()
    store.close()


# ---------------------------------------------------------------- clients
class Server:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc, self._lock = proc, asyncio.Lock()

    async def ask(self, *words) -> dict:
        async with self._lock:  # one command at a time: its reply is the next line
            self.proc.stdin.write((" ".join(str(w) for w in words) + "\n").encode())
            await self.proc.stdin.drain()
            return json.loads(await self.proc.stdout.readline())


async def soak(a) -> dict:
    import aiohttp

    store_dir = tempfile.mkdtemp(prefix="gyre_soak_")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "--serve", store_dir, "--tracemalloc", str(a.tracemalloc),
        "--backend", a.backend, "--clients", str(a.clients), "--max-len", str(a.max_len),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 20)
    srv = Server(proc)
    url = json.loads(await proc.stdout.readline())["url"]
    system = "You are a coding agent. " + "Follow the repository's conventions. " * (a.prompt_bytes // 36)
    total = a.calls + a.warmup
    state = {"calls": 0, "rollouts": 0, "errors": 0, "first_error": None}
    rows: list[tuple[int, float, dict]] = []
    t_start = [0.0]
    next_mark = [a.warmup]

    async def mark():
        while state["calls"] >= next_mark[0]:
            n = next_mark[0]
            next_mark[0] += a.every
            if n == a.warmup:
                t_start[0] = time.perf_counter()
                if a.tracemalloc:
                    await srv.ask("trace_start")
            rss = rss_kb(proc.pid) / 1024
            st = await srv.ask("stats")
            rows.append((n - a.warmup, rss, st))
            print(f"{n - a.warmup:>8} {rss:>9.1f} {st['keys']:>6} {st['registered']:>10} {st['ledger']:>7} "
                  f"{st['affinity']:>8} {st['store_rollouts']:>9} {st['store_calls']:>10} {state['errors']:>6}", flush=True)

    async def client(s: aiohttp.ClientSession, c: int):
        while state["calls"] < total:
            i = state["rollouts"]
            state["rollouts"] += 1
            rid, task, group = f"r{i}", f"t{i % 97}", f"g{i // 8}"
            key = (await srv.ask("issue", rid, task, group))["key"]
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"task {task}: fix the bug"}]
            done = 0
            for k in range(a.calls_per_rollout):
                stream = k % 2 == 1
                body = {"model": "gyre", "messages": msgs, "max_tokens": a.max_tokens, "temperature": 1.0,
                        "seed": i * 100 + k, "stream": stream}
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    text = await r.text()
                state["calls"] += 1
                if r.status != 200:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or f"{r.status} {text[:300]}"
                    break
                done += 1
                if stream:
                    reply = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                                    for x in text.split("\n") if x.startswith("data: {"))
                else:
                    reply = json.loads(text)["choices"][0]["message"]["content"]
                msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"observation {k}: ok"}]
                await mark()
            await srv.ask("finish", rid, task, group, key, done)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(s, c) for c in range(a.clients)))
    wall = time.perf_counter() - t_start[0]
    top = (await srv.ask("trace_top"))["top"] if a.tracemalloc else []
    index = await srv.ask("stats", "index")
    proc.stdin.close()
    await proc.wait()
    import shutil
    shutil.rmtree(store_dir, ignore_errors=True)
    return {"rows": rows, "wall": wall, "top": top, "index": index, **state}


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(calls=64, warmup=16, every=32, clients=4, calls_per_rollout=4,
                                                        prompt_bytes=200))
    ap = bench.parser
    ap.add_argument("--calls", type=int, default=20000, help="measured calls (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1000, help="calls before the first RSS (imports, pools, caches)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--calls-per-rollout", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-bytes", type=int, default=2000, help="size of the system prompt")
    ap.add_argument("--every", type=int, default=1000, help="calls between RSS samples")
    ap.add_argument("--plateau-kb", type=float, default=64.0,
                    help="slope (KB per 1,000 calls) at or below which RSS counts as level")
    ap.add_argument("--tracemalloc", type=int, default=0, help="report the N allocation sites that grew most")
    ap.add_argument("--backend", choices=("fake", "engine"), default="fake",
                    help="fake: a scripted cell (the proxy alone); engine: a tiny real model in a GyreEngine")
    ap.add_argument("--max-len", type=int, default=4096, help="the engine's KV capacity per slot (tokens)")
    ap.add_argument("--serve", metavar="STORE_DIR", help=argparse.SUPPRESS)
    a = bench.parse(argv)
    if a.serve:
        serve(a.serve, a.tracemalloc, a.backend, a.clients, a.max_len)
        return {}
    need = a.prompt_bytes + 64 + a.calls_per_rollout * (a.max_tokens + 32)
    if a.backend == "engine" and need > a.max_len:
        ap.error(f"--max-len {a.max_len} is below a rollout's last prompt (~{need} byte tokens): raise it or "
                 f"lower --prompt-bytes / --calls-per-rollout")
    for f in ("calls", "clients", "calls_per_rollout", "max_tokens", "every"):
        if getattr(a, f) < 1:
            ap.error(f"--{f.replace('_', '-')} must be >= 1, got {getattr(a, f)}")
    print(f"{'calls':>8} {'rss_mb':>9} {'keys':>6} {'registered':>10} {'ledger':>7} {'affinity':>8} {'store_rol':>9} {'store_call':>10} {'errors':>6}")
    r = asyncio.run(soak(a))
    rows = r["rows"]
    n = np.array([x[0] for x in rows], float)
    rss = np.array([x[1] for x in rows], float)
    half = n >= n[-1] / 2

    def slope_kb(y):  # least squares over the second half, KB per 1,000 calls
        return float(np.polyfit(n[half] / 1000, y[half], 1)[0]) if half.sum() >= 2 else float("nan")

    slope = slope_kb(rss * 1024)
    # the index grows by one small entry per record (and per rollout): its bytes per record, per 1,000 calls
    index_slope = r["index"]["store_index_kb"] / max(1, r["index"]["store_calls"]) * 1000
    for t in r["top"]:
        print(f"  +{t['kb']:>9.1f} KB {t['count']:>+8} objects  {t['where']}")
    if r["first_error"]:
        print("first error:", r["first_error"])
    last = rows[-1][2]
    out = {"calls": int(n[-1]), "rollouts": r["rollouts"], "clients": a.clients, "calls_per_rollout": a.calls_per_rollout,
           "rss_start_mb": round(float(rss[0]), 1), "rss_end_mb": round(float(rss[-1]), 1),
           "rss_slope_kb_per_1k_calls": round(slope, 1), "plateau": bool(slope <= a.plateau_kb),
           "store_index_slope_kb_per_1k_calls": round(index_slope, 1),
           "plateau_besides_store_index": bool(slope - index_slope <= a.plateau_kb),
           "calls_per_s": round(n[-1] / r["wall"], 1), "errors": r["errors"],
           "keys": last["keys"], "registered": last["registered"], "ledger": last["ledger"],
           "affinity": last["affinity"], "store_rollouts": last["store_rollouts"],
           "backend": a.backend,
           "sizes": {"prompt_bytes": a.prompt_bytes, "max_tokens": a.max_tokens, "warmup": a.warmup,
                     **({"model": "272 vocab, d 64, 2 layers", "slots": a.clients, "max_len": a.max_len}
                        if a.backend == "engine" else {})}}
    return bench.emit(out)  # its own "sizes" field is the header's


if __name__ == "__main__":
    main()
