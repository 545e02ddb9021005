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
  (``decode_result_pairs`` unpacks them). Stop ids are handled here (JetStream's
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
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.cells.sharding import tree_shardings
from gyre_jax.model import ModelConfig, param_logical_axes
from gyre_jax.model import decode as mdecode
from gyre_jax.serving.backend import MAX_STOP_IDS, SamplingParams
from gyre_jax.serving.jetstream_compat import engine_api, tokenizer_api, tokenizer_pb2
from gyre_jax.serving.sampling import sample_tokens

log = logging.getLogger(__name__)
MIN_BUCKET = 16
HELD_MARK = -1  # token column of a held slot: "no token this step, slot still in use"
MAX_HOLD_STEPS = 512  # a held slot the backend never releases is freed after this many steps


class ParamsRef:
    """What JetStream's Driver holds as "params": its threads read the params once
    at start, so weight publication swaps ``value`` here instead."""

    def __init__(self, value, version: int = 0):
        self.value, self.version = value, version


@flax.struct.dataclass
class KVBlock:
    """k/v [Y, Lb, K, H] of a token run; the first ``length`` entries are valid."""

    k: jax.Array
    v: jax.Array
    length: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedSlot:
    kv: KVBlock
    generated: int  # tokens the request had generated when exported


@dataclasses.dataclass(eq=False)
class PrefillInput:
    """A request as GyreEngine.prefill receives it (via JetStream's padded_tokens)."""

    request_id: str
    tokens: np.ndarray  # int32: seq[:-1], whose k/v the slot must hold
    next_tok: int  # seq[-1], fed at the first decode step
    generated: int  # tokens already generated (a resumed call)
    sampling: SamplingParams
    kv: KVBlock | None = None  # k/v of tokens[:kv.length], computed elsewhere
    kv_origin: str = "cached"  # "cached" (prefix cache) or "moved" (exported call)


@flax.struct.dataclass
class Prefix:
    k: jax.Array | None  # [Y, Lb, K, H]; None for a request that must not run
    v: jax.Array | None
    scalars_i: jax.Array  # int32[5]: length, next_tok, generated, max_tokens, seed
    scalars_f: jax.Array  # float32[2]: temperature, top_p
    stop_N: jax.Array  # int32[MAX_STOP_IDS], -1 = unused
    request_id: str = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DecodeState:
    cache: mdecode.KVCache
    next_tok_S: jax.Array
    generated_S: jax.Array
    max_tokens_S: jax.Array
    seed_S: jax.Array
    temperature_S: jax.Array
    top_p_S: jax.Array
    stop_SxN: jax.Array
    active_S: jax.Array  # generating
    held_S: jax.Array  # finished, slot kept until the backend releases it (see "Held slots")
    hold_steps_S: jax.Array


def decode_result_pairs(token_ids) -> list[tuple[int, float]]:
    """[tok, lp_bits, tok, lp_bits, ...] from JetStream -> [(tok, logprob), ...] (held markers dropped)."""
    arr = np.asarray(token_ids, dtype=np.int32).reshape(-1, 2)
    lps = arr[:, 1].copy().view(np.float32)
    return [(int(t), float(lp)) for t, lp in zip(arr[:, 0], lps) if t != HELD_MARK]


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


@functools.lru_cache(maxsize=32)
def _device_fns(cfg: ModelConfig, m: int, slots: int, mesh: Mesh) -> dict:
    """Jitted device functions of an engine, shared by engines with the same
    config, cache shape and mesh (so a second engine costs no compile)."""
    tp = mesh.shape.get("tensor", 1)
    kvh = "tensor" if cfg.n_kv_heads % tp == 0 else None
    dp = mesh.shape.get("data", 1)
    sl = "data" if slots % dp == 0 else None
    rep = NamedSharding(mesh, PartitionSpec())
    cache_s = NamedSharding(mesh, PartitionSpec(None, sl, None, kvh))
    blk = NamedSharding(mesh, PartitionSpec(None, None, kvh))
    ds_s = DecodeState(mdecode.KVCache(cache_s, cache_s, rep), *([rep] * 10))
    out: dict = {"ds_sharding": ds_s, "block_sharding": blk}

    def prefill_new(params, tokens_T, n):
        logits, kv = mdecode.prefill(params, cfg, tokens_T, true_length=n)
        return kv.k, kv.v

    def prefill_on(params, tokens_T, n, pk, pv, c):
        _, kv = mdecode.prefill(params, cfg, tokens_T, prefix=mdecode.KV(pk, pv), start_pos=c, true_length=n)
        t = tokens_T.shape[0]
        lb = min(pk.shape[1] + t, m)
        pad = jnp.zeros((pk.shape[0], t) + pk.shape[2:], pk.dtype)
        k = jax.lax.dynamic_update_slice(jnp.concatenate([pk, pad], 1), kv.k.astype(pk.dtype), (0, c, 0, 0))
        v = jax.lax.dynamic_update_slice(jnp.concatenate([pv, pad], 1), kv.v.astype(pv.dtype), (0, c, 0, 0))
        return k[:, :lb], v[:, :lb]

    def fit(k, v, lb):  # fresh buffers of static length lb (JetStream deletes prefixes after insert)
        if k.shape[1] >= lb:
            return k[:, :lb] + 0, v[:, :lb] + 0
        pad = [(0, 0), (0, lb - k.shape[1]), (0, 0), (0, 0)]
        return jnp.pad(k, pad), jnp.pad(v, pad)

    def insert(ds, k, v, si, sf, stop_N, slot):  # arrays only: a Prefix's request_id would key the jit cache
        cache = mdecode.insert(ds.cache, mdecode.KV(k, v), slot, start=0, length=si[0])
        return ds.replace(
            cache=cache, next_tok_S=ds.next_tok_S.at[slot].set(si[1]), generated_S=ds.generated_S.at[slot].set(si[2]),
            max_tokens_S=ds.max_tokens_S.at[slot].set(si[3]), seed_S=ds.seed_S.at[slot].set(si[4]),
            temperature_S=ds.temperature_S.at[slot].set(sf[0]), top_p_S=ds.top_p_S.at[slot].set(sf[1]),
            stop_SxN=ds.stop_SxN.at[slot].set(stop_N), active_S=ds.active_S.at[slot].set(True),
            held_S=ds.held_S.at[slot].set(False), hold_steps_S=ds.hold_steps_S.at[slot].set(0))

    def stop_slot(ds, slot):  # neither generating nor held: JetStream frees it after the next step
        return ds.replace(active_S=ds.active_S.at[slot].set(False), held_S=ds.held_S.at[slot].set(False))

    def generate(params, ds):
        logits, cache = mdecode.decode_step(params, cfg, ds.next_tok_S, ds.cache, active_S=ds.active_S)
        tok_S, lp_S = sample_tokens(logits, ds.temperature_S, ds.top_p_S, ds.seed_S, ds.generated_S)
        act_S = ds.active_S
        gen_S = ds.generated_S + act_S.astype(jnp.int32)
        stop_S = jnp.any(tok_S[:, None] == ds.stop_SxN, axis=1)
        # Keep one spare cache entry: a finished slot's dummy writes land there.
        full_S = cache.lengths >= m - 1
        ended_S = act_S & (stop_S | (gen_S >= ds.max_tokens_S) | full_S)
        still_held_S = ds.held_S & (ds.hold_steps_S < MAX_HOLD_STEPS)
        valid_S = (act_S | still_held_S).astype(jnp.int32)
        out_S = jnp.where(act_S, tok_S, HELD_MARK)
        lp_bits_S = jax.lax.bitcast_convert_type(-jnp.abs(lp_S), jnp.int32)
        data = jnp.stack([out_S, lp_bits_S, valid_S, valid_S, gen_S], axis=1)
        new = ds.replace(cache=cache, next_tok_S=jnp.where(act_S, tok_S, ds.next_tok_S), generated_S=gen_S,
                         active_S=act_S & ~ended_S, held_S=still_held_S | (ended_S & ~full_S),
                         hold_steps_S=jnp.where(still_held_S, ds.hold_steps_S + 1, 0))
        return new, data

    def export_slot(ds, slot, lb):
        sh = (cfg.n_layers, 1, lb, cfg.n_kv_heads, cfg.head_dim)
        k = jax.lax.dynamic_slice(ds.cache.k, (0, slot, 0, 0, 0), sh)[:, 0]
        v = jax.lax.dynamic_slice(ds.cache.v, (0, slot, 0, 0, 0), sh)[:, 0]
        return k, v

    out["prefill_new"] = jax.jit(prefill_new, out_shardings=(blk, blk))
    out["prefill_on"] = jax.jit(prefill_on, out_shardings=(blk, blk))
    out["fit"] = jax.jit(fit, static_argnums=2, out_shardings=(blk, blk))
    out["insert"] = jax.jit(insert, donate_argnums=0, out_shardings=ds_s)
    out["stop_slot"] = jax.jit(stop_slot, donate_argnums=0, out_shardings=ds_s)
    out["generate"] = jax.jit(generate, donate_argnums=1, out_shardings=(ds_s, rep))
    out["export"] = jax.jit(export_slot, static_argnums=2, out_shardings=(blk, blk))

    def make_state():
        z = jnp.zeros((slots,), jnp.int32)
        f = jnp.zeros((slots,), bool)
        return DecodeState(mdecode.init_cache(cfg, slots, m), z, z, z, z, jnp.zeros((slots,), jnp.float32),
                           jnp.ones((slots,), jnp.float32), jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32), f, f, z)

    out["make_state"] = jax.jit(make_state, out_shardings=ds_s)
    return out


class GyreEngine(engine_api.Engine):
    def __init__(self, config: ModelConfig, params, *, mesh: Mesh | None = None, max_slots: int = 8,
                 max_len: int | None = None, version: int = 0, name: str = "engine",
                 special_ids: tuple[int, int, int] = (0, 0, 0)):
        """params: ``{"params": ...}`` from init_params; put in the mesh's serving shardings.

        mesh: the cell's serving mesh (axes 'data', 'tensor'); default: device 0.
        special_ids: (bos, eos, pad) reported to JetStream (informational).
        """
        if max_slots < 1:
            raise ValueError(f"GyreEngine.max_slots must be >= 1, got {max_slots}")
        self.config, self.name = config, name
        self.max_len = config.max_seq_len if max_len is None else int(max_len)
        if not 2 <= self.max_len <= config.max_seq_len:
            raise ValueError(f"GyreEngine.max_len={self.max_len} must be in [2, config.max_seq_len={config.max_seq_len}]")
        self._slots = max_slots
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
        self._mesh = mesh
        self._special = special_ids
        self._param_shardings = tree_shardings(param_logical_axes(config), mesh, params)
        self.params_ref = ParamsRef(jax.device_put(params, self._param_shardings), version)
        self._lock = threading.Lock()
        self._owner_slot: dict[str, int] = {}
        self._slot_owner: dict[int, str] = {}
        self._cancelled: set[str] = set()
        self._errors: dict[str, str] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self.counters = dict(prefill_tokens=0, prefills=0, moved_tokens=0, cached_tokens=0,
                             generate_steps=0, generate_s=0.0, prefill_s=0.0, engine_errors=0)
        self._build_jits()

    def _build_jits(self):
        fns = _device_fns(self.config, self.max_len, self._slots, self._mesh)
        self._ds_sharding, self._block_sharding = fns["ds_sharding"], fns["block_sharding"]
        for k, v in fns.items():
            setattr(self, "_" + k, v)

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
        Call between drain and admit: calls already in a slot would mix versions."""
        self.params_ref.value = jax.device_put(params, self._param_shardings)
        self.params_ref.version = int(version)

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
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
        try:
            with self._lock:
                if inp.request_id in self._cancelled:
                    return self._dead_prefix(inp.request_id)
            return self._prefill(params, inp)
        except Exception as e:  # noqa: BLE001 - must not reach JetStream's thread
            log.exception("%s: prefill of %s failed", self.name, inp.request_id)
            self._fail(inp.request_id, f"prefill failed: {type(e).__name__}: {e}")
            return self._dead_prefix(inp.request_id)

    def _prefill(self, params, inp: PrefillInput) -> Prefix:
        t0 = time.perf_counter()
        p = params.value if isinstance(params, ParamsRef) else params
        toks = np.asarray(inp.tokens, np.int32)
        n_all = int(toks.shape[0])
        if n_all + 1 > self.max_len - 1:
            raise ValueError(f"sequence of {n_all + 1} tokens does not fit the cache length {self.max_len}")
        c = 0
        if inp.kv is not None:
            kv = inp.kv
            c = min(kv.length, n_all)
            k, v = jax.device_put((kv.k, kv.v), self._block_sharding)  # across devices for a moved call
            self.counters["moved_tokens" if inp.kv_origin == "moved" else "cached_tokens"] += c
        new = toks[c:]
        if new.shape[0] == 0:
            if c == 0:
                z = jnp.zeros((self.config.n_layers, MIN_BUCKET, self.config.n_kv_heads, self.config.head_dim),
                              self.config.jnp_dtype)
                k, v = self._fit(z, z, MIN_BUCKET)
            else:
                k, v = self._fit(k, v, self.bucket(c))
        else:
            tb = self.bucket(new.shape[0])
            padded = np.zeros((tb,), np.int32)
            padded[: new.shape[0]] = new
            if c == 0:
                k, v = self._prefill_new(p, padded, np.int32(new.shape[0]))
            else:
                k, v = self._prefill_on(p, padded, np.int32(new.shape[0]), k, v, np.int32(c))
            self.counters["prefill_tokens"] += int(new.shape[0])
        self.counters["prefills"] += 1
        sp = inp.sampling
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop[: len(sp.stop_ids)] = sp.stop_ids
        out = Prefix(k, v, np.array([n_all, inp.next_tok, inp.generated, sp.max_tokens, sp.seed], np.int32),
                     np.array([sp.temperature, sp.top_p], np.float32), stop, inp.request_id)
        self.counters["prefill_s"] += time.perf_counter() - t0
        return out

    def _dead_prefix(self, request_id: str) -> Prefix:
        return Prefix(None, None, np.zeros(5, np.int32), np.zeros(2, np.float32),
                      np.full((MAX_STOP_IDS,), -1, np.int32), request_id)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        decode_state = self._service(decode_state)
        rid = prefix.request_id
        with self._lock:
            old = self._slot_owner.get(slot)
            if old is not None:
                self._owner_slot.pop(old, None)
            self._slot_owner[slot] = rid
            self._owner_slot[rid] = slot
            dead = prefix.k is None or rid in self._cancelled
            self._cancelled.discard(rid)
        try:
            if dead:
                return self._stop_slot(decode_state, np.int32(slot))
            return self._insert(decode_state, prefix.k, prefix.v, prefix.scalars_i, prefix.scalars_f, prefix.stop_N,
                                np.int32(slot))
        except Exception as e:  # noqa: BLE001
            log.exception("%s: insert of %s failed", self.name, rid)
            self._fail(rid, f"insert failed: {type(e).__name__}: {e}")
            return decode_state

    def generate(self, params, decode_state: DecodeState):
        t0 = time.perf_counter()
        try:
            decode_state = self._service(decode_state)
            p = params.value if isinstance(params, ParamsRef) else params
            decode_state, data = self._generate(p, decode_state)
        except Exception as e:  # noqa: BLE001 - fail the batch, keep the server
            log.exception("%s: generate step failed", self.name)
            with self._lock:
                owners = list(self._owner_slot)
            for rid in owners:
                self._fail(rid, f"generate step failed: {type(e).__name__}: {e}")
            decode_state = self.init_decode_state()
            data = np.zeros((self._slots, 5), np.int32)
        self.counters["generate_steps"] += 1
        self.counters["generate_s"] += time.perf_counter() - t0
        return decode_state, engine_api.ResultTokens(data, (0, 2), (2, 4), (4, 5), 1)

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
            return fut

    def release(self, request_id: str, *, snapshot: bool) -> concurrent.futures.Future | None:
        """Free a finished request's held slot; with ``snapshot``, first copy out its
        KV (an ExportedSlot, for the prefix cache). None if it holds no slot."""
        with self._lock:
            if request_id not in self._owner_slot:
                return None
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("release_snapshot" if snapshot else "release", request_id, fut))
            return fut

    def pop_error(self, request_id: str) -> str | None:
        with self._lock:
            return self._errors.pop(request_id, None)

    def _fail(self, request_id: str, message: str) -> None:
        self.counters["engine_errors"] += 1
        with self._lock:
            self._errors[request_id] = message
            self._cancelled.discard(request_id)

    def _service(self, ds: DecodeState) -> DecodeState:
        while True:
            try:
                kind, rid, fut = self._commands.get_nowait()
            except queue.Empty:
                return ds
            try:
                with self._lock:
                    slot = self._owner_slot.get(rid)
                if slot is None:
                    fut.set_result(None)
                    continue
                active, held, length, generated = (int(x) for x in jax.device_get(
                    (ds.active_S[slot], ds.held_S[slot], ds.cache.lengths[slot], ds.generated_S[slot])))
                result = None
                if kind == "export" and active or kind == "release_snapshot" and held:
                    k, v = self._export(ds, np.int32(slot), self.bucket(length))
                    result = ExportedSlot(KVBlock(k, v, length), generated)
                elif kind in ("stop", "release"):
                    result = True if (active or held) else None
                if active or held:
                    ds = self._stop_slot(ds, np.int32(slot))
                fut.set_result(result)
            except Exception as e:  # noqa: BLE001
                log.exception("%s: %s of %s failed", self.name, kind, rid)
                fut.set_exception(e)

