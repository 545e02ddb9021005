"""A cell's GyreEngine served through JetStream's orchestrator (``Driver``).

The Driver runs JetStream's four threads per engine (prefill, transfer, generate,
detokenize) and its queues, unchanged. One documented hook: ``GyreDriver``
overrides ``_process_prefill_content`` so the prefill thread hands GyreEngine our
``PrefillInput`` (tokens, sampling parameters, a KV block to reuse) instead of
padded token ids; the Driver passes it through untouched as ``padded_tokens``.
Requests are placed with ``place_request_on_prefill_queue`` (the same call
JetStream's gRPC ``LLMOrchestrator.Decode`` makes) and their tokens come back on
the request's ``AsyncMultifuture`` return channel.

We run in interleaved mode (prefill and generate share the cell's devices).

Profiling notes (2 CPU cores; ``tools/bench_serving.py``, ``--profile_mock``).
* The 22.8 s for one 4-token request was JetStream's ``TestEngine``, not the
  orchestrator: it runs a 4096x4096 float32 matmul inside every prefill and
  generate call (simulated model time). Timing each engine call inside the
  Driver: prefill 4.3 s + insert 0.1 s + 5 generate calls 28.1 s = all of the
  32.5 s wall time; the orchestrator added ~0. (5 generate calls for 4 tokens:
  the detokenize thread closes a request one step late, on ``lengths >
  max_tokens``.) ``Driver.stop()`` took 10 s: it waits for the generate call in
  progress and for ``queue.get(timeout=1.0)``.
* With GyreEngine, what did cost, and the fix:
  - a per-request jit recompile of insert (0.5-0.9 s each): the Prefix pytree
    carried the request id as static data -> insert takes arrays only;
  - staggered starts: interleaved mode holds decoding while the prefill *queue*
    is non-empty, not while the prefill thread computes the request it just
    took, so a burst of N requests started N decode calls apart -> GyreEngine
    pauses decoding (no compute, held markers) while prefills are pending and
    slots are free (``max_decode_pause_s``);
  - Python work per generate call on four threads (generate, detokenize, the
    event loop, HTTP) sharing the GIL, ~1-2 ms, and a standalone jitted decode
    step being ~2x slower than one inside a fused loop on CPU (the KV cache is
    copied in and out of the call) -> ``tokens_per_call`` steps per call (one
    jitted scan; JetStream reads them as speculative tokens);
  - run-ahead: the generate thread queues up to 8 calls (its detokenize backlog)
    ahead of the device, so commands (export, release) waited behind them and
    finished slots kept decoding -> at most 2 calls in flight, and no decode at
    all while no slot is generating;
  - JetStream's detokenize thread SIGKILLs the process when writing to a return
    channel raises (e.g. after the event loop closed) -> ``_Channel`` drops writes
    once its stream has ended or its loop is gone;
  - the root logger set to DEBUG with a stdout handler at import (two log lines
    per step from two threads) -> undone in jetstream_compat.
  We end a call's stream at its final token (stop id or max_tokens), not when
  JetStream closes the channel.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time

import numpy as np

from gyre_jax.serving.backend import Backend, EngineError, GenerateRequest, ResumeState, TokenEvent, TokenStream
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.engine_state import ExportedSlot, KVBlock, PrefillInput, decode_result_steps
from gyre_jax.serving.jetstream_compat import async_multifuture, orchestrator

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GyreActiveRequest(orchestrator.ActiveRequest):
    gyre_input: PrefillInput | None = None


class _Channel(async_multifuture.AsyncMultifuture):
    """JetStream's return channel, made safe to outlive its consumer.

    JetStream's detokenize thread keeps writing to a request's channel while its
    slot is held (after our stream has ended), and it SIGKILLs the process if a
    write raises, e.g. because the event loop has closed. Once ``detach`` is
    called (the stream has its final token) writes are dropped, and writes after
    the loop closed are dropped too.
    """

    def __init__(self):
        super().__init__()
        self.detached = False

    def add_result(self, result) -> None:
        if self.detached or self._loop.is_closed():
            return
        try:
            super().add_result(result)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def set_exception(self, exception) -> None:
        if self.detached or self._loop.is_closed():
            return
        try:
            super().set_exception(exception)
        except RuntimeError:
            pass

    def wake(self) -> None:
        """End a consumer's wait on this channel even though it is detached.

        A stream ended from outside its own ``__anext__`` (an export before the request
        reached a slot) detaches the channel, so JetStream's later close is dropped; a
        consumer already awaiting the channel would then wait forever (the elastic demo
        saw a call hang until its rollout's deadline, and a drain never return)."""
        if self._loop.is_closed():
            return
        try:
            super().set_exception(StopAsyncIteration())
        except RuntimeError:
            pass


class GyreDriver(orchestrator.Driver):
    def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
        if isinstance(request, GyreActiveRequest) and request.gyre_input is not None:
            return request.gyre_input, len(request.gyre_input.tokens)
        return super()._process_prefill_content(request, tokenizer, is_bos, max_prefill_length)


def replay_rows(prompt_len: int, output_routing: np.ndarray) -> np.ndarray:
    """Routing to replay over a resumed call's seq[:-1] (prompt + outputs but the last), int32
    [P + G - 1, R]: output token j was sampled by the decode step whose input sat at position
    P - 1 + j (the last prompt token, then each output but the last), so those G positions replay
    the G recorded rows; the prompt before them was prefilled and is routed live (-1) again."""
    g, width = output_routing.shape
    out = np.full((prompt_len + g - 1, width), -1, np.int32)
    out[prompt_len - 1:] = output_routing
    return out


class _Stream(TokenStream):
    def __init__(self, backend: "JetStreamBackend", req: GenerateRequest, channel, engine_id: str):
        self.request_id = req.request_id
        # The engine's name for this attempt. A call that moves away and back to this cell
        # keeps its request id; a fresh engine id keeps the earlier attempt's leftovers
        # (a cancel mark waiting for its dead prefill, a stale slot owner) off the new one.
        self.engine_id = engine_id
        self._b, self._req, self._ch = backend, req, channel
        r = req.resume
        self.tokens: list[int] = [] if r is None else [int(t) for t in r.output_ids]
        self.logprobs: list[float] = [] if r is None else [float(x) for x in r.output_logprobs]
        # per token: its recorded experts (an MoE engine), for a move that recomputes the cache elsewhere
        self.routing: list = ([None] * len(self.tokens) if r is None or r.output_routing is None
                              else list(r.output_routing))
        self._pending: collections.deque[TokenEvent] = collections.deque()
        self._stop = set(req.sampling.stop_ids)
        self._detach: str | None = None  # "export" | "recompute" | "cancel"
        self._exported: ExportedSlot | None = None
        self._settled = asyncio.Event()  # export() has learnt what the engine did
        self._inherited_kv = None if r is None else r.kv  # passed on if we never reached a slot
        self.finish = None
        self.resume = None

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self.finish is not None:
                raise StopAsyncIteration
            try:
                samples = await self._ch.__anext__()
            except StopAsyncIteration:
                await self._closed()
                continue
            if self.finish is not None:  # cancelled meanwhile: drop the rest
                continue
            for tok, lp, routing in decode_result_steps(samples[0].token_ids, self._b.engine.result_layout):
                self.tokens.append(tok)
                self.logprobs.append(lp)
                self.routing.append(routing)
                self._pending.append(TokenEvent(tok, lp, routing))
                if tok in self._stop or len(self.tokens) >= self._req.sampling.max_tokens:
                    self._end("stop" if tok in self._stop else "length")
                    break
        return self._pending.popleft()

    async def _closed(self):
        """JetStream closed the return channel: the engine stopped this request."""
        if self._detach == "export":
            await self._settled.wait()
        err = self._b.engine.pop_error(self.engine_id)
        if err is not None:
            self._end("error")
            raise EngineError(f"{self._b.name}: {err}")
        if self._detach == "export" and self._exported is not None:
            if self._exported.generated != len(self.tokens):
                self._end("error")
                raise EngineError(f"{self._b.name}: exported state has {self._exported.generated} tokens, "
                                  f"stream delivered {len(self.tokens)}")
            self._end("moved", kv=self._exported.kv)
        elif self._detach == "recompute":
            self._end("moved")
        else:
            self._end("length")  # the engine stopped it: context full

    def _end(self, finish: str, kv=None) -> None:
        if self.finish is not None:
            return
        self.finish = finish
        self._ch.detached = True  # nothing more to read (a held slot only reports markers)
        self._ch.wake()  # a consumer waiting on the channel sees the end (no-op for one that is not)
        self._b.forget(self)
        if finish == "moved":
            routed = bool(self.routing) and all(r is not None for r in self.routing)
            self.resume = ResumeState(prompt_ids=self._req.prompt_ids, output_ids=np.asarray(self.tokens, np.int32),
                                      output_logprobs=np.asarray(self.logprobs, np.float32), kv=kv,
                                      source=self._b.name, output_routing=np.stack(self.routing) if routed else None)
        elif finish in ("stop", "length"):
            self._b.release_call(self._req, self.tokens, self.engine_id)

    # ---- the backend's side (cancel, export): what it learns and decides about this stream ----
    end = _end

    @property
    def detached(self) -> bool:
        """The backend has cancelled, exported or recomputed it (or is doing so)."""
        return self._detach is not None

    def detach(self, how: str | None) -> None:
        """"cancel" | "export" | "recompute", or None: an export that found it finished on its own."""
        self._detach = how

    @property
    def inherited_kv(self):
        """The k/v it arrived with (passed on if it never reached a slot here)."""
        return self._inherited_kv

    def settle(self) -> None:
        """The export has learnt what the engine did (``_closed`` may read the result now)."""
        self._settled.set()

    def exported_as(self, exported: ExportedSlot) -> None:
        self._exported = exported


class JetStreamBackend(Backend):
    """``Backend`` over one GyreEngine and its JetStream Driver (one cell)."""

    def __init__(self, engine: GyreEngine, *, name: str | None = None, prefix_cache_entries: int = 64,
                 min_cached_prefix: int = 16, prefix_cache_bytes: int | None = None):
        """prefix_cache_bytes: also evict least-recently-used prefixes while their k/v exceed
        this many bytes (long contexts: one 128K-token prefix can be GiBs); None = entries only."""
        self.engine = engine
        self.name = name or engine.name
        self.max_context = engine.max_len - 1  # one cache entry stays spare (engine.py)
        self.capacity = engine.max_concurrent_decodes
        self.vocab_size = engine.config.vocab_size
        ref = engine.params_ref
        self._driver = GyreDriver(prefill_engines=[engine], generate_engines=[engine], prefill_params=[ref],
                                  generate_params=[ref], interleaved_mode=True)
        slots_q = self._driver._generate_slots[0]  # JetStream's free-slot queue for this engine
        engine.free_slots = slots_q.qsize
        self._live: dict[str, _Stream] = {}
        self._attempts = itertools.count()  # engine ids: one per submission (see _Stream.engine_id)
        # cache_key -> (policy version, tokens whose k/v the block holds, KVBlock); LRU. A
        # block is only reused under the weights that computed it.
        self._cache: collections.OrderedDict[str, tuple[int, np.ndarray, KVBlock]] = collections.OrderedDict()
        self._cache_entries, self._min_cached = prefix_cache_entries, min_cached_prefix
        self._cache_bytes_limit = prefix_cache_bytes
        # A paged engine keeps finished calls' pages (prompt and answer) in its own page prefix cache:
        # a block copied out here as well would hold the same k/v twice.
        self._paged = engine.kv_cache == "paged"
        self._counts: collections.Counter[str] = collections.Counter()
        self._pending: set[asyncio.Future] = set()
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self.engine.params_ref.version

    def num_active(self) -> int:
        return len(self._live)

    def submit(self, request: GenerateRequest) -> TokenStream:
        if self._closed:
            raise EngineError(f"{self.name}: backend is closed")
        sp, prompt = request.sampling, request.prompt_ids
        if prompt.shape[0] + sp.max_tokens > self.max_context:
            raise ValueError(f"prompt ({prompt.shape[0]} tokens) + max_tokens ({sp.max_tokens}) exceeds the context "
                             f"limit of {self.max_context} tokens")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already running on {self.name}")
        r = request.resume
        seq = prompt if r is None else np.concatenate([prompt, r.output_ids.astype(np.int32)])
        engine_id = f"{request.request_id}#{next(self._attempts)}"
        inp = PrefillInput(engine_id, seq[:-1], int(seq[-1]), 0 if r is None else r.num_generated, sp)
        if r is not None and r.kv is not None:
            inp.kv, inp.kv_origin = r.kv, "moved"
        elif request.cache_key and not self._paged:  # a paged engine finds cached pages by content itself
            inp.kv = self._lookup(request.cache_key, seq[:-1])
        if r is not None and r.kv is None and r.output_routing is not None and r.num_generated:
            inp.routing = replay_rows(prompt.shape[0], r.output_routing)
        channel = _Channel()
        stream = _Stream(self, request, channel, engine_id)
        self._live[request.request_id] = stream
        active = GyreActiveRequest(max_tokens=sp.max_tokens, return_channel=channel, prefill_content=[],
                                   is_client_side_tokenization=True, gyre_input=inp)
        self._driver.place_request_on_prefill_queue(active)
        self._counts["submitted"] += 1
        return stream

    def cancel(self, request_id: str) -> None:
        stream = self._live.get(request_id)
        if stream is None or stream.detached:
            return
        stream.detach("cancel")
        stream.end("cancelled")  # the consumer is gone: stop counting it now
        self.engine.detach(stream.engine_id, export=False)

    async def export(self, request_id: str) -> bool:
        """Stop the call here at a token boundary; True if its stream will end "moved"."""
        stream = self._live.get(request_id)
        if stream is None or stream.detached:
            return False
        stream.detach("export")
        fut = self.engine.detach(stream.engine_id, export=True)
        if fut is None:  # never reached a slot: nothing computed here to move
            stream.end("moved", kv=stream.inherited_kv)
            stream.settle()
            self._counts["exported_unstarted"] += 1
            return True
        try:
            exported = await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - export failed: stop here, the router recomputes elsewhere
            log.exception("%s: export of %s failed; falling back to recompute", self.name, request_id)
            self._counts["export_failed"] += 1
            stream.detach("recompute")
            if self.engine.detach(stream.engine_id, export=False) is None:
                stream.end("moved")
            return True
        finally:
            stream.settle()
        if exported is None:  # finished on its own; its stream ends stop/length
            stream.detach(None)
            return False
        stream.exported_as(exported)  # before we yield: _closed reads it once it wakes
        self._counts["exported"] += 1
        return True

    # ---- prefix cache (multi-turn calls of one agent reuse their KV) ----------------
    def forget(self, stream: _Stream) -> None:
        """An ended stream is no longer live here (unless a new attempt took its request id)."""
        if self._live.get(stream.request_id) is stream:
            del self._live[stream.request_id]

    def release_call(self, req: GenerateRequest, tokens: list[int], engine_id: str) -> None:
        """Free the finished call's held slot, keeping its KV if it has a cache key: here as a
        copied block, or for a paged engine as its pages (any call's, keyed by their tokens)."""
        seq = np.concatenate([req.prompt_ids, np.asarray(tokens, np.int32)])
        if self._paged:
            fut = self.engine.release(engine_id, snapshot=False, tokens=seq)
        else:
            fut = self.engine.release(engine_id, snapshot=bool(req.cache_key))
        if fut is None or not req.cache_key:
            return
        version = self.policy_version  # publish() happens between drain and admit, never mid-call
        afut = asyncio.wrap_future(fut)
        self._pending.add(afut)  # settle() waits for it: the pages or the block are in a cache then

        def done(f):
            self._pending.discard(f)
            if self._paged:
                return
            if not f.cancelled() and f.exception() is None and f.result() is not None:
                kv = f.result().kv
                self._store(req.cache_key, version, seq[: kv.length], kv)

        afut.add_done_callback(done)

    async def settle(self) -> None:
        """Wait until every finished call's KV is in the prefix cache (tests, benchmarks)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def _store(self, key: str, version: int, seq: np.ndarray, kv: KVBlock) -> None:
        self._cache[key] = (version, seq, kv)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_entries or (
            self._cache_bytes_limit is not None and len(self._cache) > 1
            and self.prefix_cache_bytes() > self._cache_bytes_limit
        ):
            self._cache.popitem(last=False)
            self._counts["prefix_cache_evicted"] += 1

    def prefix_cache_bytes(self) -> int:
        """Bytes of k/v the prefix cache holds now."""
        return sum(int(kv.k.nbytes) + int(kv.v.nbytes) for _, _, kv in self._cache.values())

    def _lookup(self, key: str, needed: np.ndarray) -> KVBlock | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        version, seq, kv = hit
        if version != self.policy_version:  # computed by older weights
            del self._cache[key]
            self._counts["prefix_cache_stale"] += 1
            return None
        n = min(seq.shape[0], needed.shape[0], kv.length)
        same = np.flatnonzero(seq[:n] != needed[:n])
        c = int(same[0]) if same.shape[0] else n
        if c < self._min_cached:
            self._counts["prefix_cache_miss"] += 1
            return None
        self._counts["prefix_cache_hit"] += 1
        self._cache.move_to_end(key)
        return KVBlock(kv.k, kv.v, c)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.engine.counters.items()}
        out.update({k: float(v) for k, v in self._counts.items()})
        out["active"] = float(len(self._live))
        out["policy_version"] = float(self.policy_version)
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, self._driver.stop)
        log.debug("%s: driver stopped in %.2fs", self.name, time.perf_counter() - t0)
