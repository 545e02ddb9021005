"""The device half of GyreEngine: its state pytrees and jitted step functions.

No JetStream here (engine.py adapts this to JetStream's Engine API), so the
decode step can be used and tested on its own. Shapes: S slots, M cache length,
K k/v heads, Y layers, N = MAX_STOP_IDS.

A slot's row of the result of one ``generate`` call (k_steps decode steps) is
``[tok_1, lpbits_1, ..., tok_k, lpbits_k | valid x 2k | generated | active]``:
lpbits is the float32 bit pattern of -|log-prob| (always negative, so never a
token id); tok is HELD_MARK for a finished slot kept for its backend; valid 0
tells JetStream to free the slot; the last column (which JetStream does not read)
says whether the slot is still generating.

An MoE model also records each sampled token's routing (routing replay): the experts
every MoE layer chose at the step that sampled it, R = MoE layers x top-k ids packed
into ``RoutingLayout.words`` int32 columns right after its log-prob (4 ids per word up
to 256 experts, else 2), so a step is ``[tok, lpbits, w_1..w_P]`` and JetStream passes
the words through as more "speculative" tokens, aligned with their token by
construction. ``decode_result_steps`` unpacks them.

Expert parallelism: on a serving mesh with an 'expert' axis (cells.serve_expert) an MoE
model's experts are split over it (the rules table) and every function that runs the model
is traced with that mesh as the abstract mesh and ``expert_parallel_axis`` set, so prefill
and decode send each token to its experts' devices and back with the training step's
all-to-all dispatch (model/moe.py): the same function, so the same tokens and logits.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model import ModelConfig
from gyre_jax.model import decode as mdecode
from gyre_jax.serving.backend import MAX_STOP_IDS, SamplingParams
from gyre_jax.serving.sampling import sample_tokens
from gyre_jax.sharding import EXPERT, mesh_spec

HELD_MARK = -1  # token column of a held slot: "no token this step, slot still in use"
MAX_HOLD_STEPS = 512  # a held slot the backend never releases is freed after this many steps
# Logical axes of the k/v arrays (their shardings come from gyre_jax.sharding.RULES):
CACHE_LOGICAL = ("cache_batch", "cache_len", "kv_heads", "head_dim")  # each layer's KVCache.k/v [S, M, K, H]
BLOCK_LOGICAL = ("layers", "cache_len", "kv_heads", "head_dim")  # KVBlock.k/v [Y, Lb, K, H]
# A paged pool [K, NP, G, H] (one per layer) splits over kv heads only: any page may hold any
# slot's tokens, so a data-parallel serving mesh keeps the whole pool on each of its replicas.
PAGES_LOGICAL = ("kv_heads", "cache_len", None, "head_dim")


def kv_shardings(cfg: ModelConfig, m: int, slots: int, mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(cache, block) shardings of an engine's k/v on ``mesh`` (cache: each layer's array), from the rules table.

    A dimension its mesh axes do not divide (slots, or fewer kv heads than the tensor
    degree) is replicated. A block's length varies per request; the cache length stands
    in for it in the divisibility check ('cache_len' is not sharded).
    """
    def spec(logical, shape, what):
        return NamedSharding(mesh, mesh_spec(logical, mesh, shape=shape, where=what, replicate_indivisible=True))

    cache = spec(CACHE_LOGICAL, (slots, m, cfg.n_kv_heads, cfg.head_dim), "KV cache")
    block = spec(BLOCK_LOGICAL, (cfg.n_layers, m, cfg.n_kv_heads, cfg.head_dim), "KV block")
    return cache, block


def pages_sharding(cfg: ModelConfig, num_pages: int, page_size: int, mesh: Mesh) -> NamedSharding:
    shape = (cfg.n_kv_heads, num_pages, page_size, cfg.head_dim)
    return NamedSharding(mesh, mesh_spec(PAGES_LOGICAL, mesh, shape=shape, where="KV pages", replicate_indivisible=True))


@flax.struct.dataclass
class KVBlock:
    """k/v [Y, Lb, K, H] of a token run; the first ``length`` entries are valid."""

    k: jax.Array
    v: jax.Array
    length: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedSlot:
    kv: KVBlock | None  # None: exported while waiting for pages, its prefill left for admission (none ran)
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
    # An MoE model's experts to replay per token, int32 [len(tokens), R] (-1: route live): a moved call
    # recomputed from its tokens gets its generated tokens' decode routing, so its cache is decode's.
    routing: np.ndarray | None = None


class Prefix(flax.struct.PyTreeNode):  # PyTreeNode: flax.struct.dataclass with a typed replace()
    k: jax.Array | None  # [Y, Lb, K, H]; None for a request that must not run
    v: jax.Array | None
    scalars_i: jax.Array | np.ndarray  # int32[6]: length, next_tok, generated, max_tokens, seed, adapter
    scalars_f: jax.Array | np.ndarray  # float32[2]: temperature, top_p
    stop_N: jax.Array | np.ndarray  # int32[MAX_STOP_IDS], -1 = unused
    request_id: str = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DecodeState:
    cache: mdecode.KVCache | mdecode.PagedKVCache
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
    adapter_S: jax.Array  # multi-LoRA: the adapter each slot decodes with (SamplingParams.adapter)


@dataclasses.dataclass(frozen=True)
class RoutingLayout:
    """How one decode step's routing rides in the result row (module docstring); width 0: none."""

    width: int = 0  # R expert ids per token (ModelConfig.routing_width)
    itemsize: int = 1  # bytes per id: 1 up to 256 experts, else 2

    @classmethod
    def of(cls, cfg: ModelConfig) -> "RoutingLayout":
        return cls(cfg.routing_width, 1 if cfg.num_experts <= 256 else 2)

    @property
    def words(self) -> int:
        """int32 columns per step."""
        return -(-self.width * self.itemsize // 4)

    @property
    def step_cols(self) -> int:
        return 2 + self.words

    @property
    def dtype(self):
        return np.dtype("u1") if self.itemsize == 1 else np.dtype("<u2")

    def pack(self, routing_SxR):
        """int32 ids [S, R] -> int32 words [S, P] (little-endian bytes, as the host unpacks them)."""
        s = routing_SxR.shape[0]
        per = 4 // self.itemsize
        dt = jnp.uint8 if self.itemsize == 1 else jnp.uint16
        r = jnp.pad(routing_SxR.astype(dt), ((0, 0), (0, self.words * per - self.width)))
        return jax.lax.bitcast_convert_type(r.reshape(s, self.words, per), jnp.int32)

    def unpack(self, words_P) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(words_P, "<i4")).view(self.dtype)[: self.width].copy()


def decode_result_steps(token_ids, layout: RoutingLayout) -> list[tuple[int, float, np.ndarray | None]]:
    """One slot's JetStream tokens -> [(tok, logprob, routing uint8/uint16 [R] or None), ...] (held markers dropped)."""
    arr = np.asarray(token_ids, dtype=np.int32).reshape(-1, layout.step_cols)
    lps = arr[:, 1].copy().view(np.float32)
    return [(int(t), float(lp), layout.unpack(row[2:]) if layout.width else None)
            for t, lp, row in zip(arr[:, 0], lps, arr) if t != HELD_MARK]


def decode_result_pairs(token_ids) -> list[tuple[int, float]]:
    """[tok, lp_bits, tok, lp_bits, ...] from JetStream -> [(tok, logprob), ...] (held markers dropped)."""
    arr = np.asarray(token_ids, dtype=np.int32).reshape(-1, 2)
    lps = arr[:, 1].copy().view(np.float32)
    return [(int(t), float(lp)) for t, lp in zip(arr[:, 0], lps) if t != HELD_MARK]


@functools.lru_cache(maxsize=32)
def kv_bytes_per_slot(cfg: ModelConfig, max_len: int) -> int:
    """Bytes of one slot's k and v cache over all layers."""
    return 2 * cfg.n_layers * max_len * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize


def kv_bytes_per_page(cfg: ModelConfig, page_size: int) -> int:
    return kv_bytes_per_slot(cfg, page_size)


def kv_memory_plan(cfg: ModelConfig, max_len: int, budget_bytes: int) -> dict:
    """How many decode slots of ``max_len`` tokens the KV budget holds (and the longest context at 1 slot)."""
    per_slot = kv_bytes_per_slot(cfg, max_len)
    per_token = kv_bytes_per_slot(cfg, 1)
    return {"max_len": int(max_len), "bytes_per_slot": int(per_slot), "budget_bytes": int(budget_bytes),
            "slots_that_fit": int(budget_bytes // per_slot), "max_len_one_slot": int(budget_bytes // per_token)}


def expert_parallel(cfg: ModelConfig, mesh: Mesh) -> bool:
    """Whether an engine on ``mesh`` dispatches ``cfg``'s experts over the mesh's 'expert' axis
    (ValueError when they do not split evenly over it)."""
    p = dict(mesh.shape).get(EXPERT, 1)
    if cfg.num_experts == 0 or p == 1:
        return False
    if cfg.num_experts % p:
        raise ValueError(f"serving mesh {dict(mesh.shape)}: the model's {cfg.num_experts} experts do not split "
                         f"evenly over its {p} '{EXPERT}' devices (cells.serve_expert)")
    return True


def device_fns(cfg: ModelConfig, m: int, slots: int, mesh: Mesh, k_steps: int,
               paged: tuple[int, int] | None = None) -> dict:
    """Jitted device functions of an engine, shared by engines with the same
    config, cache shape and mesh (so a second engine costs no compile).

    paged: (num_pages, page_size) for a paged cache (model/paged.py; the host's
    PagePool says which page holds what), None for one buffer of m tokens per slot.
    """
    ep = expert_parallel(cfg, mesh)
    if ep:
        cfg = cfg.replace(expert_parallel_axis=EXPERT)
    jit_model = _model_jit(mesh) if ep else jax.jit
    cache_s, blk = kv_shardings(cfg, m, slots, mesh)
    rep = NamedSharding(mesh, PartitionSpec())  # lengths, per-slot vectors, result rows: small, read on the host
    if paged is None:
        per_layer = (cache_s,) * cfg.n_layers
        # A pytree of shardings shaped like the state (jit's out_shardings), so leaves are not arrays.
        ds_s = DecodeState(mdecode.KVCache(per_layer, per_layer, rep), *([rep] * 11))  # type: ignore[arg-type]
    else:
        per_layer = (pages_sharding(cfg, paged[0], paged[1], mesh),) * cfg.n_layers
        ds_s = DecodeState(mdecode.PagedKVCache(per_layer, per_layer, rep, rep), *([rep] * 11))  # type: ignore[arg-type]
    out: dict = {"ds_sharding": ds_s, "block_sharding": blk}
    out.update(_prefill_fns(cfg, m, jit_model, blk))
    out.update(_slot_fns(cfg, m, slots, paged, ds_s, blk))
    out.update(_decode_fns(cfg, m, slots, k_steps, paged, jit_model, ds_s, rep))
    return out


def _model_jit(mesh: Mesh):
    """jax.jit, traced under the serving mesh when the experts are dispatched over it (model/moe.py
    finds its axis in the abstract mesh, as the training step's does)."""
    def jit_model(fn, **kw):
        @functools.wraps(fn)
        def in_mesh(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)

        return jax.jit(in_mesh, **kw)

    return jit_model


def _prefill_fns(cfg: ModelConfig, m: int, jit_model, blk: NamedSharding) -> dict:
    """A prompt's k/v blocks: from nothing, after a prefix block, chunk by chunk into a buffer; and fit."""
    # The prefills take recorded routing (PrefillInput.routing; None traces the plain forward): the engine
    # records and never replays sampled tokens, but a recomputed cache replays what decode chose.
    replay_cfg = cfg.replace(routing_replay=cfg.num_experts > 0)
    # Several LoRA adapters over the base (serving/lora_weights.py, unmerged): each prefill runs its call's
    # adapter (``adapter=``), each decode step every slot's own (DecodeState.adapter_S).

    def prefill_new(params, tokens_T, n, routing_TxR=None, adapter=None):
        logits, kv = mdecode.prefill(params, replay_cfg, tokens_T, true_length=n, routing_TxR=routing_TxR,
                                     adapter=adapter)
        return kv.k, kv.v

    def prefill_on(params, tokens_T, n, pk, pv, c, routing_TxR=None, adapter=None):
        _, kv = mdecode.prefill(params, replay_cfg, tokens_T, prefix=mdecode.KV(pk, pv), start_pos=c, true_length=n,
                                routing_TxR=routing_TxR, adapter=adapter)
        t = tokens_T.shape[0]
        lb = min(pk.shape[1] + t, m)
        pad = jnp.zeros((pk.shape[0], t) + pk.shape[2:], pk.dtype)
        k = jax.lax.dynamic_update_slice(jnp.concatenate([pk, pad], 1), kv.k.astype(pk.dtype), (0, c, 0, 0))
        v = jax.lax.dynamic_update_slice(jnp.concatenate([pv, pad], 1), kv.v.astype(pv.dtype), (0, c, 0, 0))
        return k[:, :lb], v[:, :lb]

    def prefill_into(params, tokens_T, n, k, v, c, routing_TxR=None, adapter=None):  # one chunk of a long prompt
        _, kv = mdecode.prefill_into(params, replay_cfg, tokens_T, mdecode.KV(k, v), c, true_length=n,
                                     routing_TxR=routing_TxR, adapter=adapter)
        return kv.k, kv.v

    def fit(k, v, lb):  # fresh buffers of static length lb (JetStream deletes prefixes after insert)
        if k.shape[1] >= lb:
            return k[:, :lb] + 0, v[:, :lb] + 0
        pad = [(0, 0), (0, lb - k.shape[1]), (0, 0), (0, 0)]
        return jnp.pad(k, pad), jnp.pad(v, pad)

    return {"prefill_new": jit_model(prefill_new, out_shardings=(blk, blk)),
            "prefill_on": jit_model(prefill_on, out_shardings=(blk, blk)),
            "prefill_into": jit_model(prefill_into, donate_argnums=(3, 4), out_shardings=(blk, blk)),
            "fit": jax.jit(fit, static_argnums=2, out_shardings=(blk, blk))}


def _slot_fns(cfg: ModelConfig, m: int, slots: int, paged: tuple[int, int] | None, ds_s, blk: NamedSharding) -> dict:
    """What changes one slot of the decode state (insert, stop, hold, page table) or reads it (export, gather)."""
    def insert(ds, k, v, si, sf, stop_N, slot, row_P=None, shared=None):  # arrays only: a Prefix's request_id
        if paged is None:  # would key the jit cache
            cache = mdecode.insert(ds.cache, mdecode.KV(k, v), slot, start=0, length=si[0])
        else:  # the slot's page-table row from the host; tokens before ``shared`` are on shared pages
            cache = ds.cache.replace(page_table=ds.cache.page_table.at[slot].set(row_P))
            cache = mdecode.insert_paged(cache, mdecode.KV(k, v), slot, start=0, length=si[0], shared=shared)
        return ds.replace(
            cache=cache, next_tok_S=ds.next_tok_S.at[slot].set(si[1]), generated_S=ds.generated_S.at[slot].set(si[2]),
            max_tokens_S=ds.max_tokens_S.at[slot].set(si[3]), seed_S=ds.seed_S.at[slot].set(si[4]),
            temperature_S=ds.temperature_S.at[slot].set(sf[0]), top_p_S=ds.top_p_S.at[slot].set(sf[1]),
            stop_SxN=ds.stop_SxN.at[slot].set(stop_N), active_S=ds.active_S.at[slot].set(True),
            held_S=ds.held_S.at[slot].set(False), hold_steps_S=ds.hold_steps_S.at[slot].set(0),
            adapter_S=ds.adapter_S.at[slot].set(si[5]))

    def stop_slot(ds, slot):  # neither generating nor held: JetStream frees it after the next step
        return ds.replace(active_S=ds.active_S.at[slot].set(False), held_S=ds.held_S.at[slot].set(False))

    def hold_slot(ds, slot, generated):  # a call waiting for pages: its slot is kept (held: no token, valid),
        # never expires, and reports the call's own token count (JetStream ends a request past max_tokens)
        return ds.replace(active_S=ds.active_S.at[slot].set(False), held_S=ds.held_S.at[slot].set(True),
                          hold_steps_S=ds.hold_steps_S.at[slot].set(-(2**30)),
                          generated_S=ds.generated_S.at[slot].set(generated))

    def stop_slots(ds, mask_S):
        return ds.replace(active_S=ds.active_S & ~mask_S, held_S=ds.held_S & ~mask_S)

    def set_table(ds, table_SxP):
        return ds.replace(cache=ds.cache.replace(page_table=table_SxP))

    def export_slot(ds, slot, lb):
        if paged is not None:  # the slot's pages (those holding its first lb tokens), gathered
            kv = mdecode.paged_slot_kv(ds.cache, slot, lb)
            return kv.k, kv.v
        sh = (1, lb, cfg.n_kv_heads, cfg.head_dim)
        k = jnp.stack([jax.lax.dynamic_slice(c, (slot, 0, 0, 0), sh)[0] for c in ds.cache.k])
        v = jnp.stack([jax.lax.dynamic_slice(c, (slot, 0, 0, 0), sh)[0] for c in ds.cache.v])
        return k, v

    def gather(ds, pages_P):  # a cached prefix's pages as one contiguous block (for a prefill to attend to)
        k = jnp.stack([mdecode.gather_pages(c, pages_P[None])[0] for c in ds.cache.k])
        v = jnp.stack([mdecode.gather_pages(c, pages_P[None])[0] for c in ds.cache.v])
        return k, v

    return {"insert": jax.jit(insert, donate_argnums=0, out_shardings=ds_s),
            "stop_slot": jax.jit(stop_slot, donate_argnums=0, out_shardings=ds_s),
            "stop_slots": jax.jit(stop_slots, donate_argnums=0, out_shardings=ds_s),
            "hold_slot": jax.jit(hold_slot, donate_argnums=0, out_shardings=ds_s),
            "export": jax.jit(export_slot, static_argnums=2, out_shardings=(blk, blk)),
            "set_table": jax.jit(set_table, donate_argnums=0, out_shardings=ds_s),
            "gather": jax.jit(gather, out_shardings=(blk, blk)),
            "make_state": jax.jit(functools.partial(_empty_state, cfg, m, slots, paged), out_shardings=ds_s)}


def _empty_state(cfg: ModelConfig, m: int, slots: int, paged: tuple[int, int] | None) -> DecodeState:
    z = jnp.zeros((slots,), jnp.int32)
    f = jnp.zeros((slots,), bool)
    cache = (mdecode.init_cache(cfg, slots, m) if paged is None
             else mdecode.init_paged_cache(cfg, slots, paged[0], paged[1], m))
    return DecodeState(cache, z, z, z, z, jnp.zeros((slots,), jnp.float32),
                       jnp.ones((slots,), jnp.float32), jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32), f, f, z, z)


def _decode_fns(cfg: ModelConfig, m: int, slots: int, k_steps: int, paged: tuple[int, int] | None, jit_model,
                ds_s, rep: NamedSharding) -> dict:
    """``generate`` (k_steps decode steps of every slot, one program) and ``pause`` (a call without decoding)."""
    layout = RoutingLayout.of(cfg)
    w = layout.step_cols  # result columns per decode step
    one_step = _one_step(cfg, m, paged, layout)

    def generate(params, ds):
        """k_steps decode steps in one program. Per slot the result row is
        [tok_1, lp_1, (routing words), ..., tok_k, lp_k, (..) | valid x w*k | generated]: JetStream
        reads the w*k entries as "speculative" tokens, in order, stopping at an invalid one."""
        if k_steps == 1:
            ds, ys = one_step(params, ds)
            ys = tuple(y[None] for y in ys)
        else:
            ds, ys = jax.lax.scan(lambda d, _: one_step(params, d), ds, None, length=k_steps)
        cols_KxSxW, valid_KxS = ys
        cols_SxKW = jnp.transpose(cols_KxSxW, (1, 0, 2)).reshape(slots, w * k_steps)
        valid_SxKW = jnp.repeat(valid_KxS.T, w, axis=1)
        # Last column (ignored by JetStream): still generating after this call.
        return ds, jnp.concatenate([cols_SxKW, valid_SxKW, ds.generated_S[:, None],
                                    ds.active_S.astype(jnp.int32)[:, None]], axis=1)

    def pause(ds):  # no decode this call: live slots report "no token", released ones are freed
        valid_S = (ds.active_S | ds.held_S).astype(jnp.int32)
        row = jnp.concatenate([jnp.full((slots, w * k_steps), HELD_MARK, jnp.int32),
                               jnp.repeat(valid_S[:, None], w * k_steps, axis=1), ds.generated_S[:, None],
                               ds.active_S.astype(jnp.int32)[:, None]], axis=1)
        return row

    return {"generate": jit_model(generate, donate_argnums=1, out_shardings=(ds_s, rep)),
            "pause": jax.jit(pause, out_shardings=rep)}


def _one_step(cfg: ModelConfig, m: int, paged: tuple[int, int] | None, layout: RoutingLayout):
    """One decode step of every slot: (new state, (result columns [S, w], valid [S]))."""
    multi = cfg.lora is not None and cfg.lora.num_adapters > 1

    def one_step(params, ds):
        step = mdecode.decode_step if paged is None else mdecode.paged_decode_step
        routed = step(params, cfg, ds.next_tok_S, ds.cache, active_S=ds.active_S, with_routing=layout.width > 0,
                      adapter_S=ds.adapter_S if multi else None)
        logits, cache = routed[:2]
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
        new = ds.replace(cache=cache, next_tok_S=jnp.where(act_S, tok_S, ds.next_tok_S), generated_S=gen_S,
                         active_S=act_S & ~ended_S, held_S=still_held_S | (ended_S & ~full_S),
                         hold_steps_S=jnp.where(still_held_S, ds.hold_steps_S + 1, 0))
        cols_SxW = jnp.stack([out_S, lp_bits_S], axis=-1)
        if layout.width:  # the experts that produced this token, beside it (module docstring)
            cols_SxW = jnp.concatenate([cols_SxW, layout.pack(routed[2])], axis=-1)
        return new, (cols_SxW, valid_S)

    return one_step
