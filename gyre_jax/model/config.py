"""Model configuration: one frozen, validated dataclass.

Field names follow the Llama/Qwen family so a real checkpoint's config maps onto
it one field at a time (hidden_size -> d_model, intermediate_size -> d_ff, ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from gyre_jax.model.lora import LoraConfig

ROPE_SCALINGS = ("none", "llama3")
REMAT_POLICIES = ("full", "save_dots")  # what a rematerialised layer keeps (transformer._REMAT_POLICY)
MOE_IMPLS = ("ragged", "dense")  # ragged: grouped matmuls over tokens sorted by expert; dense: every expert on every token (reference)
ATTENTION_IMPLS = ("blockwise", "dense")  # blockwise: tree_attention.py (O(L) memory); dense: [B, L, L] reference
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads // n_kv_heads query heads share one k/v head
    head_dim: int
    d_ff: int  # SwiGLU hidden width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True  # unembedding = embedding.T (Qwen small models, Gemma) or its own matrix (Llama)
    dtype: str = "float32"  # activations and matmul inputs; softmax, norms and logits stay float32
    param_dtype: str = "float32"  # stored parameters
    max_seq_len: int = 4096  # longest path position the model is meant to see; default KV-cache length
    remat: bool = False  # recompute each layer's activations in the backward pass, at any row length
    remat_policy: str = "full"  # per rematerialised layer: "full" keeps only its input; "save_dots" also its matmuls
    # Training rows at least this long get per-layer remat and the chunked vocab projection
    # automatically (gyre_jax.cells.loss.memory_plan); 0 = never automatically (then only `remat`).
    long_row_len: int = 8192
    attention_impl: str = "blockwise"  # one of ATTENTION_IMPLS; both give the same result
    attention_block_q: int = 512  # blockwise: queries per tile
    attention_block_k: int = 512  # blockwise: keys per tile (a tile the tree masks entirely is skipped)
    attention_kernel: str = "xla"  # blockwise: "xla" (pure JAX) | "pallas" (GPU/TPU kernel, untested there) | "pallas_interpret"
    context_parallel_axis: str | None = None  # blockwise: mesh axis the rows' sequence is split over (jax.set_mesh)
    # Checkpoint-family features (gyre_jax.model.hf maps a config.json onto these):
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2/Qwen2.5)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    rope_scaling: str = "none"  # "none" (plain theta) | "llama3" (Llama-3.1+ frequency-dependent scaling)
    rope_factor: float = 1.0  # llama3 scaling: factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low_freq_factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high_freq_factor
    rope_original_max_len: int = 8192  # llama3 scaling: original_max_position_embeddings
    vocab_pad_multiple: int = 1  # embedding rows padded to a multiple of this (the mesh's vocab split); padded logits masked
    # The policy is softmax(logits / T): engines sample it at temperature 1 and training scores the same
    # distribution (a rollout sampled at temperature T from the T=1 model would be off-policy for a T=1 loss).
    logits_temperature: float = 1.0
    # Mixture of experts (Qwen3-MoE's names; model/moe.py). num_experts == 0: every layer is the dense MLP.
    num_experts: int = 0  # experts per MoE layer
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # SwiGLU hidden width of one expert
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE: true)
    mlp_only_layers: tuple[int, ...] = ()  # layer indices that keep the dense MLP
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 (and not in mlp_only_layers)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss the train loss adds (HF: 0.001)
    moe_impl: str = "ragged"  # one of MOE_IMPLS; both give the same result
    expert_parallel_axis: str | None = None  # mesh axis the experts are split over (jax.set_mesh); None: no dispatch
    # Rollout routing replay (R3, model/moe.py): a forward given recorded routing uses those experts
    # where recorded (the router's live probabilities still weight them); False: it only compares.
    routing_replay: bool = False
    # LoRA adapters on the projections (model/lora.py): their A and B live in the "lora" collection
    # beside the base's "params"; None = the plain model.
    lora: LoraConfig | None = None

    def __post_init__(self):
        where = "ModelConfig"
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len",
                     "attention_block_q", "attention_block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{where}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{where}.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"{where}.rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"{where}.norm_eps must be > 0, got {self.norm_eps}")
        if not self.logits_temperature > 0:
            raise ValueError(f"{where}.logits_temperature must be > 0, got {self.logits_temperature}")
        if self.attention_kernel not in ("xla", "pallas", "pallas_interpret"):
            raise ValueError(f"{where}.attention_kernel must be 'xla', 'pallas' or 'pallas_interpret', "
                             f"got {self.attention_kernel!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"{where}.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        lr = self.long_row_len
        if not isinstance(lr, int) or isinstance(lr, bool) or lr < 0:
            raise ValueError(f"{where}.long_row_len must be an int >= 0 (0 = no automatic remat), got {lr!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{where}.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"{where}.rope_scaling must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and not (
            self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_len > 0
        ):
            raise ValueError(
                f"{where}: llama3 rope scaling needs rope_factor >= 1, 0 < rope_low_freq_factor < "
                f"rope_high_freq_factor and rope_original_max_len > 0, got factor={self.rope_factor}, "
                f"low={self.rope_low_freq_factor}, high={self.rope_high_freq_factor}, "
                f"original_max_len={self.rope_original_max_len}"
            )
        v = self.vocab_pad_multiple
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}.vocab_pad_multiple must be a positive int, got {v!r}")
        self._check_moe(where)
        if self.lora is not None:
            if not isinstance(self.lora, LoraConfig):
                raise ValueError(f"{where}.lora must be a LoraConfig or None, got {type(self.lora).__name__}")
            self.lora.check_model(self)
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{where}.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

    def _check_moe(self, where):
        e, k = self.num_experts, self.num_experts_per_tok
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}.{name} must be an int >= 0, got {v!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"{where}.moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if not isinstance(self.mlp_only_layers, tuple) or not all(
                isinstance(i, int) and 0 <= i < self.n_layers for i in self.mlp_only_layers):
            raise ValueError(f"{where}.mlp_only_layers must be a tuple of layer indices in [0, {self.n_layers}), "
                             f"got {self.mlp_only_layers!r}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"{where}.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")
        if e == 0:
            return
        if not 0 < k <= e:
            raise ValueError(f"{where}.num_experts_per_tok must be in [1, num_experts={e}], got {k}")
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ValueError(f"{where}: an MoE model needs moe_intermediate_size > 0 and decoder_sparse_step > 0, got "
                             f"{self.moe_intermediate_size} and {self.decoder_sparse_step}")

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule: layer i routes to experts unless listed in mlp_only_layers or off the sparse step."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def routing_width(self) -> int:
        """Expert ids one token's routing holds (MoE layers x top-k; 0 for a dense model): the
        last dim of a recorded routing array, in layer order, each layer's k ids together."""
        return self.num_moe_layers * self.num_experts_per_tok

    def layer_runs(self) -> tuple[tuple[str, int, int, bool], ...]:
        """(param name, start, stop, is_moe) of each run of consecutive layers of one kind.

        Each run is its own scanned stack (all layers of a scan share one param structure):
        "layers" when every layer is of one kind (every dense model), else "layers_0", "layers_1", ...
        """
        runs: list[list] = []
        for i in range(self.n_layers):
            m = self.is_moe_layer(i)
            if runs and runs[-1][2] == m:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, m])
        if len(runs) == 1:
            return (("layers", *runs[0]),)
        return tuple((f"layers_{r}", *run) for r, run in enumerate(runs))

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding: vocab_size rounded up to vocab_pad_multiple (ids >= vocab_size never occur)."""
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def model_config_tiny(**overrides) -> ModelConfig:
    """A model small enough for unit tests on CPU (a few ms per forward pass)."""
    base: dict[str, Any] = dict(
        vocab_size=128,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        max_seq_len=256,
    )
    base.update(overrides)
    return ModelConfig(**base)
