"""Decoder-only transformer (Llama/Qwen family) reading packed prefix-sharing trees.

Shapes: B rows, L (or T) tokens per row, D d_model, V vocab, N query heads,
K k/v heads, H head_dim, S cache length, Y layers.

Layers are stacked with ``nn.scan`` (params get a leading 'layers' axis), so
compile time does not grow with depth.

Entry points (``Transformer(config).apply(params, ...)``):
  * ``__call__(tokens, positions, segment_ids, subtree_end)`` -> logits_BxLxV
    (float32), or with ``return_hidden=True`` -> (hidden_BxLxD, unembed_DxV) so a
    loss can form log-probs chunk by chunk without materialising all logits.
  * ``method=Transformer.with_cache`` -> forward over T new tokens that writes
    their k/v into a per-row cache and attends over it (decode.py builds on it).

Both check their inputs' shapes and integer dtypes with chex at trace time (no
cost per step; an AssertionError names the argument).
"""
from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from gyre_jax.model.attention import Attention, tree_attention_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import MLP, RMSNorm
from gyre_jax.model.lora import COLLECTION as LORA
from gyre_jax.model.lora import DROPOUT_RNG as LORA_DROPOUT
from gyre_jax.model.lora import lora_inputs
from gyre_jax.model.moe import MoE, MoEStats
from gyre_jax.model.paged import PagedMask
from gyre_jax.model.tree_attention import CacheMask, TreeMask

# Logit of a vocab-padding id: finite (p * log p stays 0, a temperature cannot make it -inf
# overflow into NaN) and far below any real logit.
PAD_LOGIT = -1e9


class Block(nn.Module):
    """Pre-norm residual block; the scan body (carry = residual stream).

    ``moe``: the feed-forward is the mixture of experts (model/moe.py), whose routing
    statistics over the ``valid_BxT`` tokens come out beside the cache (None for a dense layer).
    """

    config: ModelConfig
    moe: bool = False

    @nn.compact
    def __call__(self, carry, layer_cache, positions_BxT, mask, cache_index_B, valid_BxT, routing_BxTxK=None,
                 lora_in=None):
        """carry: the residual x_BxTxD, or for the decode step (x, k_all, v_all, layer) with the
        whole stacked cache [Y, B, S, K, H] updated in place (then layer_cache is None).
        ``lora_in``: what the adapted projections read besides their input (model/lora.py)."""
        decode = isinstance(carry, tuple)
        if decode:
            x_BxTxD, k_all, v_all, layer = carry
            layer_cache = (k_all, v_all, layer)
        else:
            x_BxTxD = carry
        y, new_cache = Attention(self.config, name="attn")(
            RMSNorm(self.config, name="attn_norm")(x_BxTxD), positions_BxT, mask, layer_cache, cache_index_B, lora_in
        )
        x = x_BxTxD + y.astype(x_BxTxD.dtype)
        h = RMSNorm(self.config, name="mlp_norm")(x)
        if self.moe:
            y, stats = MoE(self.config, name="moe")(h, valid_BxT, routing_BxTxK, lora_in)
        else:
            y, stats = MLP(self.config, name="mlp")(h, lora_in), None
        x = x + y.astype(x.dtype)
        if decode:
            return (x, *new_cache, layer + 1), stats
        return x, (new_cache, stats)


# What a rematerialised layer saves for the backward pass (the rest is recomputed):
# "full" only the layer's input (the least memory: one [B, L, D] per layer); "save_dots"
# also the matmul outputs without batch dims (projections, MLP), so the backward
# recomputes only norms, RoPE, activations and the attention itself.
_REMAT_POLICY = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _scanned_blocks(config: ModelConfig, length: int):
    block = Block
    if config.remat:  # per layer: the scan body is the checkpointed unit
        block = nn.remat(Block, prevent_cse=False, policy=_REMAT_POLICY[config.remat_policy])
    return nn.scan(
        block,
        variable_axes={"params": 0, LORA: 0},  # LoRA adapters (model/lora.py) stack per layer like the weights
        split_rngs={"params": True, LORA_DROPOUT: True},
        # routing: one [B, T, K] per layer; lora_in: the same for every layer
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0, nn.broadcast),
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class Transformer(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embedding = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")),
            (cfg.padded_vocab, cfg.d_model),
            cfg.jnp_param_dtype,
        )
        if not cfg.tie_embeddings:
            self.unembedding = self.param(
                "unembed",
                nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model**-0.5), ("embed", "vocab")),
                (cfg.d_model, cfg.padded_vocab),
                cfg.jnp_param_dtype,
            )
        # One scanned stack per run of same-kind layers (config.layer_runs): "layers" for every
        # dense model and every all-MoE one, so their param trees and compiled steps are as before.
        self.stacks = tuple(_scanned_blocks(cfg, stop - start)(cfg, moe=moe, name=name)
                            for name, start, stop, moe in cfg.layer_runs())
        self.final_norm = RMSNorm(cfg, name="final_norm")

    def unembed_matrix(self, *, padded: bool = False, tempered: bool = True):
        """[D, V] matrix with logits = hidden @ unembed.

        The embedding has ``padded_vocab`` rows (a multiple the mesh splits evenly);
        unless ``padded``, the padding columns are cut off, so a loss sees exactly V.
        """
        cfg = self.config
        u = self.embedding.T if cfg.tie_embeddings else self.unembedding
        if not padded and cfg.padded_vocab != cfg.vocab_size:
            u = u[:, : cfg.vocab_size]
        if cfg.logits_temperature != 1.0 and tempered:  # hidden @ (U / T) = logits / T (ModelConfig.logits_temperature)
            u = u / cfg.logits_temperature
        return u.astype(cfg.jnp_dtype)

    def embed_tokens(self, tokens_BxT):
        return jnp.take(self.embedding, tokens_BxT, axis=0).astype(self.config.jnp_dtype)

    def head_logits(self, hidden_BxTxD):
        """[B, T, padded_vocab] float32 logits; padding ids get PAD_LOGIT so nothing samples them."""
        cfg = self.config
        if cfg.tie_embeddings:  # against the [V, D] table as stored: through .T, XLA:CPU copied all of it
            # transposed at every call (a decode step of the ~100M model read and wrote 100 MB more)
            logits = jnp.einsum("btd,vd->btv", hidden_BxTxD, self.embedding.astype(cfg.jnp_dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum(
                "btd,dv->btv", hidden_BxTxD, self.unembed_matrix(padded=True, tempered=False), preferred_element_type=jnp.float32
            )
        if cfg.logits_temperature != 1.0:
            logits = logits / cfg.logits_temperature
        if cfg.padded_vocab != cfg.vocab_size:
            real_V = jnp.arange(cfg.padded_vocab) < cfg.vocab_size
            logits = jnp.where(real_V, logits, PAD_LOGIT)
        return logits

    def __call__(self, tokens_BxL, positions_BxL, segment_ids_BxL, subtree_end_BxL, *, return_hidden=False,
                 routing_BxLxR=None, adapter_BxL=None):
        """Forward over packed rows with the tree attention mask.

        Returns logits_BxLxV (float32), or (hidden_BxLxD, unembed_DxV) if
        ``return_hidden``; then logits = hidden @ unembed. ``routing_BxLxR``: recorded expert
        ids per token (R = config.routing_width: MoE layers x top-k, -1 where none), compared
        with the live routing and, with config.routing_replay, used (model/moe.py).
        ``adapter_BxL``: with several LoRA adapters (config.lora.num_adapters > 1), which one each
        token is trained or scored with (default 0; model/lora.py).
        """
        _check_int_BxL(
            "Transformer", tokens=tokens_BxL, positions=positions_BxL, segment_ids=segment_ids_BxL,
            subtree_end=subtree_end_BxL,
        )
        x = self.embed_tokens(tokens_BxL)
        mask = self._tree_mask(segment_ids_BxL, subtree_end_BxL)
        valid = segment_ids_BxL > 0  # padding (segment 0) is routed but not counted in the MoE statistics
        per_layer = self._routing_per_layer(routing_BxLxR, tokens_BxL.shape)
        lora_in = lora_inputs(self.config.lora, self.config.jnp_dtype, adapter_BxL, tokens_BxL, positions_BxL,
                              training=True)
        for stack, routing in zip(self.stacks, per_layer):
            x, (_, stats) = stack(x, None, positions_BxL, mask, None, valid, routing, lora_in)
            self._sow_moe(stats)
        hidden = self.final_norm(x)
        if return_hidden:
            return hidden, self.unembed_matrix()
        return self.head_logits(hidden)

    def _routing_per_layer(self, routing_BxLxR, shape):
        """Recorded routing [B, L, R] -> one [Y_run, B, L, K] block per stack (None for dense stacks)."""
        cfg = self.config
        runs = cfg.layer_runs()
        if routing_BxLxR is None:
            return [None] * len(runs)
        b, n = shape
        chex.assert_shape(routing_BxLxR, (b, n, cfg.routing_width),
                          custom_message=f"Transformer: routing must be [B, L, MoE layers x top-k = {cfg.routing_width}]")
        k = cfg.num_experts_per_tok
        r_YxBxLxK = jnp.moveaxis(routing_BxLxR.reshape(b, n, cfg.num_moe_layers, k), 2, 0)
        out, m = [], 0
        for _, start, stop, moe in runs:
            out.append(r_YxBxLxK[m: m + stop - start] if moe else None)
            m += stop - start if moe else 0
        return out

    def _tree_mask(self, segment_ids_BxL, subtree_end_BxL):
        """The tree rule in the form config.attention_impl attends with (dense [B, L, L] only for "dense")."""
        cfg = self.config
        if cfg.attention_impl == "dense":
            return tree_attention_mask(segment_ids_BxL, subtree_end_BxL)
        return TreeMask(segment_ids_BxL.astype(jnp.int32), subtree_end_BxL.astype(jnp.int32),
                        block_q=cfg.attention_block_q, block_k=cfg.attention_block_k, impl=cfg.attention_kernel,
                        context_axis=cfg.context_parallel_axis)

    def with_cache(self, tokens_BxT, positions_BxT, mask_BxTxS, k_YxBxSxKxH, v_YxBxSxKxH, cache_index_B,
                   adapter_BxT=None):
        """T new tokens per row against a per-row KV cache.

        Row b's new k/v are written at cache[:, b, cache_index[b] : cache_index[b]+T]
        first; ``mask_BxTxS`` then says which cache entries (old and just written)
        each new token sees: dense booleans [B, T, S], or a ``CacheMask`` (O(T)
        metadata, blockwise; what ``cache_mask(config, ...)`` gives). Returns
        (logits_BxTxV float32, (k_cache, v_cache)). ``adapter_BxT``: as ``__call__``'s ``adapter_BxL``.
        """
        where = "Transformer.with_cache"
        _check_int_BxL(where, tokens=tokens_BxT, positions=positions_BxT)
        cfg = self.config
        b, t = tokens_BxT.shape
        if isinstance(mask_BxTxS, PagedMask):  # k/v are page pools [Y, K, NP, G, H] (paged.py)
            pages = (cfg.n_layers, cfg.n_kv_heads, None, None, cfg.head_dim)
            chex.assert_shape(k_YxBxSxKxH, pages, custom_message=f"{where}: k pages must be [Y, K, NP, G, H]")
            chex.assert_shape(mask_BxTxS.page_table, (b, None), custom_message=f"{where}: page_table must be [B, P]")
            if t != 1:
                raise ValueError(f"{where}: a paged cache takes one token per row (decode), got T={t}")
        else:
            kv_shape = (cfg.n_layers, b, None, cfg.n_kv_heads, cfg.head_dim)
            chex.assert_shape(k_YxBxSxKxH, kv_shape, custom_message=f"{where}: k cache must be [Y, B, S, K, H]")
        chex.assert_shape(v_YxBxSxKxH, k_YxBxSxKxH.shape, custom_message=f"{where}: v cache must match the k cache")
        s = k_YxBxSxKxH.shape[2]
        if isinstance(mask_BxTxS, PagedMask):
            pass
        elif isinstance(mask_BxTxS, CacheMask):
            chex.assert_shape(mask_BxTxS.q_index, (b, t), custom_message=f"{where}: CacheMask.q_index must be [B, T]")
        else:
            chex.assert_shape(mask_BxTxS, (b, t, s), custom_message=f"{where}: mask must be [B, T, S]")
            chex.assert_type(mask_BxTxS, bool, custom_message=f"{where}: mask must be boolean")
        chex.assert_shape(cache_index_B, (b,), custom_message=f"{where}: cache_index must be [B]")
        x = self.embed_tokens(tokens_BxT)
        lora_in = lora_inputs(cfg.lora, cfg.jnp_dtype, adapter_BxT, tokens_BxT, positions_BxT)
        if t == 1 and not isinstance(mask_BxTxS, (CacheMask, PagedMask)):
            # Decode: the scan carries the whole stacked cache and each layer writes its new
            # entry in place (the layer index runs on across stacks). Scanning over the cache
            # instead slices each layer out, writes a new stacked buffer and copies it: several
            # times the bytes of the cache per token.
            carry = (x, k_YxBxSxKxH, v_YxBxSxKxH, jnp.int32(0))
            for stack in self.stacks:
                carry, stats = stack(carry, None, positions_BxT, mask_BxTxS, cache_index_B, None, None, lora_in)
                self._sow_moe(stats)
            x, k, v, _ = carry
            return self.head_logits(self.final_norm(x)), (k, v)
        runs = cfg.layer_runs()
        if len(runs) == 1:  # one stack: the whole cache in and out, no copies
            x, ((k, v), stats) = self.stacks[0](x, (k_YxBxSxKxH, v_YxBxSxKxH), positions_BxT, mask_BxTxS,
                                                cache_index_B, None, None, lora_in)
            self._sow_moe(stats)
            return self.head_logits(self.final_norm(x)), (k, v)
        ks, vs = [], []
        for stack, (_, start, stop, _) in zip(self.stacks, runs):
            x, ((k, v), stats) = stack(x, (k_YxBxSxKxH[start:stop], v_YxBxSxKxH[start:stop]), positions_BxT,
                                       mask_BxTxS, cache_index_B, None, None, lora_in)
            self._sow_moe(stats)
            ks.append(k)
            vs.append(v)
        return self.head_logits(self.final_norm(x)), (jnp.concatenate(ks), jnp.concatenate(vs))

    def _sow_moe(self, stats):
        """MoE layers' routing statistics into the "intermediates" collection, one [Y_run, E] entry per stack
        (``moe_stats`` joins them); a no-op unless the caller applies with mutable=["intermediates"]."""
        if stats is not None:
            self.sow("intermediates", "moe_stats", stats)


def moe_stats(intermediates) -> MoEStats | None:
    """The MoE layers' statistics ([Y_moe, E]) from ``apply(..., mutable=["intermediates"])``'s second output."""
    parts = intermediates.get("intermediates", {}).get("moe_stats", ())
    if not parts:
        return None
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def cache_mask(config: ModelConfig, q_index_BxT, cache_len: int):
    """``with_cache``'s mask where query t sees cache entries 0..q_index[t]: a CacheMask
    (blockwise, O(T)) or, for attention_impl="dense", dense [B, T, cache_len] booleans."""
    if config.attention_impl == "dense":
        return jnp.arange(cache_len, dtype=jnp.int32)[None, None, :] <= q_index_BxT[:, :, None]
    return CacheMask(q_index_BxT.astype(jnp.int32), block_q=config.attention_block_q,
                     block_k=config.attention_block_k, impl=config.attention_kernel)


def _check_int_BxL(where, **named):
    """Integer [B, L] inputs of one shape; the error names the argument (trace time only)."""
    first, x0 = next(iter(named.items()))
    chex.assert_rank(x0, 2, custom_message=f"{where}: {first} must be [B, L]")
    for name, x in named.items():
        chex.assert_shape(x, x0.shape, custom_message=f"{where}: {name} must be [B, L] like {first}")
        chex.assert_type(x, int, custom_message=f"{where}: {name} must be integers")


def _dummy_inputs():
    z = jnp.zeros((1, 1), jnp.int32)
    return z, z, jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)


def init_boxed(config: ModelConfig, rng):
    """Variables ``{"params": ...}`` with nn.Partitioned boxes (logical axis names attached)."""
    # The params do not depend on how rows are split; init runs on a 1-token row, no mesh. The base
    # alone: a LoRA model's adapters are made by model/lora.py's init_adapter.
    return Transformer(config.replace(context_parallel_axis=None, expert_parallel_axis=None, lora=None)).init(
        rng, *_dummy_inputs())


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, rng):
    """Plain variables ``{"params": ...}`` (arrays) for ``Transformer(config).apply(params, ...)``."""
    return nn.unbox(init_boxed(config, rng))


def param_logical_axes(config: ModelConfig):
    """Pytree (same structure as init_params) of PartitionSpecs of logical axis names."""
    abstract = jax.eval_shape(functools.partial(init_boxed, config), jax.random.key(0))
    return nn.get_partition_spec(abstract)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
