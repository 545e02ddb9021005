"""How near the roofline our steps run on this machine: train FLOP/s over matmul FLOP/s, decode bytes/s over memory bandwidth.

    python tools/bench_roofline.py                   # ~100M model, row 2048, engine at 1 and 32 live calls; ~6 min on 2 cores
    python tools/bench_roofline.py --peer=tunix      # also Tunix's Qwen3 of the same shape, in its own venv (--peer-python)
    python tools/bench_roofline.py --small           # a ~10M model, row 512: a quick look (not the issue's sizes)

Each figure is the median of ``--repeats`` timed runs after a warm-up. The machine is shared
and its load changes by the minute, so every timed run is paired with a peak measured just
before it and each fraction is the median of the pairs' fractions; the load average is
printed beside the figures.

* Peaks, measured here in the model's dtype: ``matmul_flops`` = 2 n^3 / time of one
  ``jnp.dot`` of two n x n matrices (``--matmul-n``, best of 3); ``memory_bw`` = the larger
  of a ``jnp.sum`` over a ``--bw-mib`` array (bytes read / time) and a copy ``x + 1``
  ((read + write) / time), best of 3 each.
* Train (a): the real jitted ``CellSteps.train_step`` (policy loss, AdamW update) on one
  device, one micro-batch of one causal row of ``--row-len`` tokens. FLOPs are counted,
  not measured: per token, forward = 2 x (matmul params per layer x layers + d_model x vocab)
  + 4 x layers x heads x head_dim x (L + 1) / 2 (QK^T and PV over the causal context);
  fwd + bwd = 3 x forward. The embedding gather, norms, softmax and the optimizer are not
  counted (they are work the roofline does not credit). ``train_fraction_of_matmul_peak`` =
  (FLOPs / step time) / matmul_flops.
* Decode (b): ``GyreEngine`` (JetStream Engine API: prefill, insert, generate; greedy,
  ``--tokens-per-call`` steps per call as the shipped configs use) with 1 and 32 live
  calls of ``--context`` tokens each. Bytes per decode step = all weights once + every live
  call's K and V over all layers at its current length. ``decode_fraction_of_memory_bw_S`` =
  (bytes per step / step time) / memory_bw. The model's own jitted ``decode_step`` loop (no
  engine, no sampler) is timed beside it, to tell model cost from engine cost. The ceiling:
  a step takes at least max(bytes / bw, FLOPs / matmul peak) (FLOPs: 2 x matmul params per
  live call + attention over its context), so ``decode_bw_fraction_ceiling_S`` = (bytes / bw)
  / (FLOPs / matmul peak), capped at 1, is the most the fraction can reach on this machine
  (at 32 calls in float32 on 2 CPU cores the step is compute-bound). CPU-ms per step (the
  process's CPU seconds, all threads) move little with the load: compare runs with those.
* Peer (``--peer=tunix``): Tunix's Qwen3 (``tunix.models.qwen3``) of the same shape and dtype,
  random weights, in its own venv (never a project dependency; tools/peer_tunix.py says how to
  make it and exactly what it times): its train step (value_and_grad of cross-entropy over a
  dense causal mask + optax AdamW, jitted) and its ``Sampler``'s jitted decode loop at the same
  batch sizes, KV cache sized for the run. The peer is a child process kept alive for the
  whole run: each of our timed runs is followed at once by the peer's same run, so both see
  the same load, and ``train_vs_peer`` (our train tokens/s over Tunix's) and
  ``decode_vs_peer_S`` are medians over those pairs; ``*_vs_peer_cpu*`` compare each process's
  CPU seconds instead (steadier on a loaded machine). Prefill and compile are timed on neither
  side. ``peer_error`` says what failed; the figures measured before it stay.

Prints a table, then ONE final JSON line. Goals (issue 30): train >= 0.5, decode_32 >= 0.5,
vs peer >= 1.0.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)
from benchkit import median  # noqa: E402

# ~100M parameters, Qwen3-shaped (qk-norm, GQA 12:4, tied embeddings, vocab 32K):
# 12 layers x 6.29M + 32768 x 768 embedding = 100.7M.
MODEL_100M = dict(vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=2048,
                  qk_norm=True, rope_theta=1e6)
MODEL_SMALL = dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024,
                   qk_norm=True, rope_theta=1e6)
MODEL_TINY = dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                  qk_norm=True, rope_theta=1e6)  # --quick: a smoke run


def _timed(fn) -> float:
    return benchkit.timed(fn)[1]


def matmul_sampler(n: int, dtype: str):
    """() -> FLOP/s of one ``jnp.dot`` of two n x n matrices (best of 3 back-to-back: a peak)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return lambda: 2.0 * n**3 / min(_timed(lambda: jax.block_until_ready(dot(a, b))) for _ in range(3))


def memory_sampler(mib: int, dtype: str):
    """() -> (read bytes/s of a sum, (read + write) bytes/s of a copy) over a ``mib`` MiB array (best of 3)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    x = jnp.ones((mib << 20) // dt.itemsize, dt)
    nbytes = x.size * dt.itemsize
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    copy = jax.jit(lambda a: a + jnp.ones((), a.dtype))
    jax.block_until_ready((total(x), copy(x)))

    def sample():
        t_read = min(_timed(lambda: jax.block_until_ready(total(x))) for _ in range(3))
        t_copy = min(_timed(lambda: jax.block_until_ready(copy(x))) for _ in range(3))
        return nbytes / t_read, 2 * nbytes / t_copy

    return sample


def measure_matmul_flops(n: int, dtype: str, repeats: int) -> float:
    sample = matmul_sampler(n, dtype)
    return median(sample() for _ in range(repeats))


def measure_memory_bw(mib: int, dtype: str, repeats: int) -> dict:
    """Bytes/s of a full read (sum) and of a copy (read + write): medians over ``repeats`` samples."""
    sample = memory_sampler(mib, dtype)
    got = [sample() for _ in range(repeats)]
    read, cp = median(g[0] for g in got), median(g[1] for g in got)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": cp, "bytes_per_s": max(read, cp)}


@dataclasses.dataclass(frozen=True)
class Paired:
    """Per-repeat timings of one work item: its seconds and CPU seconds, the peak measured just
    before it, and what ``beside`` (the peer's same run, if any) returned right after it."""

    ts: list[float]
    peaks: list[float]
    cpus: list[float]
    beside: list

    @property
    def t(self) -> float:
        return median(self.ts)

    @property
    def peak(self) -> float:
        return median(self.peaks)

    @property
    def inv(self) -> float:
        """Median of the per-pair peak-normalized work rate 1 / (t * peak)."""
        return median(1 / (t * p) for t, p in zip(self.ts, self.peaks))

    @property
    def cpu(self) -> float:
        return median(self.cpus)


def paired(peak_sample, work, repeats: int, beside=None) -> Paired:
    """Time ``work`` ``repeats`` times, each paired with a peak measured just before it.

    On a shared machine the load changes by the minute: each timing of the work is paired
    with a peak measured just before it, and the fraction is the median of the pairs. The
    process's CPU seconds (all its threads) barely move with the load: an A/B across runs
    at different loads compares those. ``beside`` (the peer's run of the same work) runs
    right after each timing, so a ratio to it is a median of pairs that saw the same load."""
    ts, peaks, cpus, other = [], [], [], []
    for _ in range(repeats):
        p = peak_sample()
        peaks.append(p)
        c0 = time.process_time()
        ts.append(_timed(work))
        cpus.append(time.process_time() - c0)
        if beside is not None:
            other.append(beside())
    return Paired(ts, peaks, cpus, other)


def train_flops_per_token(mc, row_len: int) -> dict:
    """Analytic FLOPs per trained token of one causal row (module docstring's formula)."""
    d, n, k, h, f, y = mc.d_model, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.d_ff, mc.n_layers
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    dense = 2 * (y * per_layer + d * mc.vocab_size)
    attn = 4 * y * n * h * (row_len + 1) / 2
    return {"matmul_params": y * per_layer + d * mc.vocab_size, "forward": dense + attn, "train": 3 * (dense + attn)}


def model_config(args):
    from gyre_jax.model import ModelConfig

    base = MODEL_TINY if args.quick else MODEL_SMALL if args.small else MODEL_100M
    max_len = max(args.row_len, args.context + args.decode_steps * args.tokens_per_call + 64)
    return ModelConfig(**base, dtype=args.dtype, param_dtype=args.dtype, max_seq_len=max_len)


def policy_row(mc, row_len: int, rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """One micro-batch of ``rows`` causal rows, every token trained (weights sum to 1)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, mc.vocab_size, (rows, row_len + 1)).astype(np.int32)
    shape = (rows, row_len)
    return {
        "tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones(shape, np.float32),
        "behavior_logprobs": np.full(shape, -np.log(mc.vocab_size), np.float32),
        "positions": np.broadcast_to(np.arange(row_len, dtype=np.int32), shape).copy(),
        "segment_ids": np.ones(shape, np.int32), "subtree_end": np.full(shape, row_len, np.int32),
        "target_version": np.zeros(shape, np.int32), "loss_weights": np.full(shape, 1.0 / (rows * row_len), np.float32),
        "advantages": rng.standard_normal(shape).astype(np.float32),
    }


def bench_train(mc, args, peak, peer=None) -> dict:
    """Median seconds of the real jitted train step (one micro-batch of one row); the peer's
    train step of the same row right after each of ours."""
    import jax

    from gyre_jax import cells
    from gyre_jax.cells.loss import policy_loss_fn
    from gyre_jax.cells.train_step import device_micro_batch
    from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig
    from gyre_jax.model import init_boxed, init_params, param_logical_axes

    opt = cells.OptimizerConfig(learning_rate=1e-4, weight_decay=0.01)
    spec = cells.StateSpec.create(functools.partial(init_boxed, mc), cells.make_optimizer(opt, param_logical_axes(mc)))
    steps = cells.CellSteps(spec, policy_loss_fn(mc, PolicyLossConfig()), cells.make_schedule(opt),
                            reductions=METRIC_REDUCTIONS)
    (cell,) = cells.split_cells(cells.CellConfig(cell_size=1), jax.devices()[:1])
    mesh = cell.train_mesh
    mb = device_micro_batch(policy_row(mc, args.row_len))
    batch = jax.device_put({k: v[None] for k, v in mb.items()})
    state = spec.state_from_params(init_params(mc, jax.random.key(0)), mesh)
    step = steps.train_step(mesh)
    (state, metrics), compile_s = benchkit.timed(lambda: jax.block_until_ready(step(state, batch)))
    box = [state]

    def run():
        box[0], m = step(box[0], batch)
        jax.block_until_ready(m)

    peer_setup = peer.ask(op="train_setup") if peer else None
    pr = paired(peak, run, args.repeats, beside=(lambda: peer.ask(op="train")) if peer_setup else None)
    return {"step_s": pr.t, "peak": pr.peak, "inv_t_peak": pr.inv, "compile_and_first_s": compile_s,
            "loss_finite": bool(np.isfinite(float(metrics["loss"]))), "cpu_s": pr.cpu,
            "peer": peer_vs(pr, args.row_len, peer_setup)}


def _param_bytes(params) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def decode_flops_per_step(mc, slots: int, mean_len: float) -> float:
    """Analytic FLOPs of one decode step: every live call's token through the matmuls (2 x matmul
    params) and its attention over its context (QK^T and PV: 4 x layers x heads x head_dim x len)."""
    matmul = train_flops_per_token(mc, 1)["matmul_params"]
    return slots * (2.0 * matmul + 4.0 * mc.n_layers * mc.n_heads * mc.head_dim * mean_len)


def kv_bytes_per_token(mc) -> int:
    import jax.numpy as jnp

    return 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * jnp.dtype(mc.jnp_dtype).itemsize


def bench_engine_decode(mc, params, slots: int, args, peak, peer=None) -> dict:
    """GyreEngine at ``slots`` live calls of ``--context`` tokens: median seconds per decode step;
    the peer's Sampler decode at the same batch right after each of our timed runs."""
    import jax

    from gyre_jax.serving.backend import SamplingParams
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.engine_state import PrefillInput

    tpc = args.tokens_per_call
    calls = 1 + args.repeats  # a warm-up call, then the timed ones
    max_len = args.context + calls * args.decode_steps * tpc + 8
    eng = GyreEngine(mc, params, max_slots=slots, max_len=max_len, tokens_per_call=tpc, prefill_chunk=4096)
    prompt = np.random.default_rng(1).integers(1, mc.vocab_size, args.context + 1).astype(np.int32)
    sp = SamplingParams(max_tokens=max_len, temperature=0.0)
    # One prefill, inserted into every slot (insert copies it; the prefix is not donated).
    pre = eng.prefill(params=eng.params_ref, padded_tokens=PrefillInput("p", prompt[:-1], int(prompt[-1]), 0, sp),
                      true_length=args.context)
    assert eng.pop_error("p") is None
    ds = eng.init_decode_state()
    for s in range(slots):
        ds = eng.insert(pre, ds, s)
    box = [ds]

    def run():  # decode_steps generate calls, as JetStream's generate thread makes them
        res = None
        for _ in range(args.decode_steps):
            box[0], res = eng.generate(eng.params_ref, box[0])
        jax.block_until_ready(res.data)

    warm_s = _timed(run)
    n = args.decode_steps * tpc
    peer_setup = peer.ask(op="decode_setup", slots=slots) if peer else None
    pr = paired(peak, run, args.repeats, beside=(lambda: peer.ask(op="decode", slots=slots)) if peer_setup else None)
    t, p, inv, cpu = pr.t, pr.peak, pr.inv, pr.cpu
    live = np.asarray(jax.device_get(box[0].active_S)).sum()
    # Mean live length over the timed calls: the context plus the tokens decoded so far.
    mean_len = args.context + (1 + (1 + args.repeats) / 2) * args.decode_steps * tpc
    return {"step_s": t / n, "peak": p, "inv_t_peak": inv * n, "cpu_s": cpu / n, "warm_s": warm_s, "live_at_end": int(live),
            "mean_len": mean_len, "cache_len": max_len, "peer": peer_vs(pr, slots * n, peer_setup)}


def bench_model_decode(mc, params, slots: int, args, peak) -> dict:
    """The model's own jitted decode_step loop (no engine, greedy argmax on device), over the
    per-layer params a server holds (model/unrolled.py): seconds per step."""
    import jax
    import jax.numpy as jnp

    from gyre_jax.model import decode
    from gyre_jax.model.unrolled import split_params

    params = split_params(mc, params)

    steps = args.decode_steps * args.tokens_per_call
    max_len = args.context + (1 + args.repeats) * steps + 8

    def loop(p, tok_S, cache):
        def body(carry, _):
            tok, c = carry
            logits, c = decode.decode_step(p, mc, tok, c)
            return (jnp.argmax(logits, -1).astype(jnp.int32), c), None

        (tok_S, cache), _ = jax.lax.scan(body, (tok_S, cache), None, length=steps)
        return tok_S, cache

    fn = jax.jit(loop, donate_argnums=2)
    cache = decode.init_cache(mc, slots, max_len)
    cache = cache.replace(lengths=jnp.full((slots,), args.context, jnp.int32))  # k/v values do not change the cost
    box = [jnp.ones((slots,), jnp.int32), cache]

    def run():
        box[0], box[1] = fn(params, box[0], box[1])
        jax.block_until_ready(box[0])

    run()
    pr = paired(peak, run, args.repeats)
    t, p, inv, cpu = pr.t, pr.peak, pr.inv, pr.cpu
    return {"step_s": t / steps, "peak": p, "inv_t_peak": inv * steps, "cpu_s": cpu / steps}


class PeerProcess:
    """The peer's side in its own venv (tools/peer_tunix.py, a child): one JSON request a line on
    its stdin, one JSON reply a line on its stdout, all within one deadline. A failed request is
    recorded in ``errors`` and answers None; a dead or late child answers None from then on."""

    def __init__(self, python: str, init: dict, deadline_s: float):
        self.errors: list[str] = []
        self.info: dict = {}
        self._deadline = time.monotonic() + deadline_s
        self._deadline_s = deadline_s
        self._buf = b""
        self._err = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None
        if not os.path.exists(python):
            self.errors.append(f"no python at --peer-python={python} (make the venv: see tools/peer_tunix.py)")
            return
        here = os.path.dirname(os.path.abspath(__file__))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([python, os.path.join(here, "peer_tunix.py"), json.dumps(init)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)
        self.info = self._reply("start") or {}

    def ask(self, **req) -> dict | None:
        if self.proc is None:
            return None
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._fail(f"{req['op']}: peer child gone")
        got = self._reply(req["op"])
        if got is not None and "error" in got:
            self.errors.append(f"{req['op']}: {got['error']}")
            return None
        return got

    def _reply(self, op: str) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return self._fail(f"{op}: timed out after --peer-timeout-s={self._deadline_s:.0f}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._err.seek(0)
                tail = (self._err.read().decode(errors="replace").strip().splitlines() or ["no stderr"])[-1]
                return self._fail(f"{op}: peer child exited ({tail})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line) if line.startswith(b"{") else self._reply(op)  # a library's stray print

    def _fail(self, why: str) -> None:
        self.errors.append(why)
        self.close()
        return None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def peer_vs(pr: Paired, our_tokens: int, setup: dict | None) -> dict:
    """Our tokens/s over the peer's, as the median over pairs (ours, then the peer's same run,
    under the same load): by wall time (``vs``) and by each process's CPU seconds (``vs_cpu``)."""
    pairs = [(t, c, b) for t, c, b in zip(pr.ts, pr.cpus, pr.beside) if b]
    if not pairs:
        return {}
    return {"setup": setup, "tokens_per_s": median(b["tokens"] / b["s"] for _, _, b in pairs),
            "vs": median((our_tokens / t) / (b["tokens"] / b["s"]) for t, _, b in pairs),
            "vs_cpu": median((our_tokens / c) / (b["tokens"] / b["cpu_s"]) for _, c, b in pairs),
            "pairs": len(pairs)}


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(row_len=64, context=16, slots="1,2", decode_steps=1,
                                                        tokens_per_call=2, repeats=1, matmul_n=64, bw_mib=1),
                           quick_help="a smoke run: a 1-layer model of d 32, rows of 64, matmul 64^2, 1 MiB")
    ap = bench.parser
    ap.add_argument("--small", action="store_true", help="a ~10M model (quick look; not the issue's sizes)")
    ap.add_argument("--dtype", default="float32", help="model params and activations, and the peaks' dtype")
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--context", type=int, default=512, help="tokens per live call before decoding")
    ap.add_argument("--slots", default="1,32", help="live calls to decode with (comma-separated)")
    ap.add_argument("--decode-steps", type=int, default=4, help="generate calls per timed run")
    ap.add_argument("--tokens-per-call", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul-n", type=int, default=4096)
    ap.add_argument("--bw-mib", type=int, default=512)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--peer", default="none", choices=("none", "tunix"))
    ap.add_argument("--peer-python", default="/work/venvs/peer/bin/python")
    ap.add_argument("--peer-timeout-s", type=float, default=3600,
                    help="the whole peer side (it runs beside ours: ~23 min at load 4-10 on 2 cores)")
    args = bench.parse(argv)
    args.slots = [int(s) for s in args.slots.split(",")]

    import jax

    from gyre_jax.model import count_params, init_params

    load0 = os.getloadavg()
    mc = model_config(args)
    params = init_params(mc, jax.random.key(0))
    n_params = count_params(params)
    mm = matmul_sampler(args.matmul_n, args.dtype)
    mem = memory_sampler(args.bw_mib, args.dtype)
    bw_peak = lambda: max(mem())  # noqa: E731 - the larger of read and copy: the stricter roofline
    out: dict = {"params": n_params, "dtype": args.dtype, "row_len": args.row_len, "context": args.context,
                 "tokens_per_call": args.tokens_per_call, "matmul_n": args.matmul_n}
    rows = []
    peer = None
    if args.peer != "none":
        shape = {k: getattr(mc, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                             "d_ff", "rope_theta", "norm_eps")}
        peer = PeerProcess(args.peer_python, {"shape": shape, "dtype": args.dtype, "row_len": args.row_len,
                                              "context": args.context, "slots": args.slots,
                                              "decode_steps": args.decode_steps * args.tokens_per_call},
                           args.peer_timeout_s)
        if peer.info:
            out.update(peer=f"tunix {peer.info['version']}", peer_jax=peer.info["jax"], peer_params=peer.info["params"])
    if not args.skip_train:
        fl = train_flops_per_token(mc, args.row_len)
        tr = bench_train(mc, args, mm, peer)
        step_flops = fl["train"] * args.row_len
        flops = step_flops / tr["step_s"]
        frac = step_flops * tr["inv_t_peak"]
        out.update(train_step_s=tr["step_s"], train_gflops=flops / 1e9, train_tokens_per_s=args.row_len / tr["step_s"],
                   train_fraction_of_matmul_peak=frac, train_matmul_gflops=tr["peak"] / 1e9,
                   train_flops_per_token=fl["train"], train_compile_s=tr["compile_and_first_s"])
        rows.append(("matmul peak", f"{tr['peak'] / 1e9:.1f} GFLOP/s", f"jnp.dot {args.matmul_n}^2 {args.dtype}, "
                     "median of the samples paired with the train steps"))
        rows.append(("train step", f"{flops / 1e9:.1f} GFLOP/s",
                     f"{tr['step_s']:.2f} s/step, {frac:.2f} of peak, compile+1st {tr['compile_and_first_s']:.0f} s, "
                     f"{tr['cpu_s']:.1f} CPU-s/step"))
        if tr["peer"]:
            pv = tr["peer"]
            out.update(train_vs_peer=pv["vs"], train_vs_peer_cpu=pv["vs_cpu"], peer_train_tokens_per_s=pv["tokens_per_s"],
                       peer_train_compile_s=pv["setup"]["compile_and_first_s"])
            rows.append(("peer train step", f"{pv['tokens_per_s'] * fl['train'] / 1e9:.1f} GFLOP/s",
                         f"ours/peer tokens/s {pv['vs']:.2f} (by CPU-s {pv['vs_cpu']:.2f}), {pv['pairs']} pairs"))
    w_bytes = _param_bytes(params)
    kvt = kv_bytes_per_token(mc)
    mm_peak = median(mm() for _ in range(3)) if args.slots else 0.0
    for s in args.slots:
        e = bench_engine_decode(mc, params, s, args, bw_peak, peer)
        m = bench_model_decode(mc, params, s, args, bw_peak)
        step_bytes = w_bytes + s * e["mean_len"] * kvt
        frac, mfrac = step_bytes * e["inv_t_peak"], step_bytes * m["inv_t_peak"]
        # The roofline's own ceiling here: a step can take no less than max(bytes / bw, flops / matmul
        # peak), so the fraction of bw cannot exceed (bytes / bw) / (flops / peak) once compute binds.
        step_flops = decode_flops_per_step(mc, s, e["mean_len"])
        ceiling = min(1.0, (step_bytes / e["peak"]) / (step_flops / mm_peak))
        out.update({f"decode_fraction_of_memory_bw_{s}": frac, f"decode_tokens_per_s_{s}": s / e["step_s"],
                    f"decode_step_ms_{s}": e["step_s"] * 1e3, f"memory_bw_gbps_{s}": e["peak"] / 1e9,
                    f"model_decode_fraction_of_memory_bw_{s}": mfrac,
                    f"model_decode_step_ms_{s}": m["step_s"] * 1e3, f"decode_bytes_per_step_{s}": step_bytes,
                    f"decode_live_at_end_{s}": e["live_at_end"], f"decode_flops_per_step_{s}": step_flops,
                    f"decode_bw_fraction_ceiling_{s}": ceiling, f"decode_cpu_ms_per_step_{s}": e["cpu_s"] * 1e3,
                    f"model_decode_cpu_ms_per_step_{s}": m["cpu_s"] * 1e3, "decode_matmul_gflops": mm_peak / 1e9})
        rows.append((f"memory bw (x{s})", f"{e['peak'] / 1e9:.1f} GB/s", "max(sum, copy), paired with the decode runs"))
        rows.append((f"engine decode x{s}", f"{step_bytes / e['step_s'] / 1e9:.2f} GB/s",
                     f"{e['step_s'] * 1e3:.1f} ms/step, {frac:.2f} of bw (ceiling {ceiling:.2f}: "
                     f"{step_flops / 1e9:.1f} GFLOP/step), {s / e['step_s']:.1f} tok/s, {e['cpu_s'] * 1e3:.0f} CPU-ms/step"))
        rows.append((f"model decode x{s}", f"{step_bytes / m['step_s'] / 1e9:.2f} GB/s",
                     f"{m['step_s'] * 1e3:.1f} ms/step, {mfrac:.2f} of bw (decode_step loop, no engine), "
                     f"{m['cpu_s'] * 1e3:.0f} CPU-ms/step"))
        if e["peer"]:
            pv = e["peer"]
            out.update({f"decode_vs_peer_{s}": pv["vs"], f"decode_vs_peer_cpu_{s}": pv["vs_cpu"],
                        f"peer_decode_tokens_per_s_{s}": pv["tokens_per_s"],
                        f"peer_decode_cache_size_{s}": pv["setup"]["cache_size"]})
            rows.append((f"peer decode x{s}", f"{pv['tokens_per_s']:.1f} tok/s",
                         f"ours/peer {pv['vs']:.2f} (by CPU-s {pv['vs_cpu']:.2f}), Sampler decode loop, "
                         f"cache {pv['setup']['cache_size']}, {pv['pairs']} pairs"))
        out.setdefault("load_avg_1m_during", []).append(round(os.getloadavg()[0], 2))
    if peer is not None:
        peer.close()
        if peer.errors:
            out["peer_error"] = "; ".join(peer.errors)
            rows.append(("peer", "failed", out["peer_error"]))
    load1 = os.getloadavg()
    out["load_avg_1m_before_after"] = [round(load0[0], 2), round(load1[0], 2)]
    out["sizes"] = {"summary": f"{n_params / 1e6:.1f}M params ({mc.n_layers}L d{mc.d_model} V{mc.vocab_size}), row "
                               f"{args.row_len}, decode ctx {args.context} x slots {args.slots}, {args.dtype}",
                    "params": n_params, "n_layers": mc.n_layers, "d_model": mc.d_model, "vocab": mc.vocab_size,
                    "row_len": args.row_len, "context": args.context, "slots": args.slots, "dtype": args.dtype,
                    "decode_steps": args.decode_steps, "tokens_per_call": args.tokens_per_call, "repeats": args.repeats}
    print(f"{'what':<20} {'rate':>14}  detail")
    for what, rate, detail in rows:
        print(f"{what:<20} {rate:>14}  {detail}")
    print(f"load average (1 min) before/after: {out['load_avg_1m_before_after']}")
    return bench.emit(out)  # its "sizes" field is the header's


if __name__ == "__main__":
    main()
