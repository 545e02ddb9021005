"""GyreEngine: our model as a JetStream ``engine_api.Engine``.

JetStream's contract: ``prefill`` computes a request's KV ("Prefix"), ``insert``
puts it into a slot of the batched decode state, ``generate`` advances every
slot by one token. This engine adds, without leaving that contract:

* per-request sampling (greedy / temperature / top-p, seed), stop ids and
  max_tokens, all kept per slot in the decode state (sampling.py);
* the behavior log-prob of every sampled token. JetStream's ResultTokens only
  carries token ids, so each slot reports two int32 columns, [token id,
  float32 bits of -|logprob|], which JetStream forwards as two "speculative"
  tokens; the bits are always negative, so they never collide with a token id
  (``decode_result_pairs`` unpacks them). An MoE model adds each token's routing
  (the experts of every MoE layer at the step that sampled it) as more columns
  beside it, for routing replay in training (engine_state.RoutingLayout). Stop ids are handled here (JetStream's
  tokenizer stop set is empty), so the stop token itself is emitted and recorded:
  the policy must learn to produce it.
* prefix reuse and KV moves: ``prefill`` accepts a ``PrefillInput`` (through the
  padded_tokens argument; see jetstream_backend.GyreDriver) whose ``kv`` block
  holds already computed k/v of the first ``kv.length`` tokens (a cached prefix
  of the same conversation, or a live call exported from another cell); only the
  remaining tokens are run through the model. ``prefill_tokens`` counts exactly
  the tokens that were.
* commands from other threads (export / release / stop a request's slot) are
  queued and executed on JetStream's generate thread at the start of the next
  ``insert`` or ``generate``, the only thread that owns the decode state.
* exceptions never escape into JetStream's threads (its JetThread SIGKILLs the
  process): a failing prefill fails that request only, a failing step fails the
  requests then in the batch; ``pop_error`` reports them to the backend.

Held slots: JetStream frees a slot one step after it reports an invalid token.
A request that ends by a stop id or max_tokens instead stays "held": its slot
reports the marker HELD_MARK (valid, skipped by the backend) each step until the
backend sends ``release`` (optionally copying the KV out for its prefix cache
first). The generate thread is therefore still stepping when the release comes,
so the copy is taken at once and never races a new request into the slot.

Slot convention: a slot holds the KV of seq[:-1] (seq = prompt + tokens generated
so far) and feeds seq[-1] at the next step, so the first generated token and its
log-prob come out of ``generate`` like every other one.

Throughput on a host with few cores (jetstream_backend has the measurements): a
``generate`` call runs ``tokens_per_call`` decode steps in one jitted scan; it
does not decode while requests being prefilled can still join the batch, nor
while no slot is generating; at most MAX_INFLIGHT_CALLS calls run ahead of the
device. The device functions and state layout are in engine_state.py. Where the slots' KV
lives is the engine's KV layout (kv_layout.py: ``self.kv``, contiguous or paged; the paged
one's admission by pages and prefix pages in kv_paged.py), called through one small interface.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from gyre_jax.cells.frozen_base import Adapted
from gyre_jax.model import ModelConfig, param_logical_axes
from gyre_jax.model import decode as mdecode
from gyre_jax.model.unrolled import LayerParams, layer_sharding, split_params
from gyre_jax.serving.backend import MAX_STOP_IDS, SamplingParams
from gyre_jax.serving.engine_state import (
    DecodeState,
    ExportedSlot,
    KVBlock,
    PrefillInput,
    Prefix,
    RoutingLayout,
    device_fns,
    expert_parallel,
)
from gyre_jax.serving.jetstream_compat import engine_api, tokenizer_api, tokenizer_pb2
from gyre_jax.serving.kv_layout import ContiguousKV, EngineHooks, KVLayout, plan_kv
from gyre_jax.serving.kv_paged import PagedKV
from gyre_jax.serving.lora_weights import LoraWeights
from gyre_jax.serving.pages import PrefixPages
from gyre_jax.sharding import tree_shardings

log = logging.getLogger(__name__)
MIN_BUCKET = 16
MAX_INFLIGHT_CALLS = 2  # decode calls dispatched ahead of the device


def kv_layout_for(pages: tuple[int, int] | None, hooks: EngineHooks, *, max_slots: int, max_len: int,
                  tokens_per_call: int) -> KVLayout:
    """The layout ``plan_kv`` planned: ContiguousKV for None, else PagedKV over that pool."""
    if pages is None:
        return ContiguousKV(hooks)
    return PagedKV(hooks, num_pages=pages[0], page_size=pages[1], max_slots=max_slots, max_len=max_len,
                   tokens_per_call=tokens_per_call)


def _pad_routing(routing_TxR: np.ndarray, length: int) -> np.ndarray:
    """Recorded routing for a bucket of ``length`` tokens: padding tokens are routed live (-1)."""
    out = np.full((length, routing_TxR.shape[1]), -1, np.int32)
    out[: routing_TxR.shape[0]] = routing_TxR
    return out


class ParamsRef:
    """What JetStream's Driver holds as "params": its threads read the params once
    at start, so weight publication swaps ``value`` here instead."""

    def __init__(self, value, version: int = 0):
        self.value, self.version = value, version


class _JetStreamTokenizer(tokenizer_api.Tokenizer):
    """What JetStream's threads ask for. We submit token ids (client-side
    tokenization), so only the id properties matter; stop ids are ours."""

    def __init__(self, bos_id: int, eos_id: int, pad_id: int):
        self._bos, self._eos, self._pad = bos_id, eos_id, pad_id

    def encode(self, s: str, **kwargs):
        ids = np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.int32)
        return ids, int(ids.shape[0])

    def decode(self, token_ids, **kwargs) -> str:
        return bytes(int(t) for t in token_ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    @property
    def pad_id(self):
        return self._pad

    @property
    def eos_id(self):
        return self._eos

    @property
    def bos_id(self):
        return self._bos

    @property
    def stop_tokens(self) -> set[int]:
        return set()


def _check_sizes(config: ModelConfig, max_slots: int, max_len: int, tokens_per_call: int, prefill_chunk: int) -> None:
    if max_slots < 1:
        raise ValueError(f"GyreEngine.max_slots must be >= 1, got {max_slots}")
    if tokens_per_call < 1:
        raise ValueError(f"GyreEngine.tokens_per_call must be >= 1, got {tokens_per_call}")
    if not 2 <= max_len <= config.max_seq_len:
        raise ValueError(f"GyreEngine.max_len={max_len} must be in [2, config.max_seq_len={config.max_seq_len}]")
    if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
        raise ValueError(f"GyreEngine.prefill_chunk must be a power of two >= {MIN_BUCKET}, got {prefill_chunk}")


class GyreEngine(engine_api.Engine):
    """The engine (JetStream's Engine API) on one cell's serving mesh. Constructor arguments:

    params: ``{"params": ...}`` from init_params; put in the mesh's serving shardings. A LoRA
    run's engine gets ``Adapted(base, adapters)`` and later publications adapters alone;
    ``lora_serving`` says how it serves them ("merged" or "unmerged": serving/lora_weights.py).

    mesh: the cell's serving mesh (axes 'data', 'tensor', and 'expert' to split an MoE
    model's experts over: engine_state.py); default: device 0.
    special_ids: (bos, eos, pad) reported to JetStream (informational).
    tokens_per_call: decode steps per ``generate`` call (one jitted scan). >1
    amortizes the per-call host work (JetStream's threads, dispatch) and the
    cache copy of a standalone step over several tokens; tokens then reach
    the backend, and commands (export, release) take effect, every
    ``tokens_per_call`` steps.
    max_decode_pause_s: how long decoding may wait for requests being
    prefilled to join the batch (see ``generate``); 0 disables the wait.
    max_len: KV capacity per slot (tokens); prompts longer than
    ``prefill_chunk`` (a power of two) are prefilled chunk by chunk into
    the slot's buffer with blockwise attention, so a 75K prompt needs one
    chunk's activations, not a [75K, 75K] mask.
    kv_budget_bytes: if set, the decode cache (max_slots x max_len) must fit
    it; otherwise a ValueError gives the plan (slots that fit, longest
    context at one slot; engine_state.kv_memory_plan). A paged cache
    instead gets as many pages as the budget holds.
    kv_cache: "contiguous" (max_len entries preallocated per slot) or "paged"
    (a pool of ``page_size``-token pages handed to live tokens; a call is
    admitted when pages for its prompt + max_tokens are free, so slots are
    cheap and max_slots can exceed what slots x max_len memory allows).
    kv_pages: pages in the pool (page 0 is never used); default: the budget's
    worth, or the contiguous cache's memory (max_slots x max_len) + 1.
    fixed_prefill: every prefill (any prompt length, with or without a cached prefix) runs
    ``prefill_chunk``-token chunks into a ``max_len`` buffer, so one prefill program and one
    insert serve every call (contiguous cache). Otherwise each (prefix, prompt) pair of
    power-of-two buckets is its own program: cheap for a small model, but a 30-layer model
    compiles each for minutes on a CPU host, and an agent's calls hit new pairs for hours.
    """

    def __init__(self, config: ModelConfig, params, *, mesh: Mesh | None = None, max_slots: int = 8,
                 max_len: int | None = None, version: int = 0, name: str = "engine",
                 special_ids: tuple[int, int, int] = (0, 0, 0), tokens_per_call: int = 1,
                 max_decode_pause_s: float = 0.1, prefill_chunk: int = 4096, kv_budget_bytes: int | None = None,
                 kv_cache: str = "contiguous", page_size: int = 16, kv_pages: int | None = None,
                 lora_serving: str = "merged", fixed_prefill: bool = False):
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor")) if mesh is None else mesh
        self._lora = LoraWeights(params.base, mesh, lora_serving) if isinstance(params, Adapted) else None
        config = self._lora.config if self._lora is not None else config
        self.max_len = config.max_seq_len if max_len is None else int(max_len)
        _check_sizes(config, max_slots, self.max_len, tokens_per_call, prefill_chunk)
        self.tokens_per_call = int(tokens_per_call)
        self.config, self.name = config, name
        # An MoE model's routing rides beside each token in the result rows (engine_state.py).
        self.result_layout = RoutingLayout.of(config)
        self.prefill_chunk = int(prefill_chunk)
        self.fixed_prefill = bool(fixed_prefill) and kv_cache == "contiguous"
        if self.fixed_prefill and self.prefill_chunk > self.max_len:
            raise ValueError(f"GyreEngine.fixed_prefill: prefill_chunk={prefill_chunk} exceeds max_len={self.max_len}")
        self.kv_cache = kv_cache
        pages = plan_kv(kv_cache, config, self.max_len, max_slots, page_size=page_size, kv_pages=kv_pages,
                        kv_budget_bytes=kv_budget_bytes)
        self._slots = max_slots
        self._mesh = mesh
        expert_parallel(config, mesh)  # experts that do not split over the mesh: say so before laying them out
        self._special = special_ids
        self._param_shardings = (self._lora.param_shardings() if self._lora is not None
                                 else tree_shardings(param_logical_axes(config), mesh, params))
        self.params_ref = ParamsRef(self._weights(params, None), version)
        self._init_host_state(max_decode_pause_s)
        self._build_jits(pages)
        self.kv: KVLayout = kv_layout_for(pages, self._kv_hooks(), max_slots=max_slots, max_len=self.max_len,
                                          tokens_per_call=self.tokens_per_call)

    def _init_host_state(self, max_decode_pause_s: float) -> None:
        """What JetStream's threads and the backend's share: slot owners, commands, errors, counters,
        and the prefill/decode coordination (see generate)."""
        self.max_decode_pause_s = float(max_decode_pause_s)
        self.free_slots = None  # () -> free decode slots; set by the backend that drives this engine
        self.counters = dict(prefill_tokens=0, prefills=0, moved_tokens=0, cached_tokens=0,
                             generate_steps=0, generate_s=0.0, prefill_s=0.0, engine_errors=0, decode_pauses=0,
                             page_waits=0, shared_page_tokens=0)
        self._lock = threading.Lock()
        self._owner_slot: dict[str, int] = {}
        self._slot_owner: dict[int, str] = {}
        self._cancelled: set[str] = set()
        self._release_tokens: dict[str, np.ndarray] = {}  # paged: a released call's whole sequence (release)
        self._errors: dict[str, str] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Requests between prefill and insert, and prefills running now (see generate).
        self._cv = threading.Condition()
        self._awaiting_insert = 0
        self._prefilling = 0
        self._pause_since: float | None = None
        # Decode calls dispatched and maybe not finished (their last column: slots
        # still generating). At most MAX_INFLIGHT_CALLS: running further ahead of
        # the device only delays commands and wastes steps on finished slots.
        self._inflight: collections.deque = collections.deque()
        self._any_active: bool | None = False  # None = unknown (a decode call is in flight)
        self._ids = itertools.count()

    def _build_jits(self, pages: tuple[int, int] | None):
        fns = device_fns(self.config, self.max_len, self._slots, self._mesh, self.tokens_per_call, pages)
        self._ds_sharding, self._block_sharding = fns["ds_sharding"], fns["block_sharding"]
        for k, v in fns.items():
            setattr(self, "_" + k, v)

    def _kv_hooks(self) -> EngineHooks:
        return EngineHooks(name=self.name, counters=self.counters, params=lambda: self.params_ref.value,
                           prefill=self._prefill, prefix_out=self._prefix_out, insert_now=self._insert_now,
                           fail=self._fail, wake=self._wake, stop_slot=self._stop_slot, hold_slot=self._hold_slot,
                           gather=self._gather, set_table=self._set_table)

    @property
    def _prefix_pages(self) -> PrefixPages | None:
        """The paged layout's prefix cache (None for a contiguous cache)."""
        return self.kv.prefix_pages

    def kv_stats(self) -> dict[str, int]:
        """Pages in use / free / promised (paged cache), and the live tokens they hold; {} for a contiguous one."""
        return self.kv.stats()

    def _place(self, params) -> LayerParams:
        """Weights as the engine serves them: one array per layer (model/unrolled.py: a decode step
        over stacked weights copies each layer's out every token), in this cell's serving layout.
        Each layer's slice goes to the cell as it is cut, so no second whole copy is built."""
        leaves, treedef = jax.tree.flatten(params)
        shardings = treedef.flatten_up_to(self._param_shardings)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef stub omits it
        index = jax.tree.unflatten(treedef, list(range(len(leaves))))  # each leaf's number, in its place
        lp = split_params(self.config, index,
                          take=lambda j, i: jax.device_put(leaves[j][i], layer_sharding(shardings[j])))
        return lp.replace(rest=jax.tree.map(lambda j: jax.device_put(leaves[j], shardings[j]), lp.rest))

    def _weights(self, params, previous: LayerParams | None) -> LayerParams:
        """What the engine serves for ``params``: placed as they are, or a LoRA run's adapters with the base."""
        if self._lora is None:
            return self._place(params)
        return self._lora.weights(params, self._place, previous)

    def bucket(self, n: int) -> int:
        b = MIN_BUCKET
        while b < n:
            b *= 2
        return min(b, self.max_len)

    # ---- JetStream Engine API -------------------------------------------------
    def load_params(self, *args, **kwargs) -> ParamsRef:
        return self.params_ref

    def publish(self, params, version: int) -> None:
        """New weights (already trained elsewhere) in this cell's serving layout.
        Call between drain and admit: calls already in a slot would mix versions. A LoRA run's
        engine takes the adapters alone (serving/lora_weights.py)."""
        self.params_ref.value = self._weights(params, self.params_ref.value)
        self.params_ref.version = int(version)
        self.kv.forget_cached()  # k/v of the old weights: never reused

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """A fresh decode state (all slots empty). Paged: a fresh pool, so the host's page
        tables, waiting calls and cached prefix pages are reset with it."""
        self.kv.reset()
        return self._make_state()

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> Prefix:
        inp = padded_tokens
        if not isinstance(inp, PrefillInput):  # a plain JetStream request (token ids): greedy to the context end
            toks = np.asarray(inp, np.int32)[: int(true_length)]
            n = int(toks.shape[0])
            inp = PrefillInput(f"plain-{next(self._ids)}", toks[:-1], int(toks[-1]), 0,
                               SamplingParams(max_tokens=max(1, self.max_len - n), temperature=0.0))
        if existing_prefix is not None and inp.kv is None:
            inp.kv = existing_prefix
        with self._cv:
            self._awaiting_insert += 1
            self._prefilling += 1
            self._cv.notify_all()
        try:
            with self._lock:
                if inp.request_id in self._cancelled:
                    return self._dead_prefix(inp.request_id)
            return self.kv.prefill(params, inp)
        except Exception as e:  # noqa: BLE001 - must not reach JetStream's thread
            log.exception("%s: prefill of %s failed", self.name, inp.request_id)
            self._fail(inp.request_id, f"prefill failed: {type(e).__name__}: {e}")
            return self._dead_prefix(inp.request_id)
        finally:
            with self._cv:
                self._prefilling -= 1
                self._cv.notify_all()

    def _prefix_out(self, k, v, inp: PrefillInput, n_all: int) -> Prefix:
        sp = inp.sampling
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop[: len(sp.stop_ids)] = sp.stop_ids
        return Prefix(k, v, np.array([n_all, inp.next_tok, inp.generated, sp.max_tokens, sp.seed, sp.adapter], np.int32),
                      np.array([sp.temperature, sp.top_p], np.float32), stop, inp.request_id)

    def _prefill(self, params, inp: PrefillInput) -> Prefix:
        t0 = time.perf_counter()
        p = params.value if isinstance(params, ParamsRef) else params
        toks = np.asarray(inp.tokens, np.int32)
        n_all = int(toks.shape[0])
        if n_all + 1 > self.max_len - 1:
            raise ValueError(f"sequence of {n_all + 1} tokens does not fit the cache length {self.max_len} "
                             f"(the engine's max_len: KV capacity per slot, one entry kept spare)")
        c = 0
        if inp.kv is not None:
            kv = inp.kv
            c = min(kv.length, n_all)
            k, v = jax.device_put((kv.k, kv.v), self._block_sharding)  # across devices for a moved call
            self.counters["moved_tokens" if inp.kv_origin == "moved" else "cached_tokens"] += c
        new = toks[c:]
        rt = None if inp.routing is None else np.asarray(inp.routing, np.int32)
        if rt is not None and rt.shape != (n_all, self.result_layout.width):
            raise ValueError(f"routing to replay is {rt.shape}, the {n_all} tokens need "
                             f"({n_all}, {self.result_layout.width})")
        if new.shape[0] == 0 and self.fixed_prefill:  # all of it cached: into the one buffer shape
            k, v = self._fit(*((k, v) if c else (self._zeros(MIN_BUCKET),) * 2), self.max_len)
        elif new.shape[0] == 0:
            if c == 0:
                z = jnp.zeros((self.config.n_layers, MIN_BUCKET, self.config.n_kv_heads, self.config.head_dim),
                              self.config.jnp_dtype)
                k, v = self._fit(z, z, MIN_BUCKET)
            else:
                k, v = self._fit(k, v, self.bucket(c))
        elif new.shape[0] > self.prefill_chunk or self.fixed_prefill:
            k, v = self._prefill_chunks(p, toks, c, k if c else None, v if c else None, rt, self._adapter_kw(inp))
            self.counters["prefill_tokens"] += int(new.shape[0])
        else:
            tb = self.bucket(new.shape[0])
            padded = np.zeros((tb,), np.int32)
            padded[: new.shape[0]] = new
            extra = () if rt is None else (_pad_routing(rt[c:], tb),)
            kw = self._adapter_kw(inp)
            if c == 0:
                k, v = self._prefill_new(p, padded, np.int32(new.shape[0]), *extra, **kw)
            else:
                k, v = self._prefill_on(p, padded, np.int32(new.shape[0]), k, v, np.int32(c), *extra, **kw)
            self.counters["prefill_tokens"] += int(new.shape[0])
        self.counters["prefills"] += 1
        out = self._prefix_out(k, v, inp, n_all)
        self.counters["prefill_s"] += time.perf_counter() - t0
        return out

    def _prefill_chunks(self, params, toks, c, k, v, routing=None, adapter_kw=None):
        """Chunked prefill: tokens c.. of ``toks`` into one buffer of bucket(len) entries,
        ``prefill_chunk`` at a time (one compile per buffer bucket); ``routing``: [len(toks), R]
        experts to replay (PrefillInput.routing)."""
        n_all = int(toks.shape[0])
        lb = self.max_len if self.fixed_prefill else self.bucket(n_all)
        if k is None:
            z = self._zeros(lb)
            k, v = self._fit(z, z, lb)
        else:
            k, v = self._fit(k, v, lb)
        chunk = min(self.prefill_chunk, lb)
        for start, real in mdecode.chunk_starts(n_all, chunk, lb, first=c):
            padded = np.zeros((chunk,), np.int32)
            padded[:real] = toks[start: start + real]
            extra = () if routing is None else (_pad_routing(routing[start: start + real], chunk),)
            k, v = self._prefill_into(params, padded, np.int32(real), k, v, np.int32(start), *extra, **(adapter_kw or {}))
        return k, v

    def _zeros(self, length: int):
        return jnp.zeros((self.config.n_layers, length, self.config.n_kv_heads, self.config.head_dim),
                         self.config.jnp_dtype)

    def _adapter_kw(self, inp: PrefillInput) -> dict:
        """The prefill's adapter (several LoRA adapters, unmerged: serving/lora_weights.py); {} otherwise."""
        n = self.config.lora.num_adapters if self.config.lora is not None else 1
        if n == 1:
            return {}
        a = inp.sampling.adapter
        if a >= n:
            raise ValueError(f"adapter {a} requested; this engine serves adapters 0..{n - 1}")
        return {"adapter": np.int32(a)}

    def _dead_prefix(self, request_id: str) -> Prefix:
        return Prefix(None, None, np.zeros(6, np.int32), np.zeros(2, np.float32),
                      np.full((MAX_STOP_IDS,), -1, np.int32), request_id)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        with self._cv:
            self._awaiting_insert = max(0, self._awaiting_insert - 1)
        decode_state = self._service(decode_state)
        rid = prefix.request_id
        with self._lock:
            old = self._slot_owner.get(slot)
            if old is not None:
                self._owner_slot.pop(old, None)
            self._slot_owner[slot] = rid
            self._owner_slot[rid] = slot
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
        try:
            return self.kv.insert(decode_state, prefix, slot, cancelled=cancelled)
        except Exception as e:  # noqa: BLE001
            log.exception("%s: insert of %s failed", self.name, rid)
            self._fail(rid, f"insert failed: {type(e).__name__}: {e}")
            return decode_state

    def _insert_now(self, ds: DecodeState, prefix: Prefix, slot: int, extra=()) -> DecodeState:
        # A slot is generating now; results still in flight predate it and must
        # not be read as "nothing is generating" by _idle.
        self._any_active = True
        self._inflight.clear()
        return self._insert(ds, prefix.k, prefix.v, prefix.scalars_i, prefix.scalars_f, prefix.stop_N,
                            np.int32(slot), *extra)

    def _idle(self) -> bool:
        """No slot is generating (only held or empty ones): skip the decode and
        wait briefly for a command or an insert instead of spinning."""
        newest = None
        while self._inflight and self._inflight[0].is_ready():
            newest = self._inflight.popleft()
        if newest is not None and not self._inflight:  # the latest call is done: its flags are current
            active_S = np.asarray(newest)[:, -1].astype(bool)
            self._any_active = bool(active_S.any())
            self.kv.track(active_S)  # a finished slot grows no more
        if self._any_active is not False:
            return False
        with self._cv:
            self._cv.wait_for(lambda: not self._commands.empty() or self._awaiting_insert > 0, timeout=0.02)
        return True

    def _should_pause(self) -> bool:
        """Let requests being prefilled join before decoding, so a burst of
        requests starts (and ends) together instead of one decode call apart."""
        if self.free_slots is None or self.max_decode_pause_s <= 0:
            return False
        with self._cv:
            if self._awaiting_insert == 0 or self.free_slots() == 0:
                self._pause_since = None
                return False
            now = time.perf_counter()
            if self._pause_since is None:
                self._pause_since = now
            if now - self._pause_since > self.max_decode_pause_s:
                self._pause_since = None  # decode once, then prefills may pause it again
                return False
            # Wait (event-driven) for a running prefill; the Driver inserts it next.
            self._cv.wait_for(lambda: self._prefilling == 0, timeout=self.max_decode_pause_s)
            return True

    def generate(self, params, decode_state: DecodeState):
        """One call = ``tokens_per_call`` decode steps for every slot, or a pause
        (no decode, every live slot reports the held marker) while requests that
        are being prefilled can still join the batch (``_should_pause``).

        JetStream's interleaved mode already holds decoding while its prefill
        queue is non-empty, but not while the prefill thread is computing the
        request it just took, so without this a burst of N requests starts
        staggered by one decode call each."""
        t0 = time.perf_counter()
        try:
            decode_state = self.kv.admit(self._service(decode_state))
            if self._should_pause() or self._idle():
                self.counters["decode_pauses"] += 1
                return decode_state, self._result(self._pause(decode_state))
            p = params.value if isinstance(params, ParamsRef) else params
            if len(self._inflight) >= MAX_INFLIGHT_CALLS:
                jax.block_until_ready(self._inflight.popleft())
            decode_state = self.kv.grow(decode_state)
            decode_state, data = self._generate(p, decode_state)
            self._inflight.append(data)
            self._any_active = None
        except Exception as e:  # noqa: BLE001 - fail the batch, keep the server
            log.exception("%s: generate step failed", self.name)
            with self._lock:
                owners = list(self._owner_slot)
            for rid in owners:
                self._fail(rid, f"generate step failed: {type(e).__name__}: {e}")
            decode_state = self.init_decode_state()
            data = np.zeros((self._slots, 2 * self.result_layout.step_cols * self.tokens_per_call + 2), np.int32)
        self.counters["generate_steps"] += self.tokens_per_call
        self.counters["generate_s"] += time.perf_counter() - t0
        return decode_state, self._result(data)

    def _result(self, data) -> engine_api.ResultTokens:
        k2 = self.result_layout.step_cols * self.tokens_per_call
        return engine_api.ResultTokens(data, (0, k2), (k2, 2 * k2), (2 * k2, 2 * k2 + 1), 1)

    def get_prefix_destination_sharding(self):
        return self._block_sharding

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="gyre-byte", extra_ids=0)

    def build_tokenizer(self, metadata) -> tokenizer_api.Tokenizer:
        return _JetStreamTokenizer(*self._special)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.max_len

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    # ---- commands from other threads -------------------------------------------
    def detach(self, request_id: str, *, export: bool) -> concurrent.futures.Future | None:
        """Stop a request (and, with ``export``, hand back its slot's KV).

        Returns a Future resolved on the generate thread with an ExportedSlot
        (export) / True (stop), or None there if the request had already
        finished. Returns None right away if the request is not in a slot yet:
        it will then be dropped when it reaches insert.
        """
        with self._lock:
            if request_id not in self._owner_slot:
                self._cancelled.add(request_id)
                return None
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("export" if export else "stop", request_id, fut))
        self._wake()
        return fut

    def release(self, request_id: str, *, snapshot: bool, tokens=None) -> concurrent.futures.Future | None:
        """Free a finished request's held slot; with ``snapshot``, first copy out its
        KV (an ExportedSlot, for the prefix cache). None if it holds no slot.

        Paged cache: ``tokens`` (the call's prompt + the tokens it generated) puts the full pages
        of everything the slot computed into the engine's page prefix cache, so a later call that
        re-sends this answer (the next turn of the rollout) maps them instead of recomputing."""
        with self._lock:
            if request_id not in self._owner_slot:
                return None
            if tokens is not None and self.kv.keeps_sequences:
                self._release_tokens[request_id] = np.asarray(tokens, np.int32)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("release_snapshot" if snapshot else "release", request_id, fut))
        self._wake()
        return fut

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def pop_error(self, request_id: str) -> str | None:
        with self._lock:
            return self._errors.pop(request_id, None)

    def _fail(self, request_id: str, message: str) -> None:
        self.counters["engine_errors"] += 1
        with self._lock:
            self._errors[request_id] = message
            self._cancelled.discard(request_id)

    def _service(self, ds: DecodeState) -> DecodeState:
        """Run every queued command against ``ds`` (one host read of the slot
        flags and one device update for the whole batch of commands)."""
        cmds = []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if not cmds:
            return ds
        try:
            flags = tuple(np.asarray(x) for x in jax.device_get(
                (ds.active_S, ds.held_S, ds.cache.lengths, ds.generated_S)))
        except Exception as e:  # noqa: BLE001
            for _, _, fut in cmds:
                fut.set_exception(e)
            return ds
        active_S, _, len_S, _ = flags
        stop_S = np.zeros((self._slots,), bool)
        for kind, rid, fut in cmds:
            if kind == "gather":  # a cached prefix's pages, for a prefill (rid: the page list)
                try:
                    fut.set_result(self._gather(ds, rid))
                except Exception as e:  # noqa: BLE001
                    fut.set_exception(e)
                continue
            try:
                self._command(ds, kind, rid, fut, flags, stop_S)
            except Exception as e:  # noqa: BLE001
                log.exception("%s: %s of %s failed", self.name, kind, rid)
                fut.set_exception(e)
        self.kv.track(active_S, len_S)
        if stop_S.any():
            ds = self._stop_slots(ds, stop_S)
        for kind, rid, _ in cmds:  # stopped, or ended on its own (context full): its room goes back
            if kind == "gather":
                continue
            with self._lock:
                slot = self._owner_slot.get(rid)
            if slot is not None and kind != "export" or slot is not None and stop_S[slot]:
                self.kv.free(slot)
        self._any_active = bool((active_S & ~stop_S).any())  # exact for ds now (the read waited for it)
        self._inflight.clear()
        return ds

    def _command(self, ds: DecodeState, kind: str, rid: str, fut: concurrent.futures.Future, flags: tuple,
                 stop_S: np.ndarray) -> None:
        """One export / stop / release(_snapshot) of ``rid``'s slot: its future's result set, and the
        slot marked in ``stop_S`` when it must stop (flags: the slots' active, held, length, generated)."""
        active_S, held_S, len_S, gen_S = flags
        with self._lock:
            slot = self._owner_slot.get(rid)
            seq = self._release_tokens.pop(rid, None) if kind.startswith("release") else None
        if slot is None or stop_S[slot]:
            fut.set_result(None)
            return
        active, held, length = bool(active_S[slot]), bool(held_S[slot]), int(len_S[slot])
        result: ExportedSlot | bool | None = None
        found = self.kv.withdraw(slot)
        if found is not None:  # never admitted: nothing computed here to move but its prompt
            waiting, inp = found
            if kind == "export":
                # Its prefill ran (inp None; a dead prefix never waits) or was left for admission.
                kv = (KVBlock(waiting.k, waiting.v, int(waiting.scalars_i[0]))
                      if inp is None and waiting.k is not None and waiting.v is not None else None)
                result = ExportedSlot(kv, int(waiting.scalars_i[2]))
            else:
                result = True
            stop_S[slot] = True
            fut.set_result(result)
            return
        if seq is not None and held:
            self.kv.keep_sequence(seq, slot, length)  # before free() drops the slot's hold
        if kind == "export" and active or kind == "release_snapshot" and held:
            k, v = self._export(ds, np.int32(slot), self.bucket(length))
            result = ExportedSlot(KVBlock(k, v, length), int(gen_S[slot]))
        elif kind in ("stop", "release"):
            result = True if (active or held) else None
        stop_S[slot] = active or held
        fut.set_result(result)
