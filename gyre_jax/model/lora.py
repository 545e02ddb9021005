"""LoRA adapters on the attention and MLP projections (experts included), one or several per base.

A projection ``y = x @ W`` becomes ``y = x @ W + s * (dropout(x) @ A) @ B`` with A [in, r]
(PEFT's init: uniform in +-1/sqrt(fan_in)), B [r, out] (zeros: a fresh adapter is the base
exactly) and ``s = alpha / r`` (``alpha / sqrt(r)`` with ``rslora``). The base W never changes.

Where things live:

* ``ModelConfig.lora`` (a ``LoraConfig``) tells the model's modules which projections carry
  adapters (``targets``, PEFT's module names; on an MoE layer ``gate_proj``/``up_proj``/
  ``down_proj`` adapt every expert, each its own A and B; the router never). Their A and B
  are variables of a second Flax collection, ``"lora"``, beside ``"params"``: the base's
  tree is the plain model's, so checkpoints, engines and HF loading see no difference.
* An adapter, as trained, checkpointed and moved, is ``{"lora": {...}}`` with each stack's
  arrays [Y, ...] (``init_adapter``); ``init_adapters`` gives the run's ``num_adapters`` of
  them as a tuple (multi-LoRA: each adapter its own task set and optimizer state, one base).
* ``effective(config, adapters)`` is what the model applies: the adapters concatenated along
  the rank axis (R = num_adapters x r) and each B multiplied by its layer's scale (s, or 0 for
  a layer outside ``layers``). Gradients flow through it into every adapter; a layer left out
  gets exactly zero.
* ``LoraInputs`` reaches every block: with several adapters, which adapter each token belongs
  to as a [B, T, R] mask of its adapter's rank block (``rank_mask``; the same code serves
  training, where a row mixes rollouts of several adapters, and decode, one adapter per slot);
  with dropout, a per-row seed, so a row's dropout mask does not depend on which micro-batch
  or cell it lands in (invariant 3: the gradient must not depend on the split).

``merge(config, base, adapter)`` folds one adapter into the base weights (float32 sums, cast to
the base's dtype): the dense model with merged weights computes what the adapted model does
(tests/test_lora.py checks forward and backward against a float64 reference).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# PEFT's module names of the projections an adapter may sit on, and our params' names for them.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_NAME = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
               "up_proj": "up", "down_proj": "down"}
RANK_AXIS = "lora_rank"  # logical axis of the rank (sharding.RULES: replicated)
COLLECTION = "lora"
DROPOUT_RNG = "lora_dropout"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Rank, scale, dropout, which projections and layers, how many adapters over one base."""

    rank: int
    alpha: float = 32.0  # the update is (alpha / rank) * x @ A @ B
    dropout: float = 0.0  # on the adapter's input, training only
    targets: tuple[str, ...] = TARGETS  # PEFT module names; gate/up/down_proj cover MoE experts too
    layers: tuple[int, ...] = ()  # layer indices that carry adapters; () = every layer
    num_adapters: int = 1  # adapters trained and served over the one base (multi-LoRA)
    rslora: bool = False  # scale alpha / sqrt(rank) (rank-stabilized LoRA) instead of alpha / rank

    def __post_init__(self):
        w = "LoraConfig"
        for name in ("rank", "num_adapters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{w}.{name} must be an int >= 1, got {v!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"{w}.alpha must be > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{w}.dropout must be in [0, 1), got {self.dropout!r}")
        targets = tuple(self.targets)
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"{w}.targets must be distinct names from {TARGETS}, got {targets!r}"
                             + (f" ({bad} unknown)" if bad else ""))
        object.__setattr__(self, "targets", targets)
        layers = tuple(self.layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) or \
                len(set(layers)) != len(layers):
            raise ValueError(f"{w}.layers must be distinct layer indices >= 0, got {layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def modules(self) -> frozenset[str]:
        """Our params' names of the adapted projections (q, k, v, o, gate, up, down)."""
        return frozenset(MODULE_NAME[t] for t in self.targets)

    def layer_scale(self, n_layers: int) -> np.ndarray:
        """[Y] float32: the scale of each layer's update, 0 where the layer carries no adapter."""
        on = np.ones((n_layers,), bool) if not self.layers else np.isin(np.arange(n_layers), self.layers)
        return np.where(on, self.scale, 0.0).astype(np.float32)

    def check_model(self, model) -> None:
        """What this adapter config cannot do on ``model`` (a ModelConfig), as a ValueError naming it."""
        w = "LoraConfig"
        if self.layers and self.layers[-1] >= model.n_layers:
            raise ValueError(f"{w}.layers={self.layers}: the model has {model.n_layers} layers (0..{model.n_layers - 1})")
        experts = model.num_experts > 0 and bool(self.modules & {"gate", "up", "down"})
        if experts and self.dropout and model.num_moe_layers:
            raise ValueError(f"{w}.dropout={self.dropout} on MoE experts is not covered (the experts' inputs are "
                             "dispatched per (token, expert) pair): set dropout=0, or leave gate/up/down_proj out of "
                             "targets")
        if experts and self.num_adapters > 1 and model.expert_parallel_axis is not None:
            raise ValueError(f"{w}.num_adapters={self.num_adapters} on expert-parallel MoE experts is not covered "
                             "(a token's adapter would have to travel with it in the all-to-all): use one adapter, "
                             "train_expert=1, or leave gate/up/down_proj out of targets")
        if self.dropout and model.context_parallel_axis is not None:
            raise ValueError(f"{w}.dropout with context parallelism is not covered (a row's mask is drawn per row)")


@flax.struct.dataclass
class LoraInputs:
    """What every adapted projection reads beside its input (None fields: not needed)."""

    rank_mask_BxTxR: jax.Array | None = None  # several adapters: 1 on the rank block of each token's adapter
    row_seed_B: jax.Array | None = None  # dropout: one seed per row (a mask independent of the row's micro-batch)


def rank_mask(adapter_BxT, lora: LoraConfig, dtype) -> jax.Array:
    """[B, T, N*r]: 1 on the r rank columns of each token's adapter, 0 elsewhere (ids out of range: no adapter)."""
    blocks_BxTxN = jax.nn.one_hot(adapter_BxT, lora.num_adapters, dtype=dtype)
    return jnp.repeat(blocks_BxTxN, lora.rank, axis=-1)


def row_seeds(tokens_BxL, positions_BxL) -> jax.Array:
    """A uint32 seed per row from its tokens and positions: the same row draws the same dropout mask in
    any micro-batch, on any cell (a multiplicative hash, wrapping)."""
    t = tokens_BxL.astype(jnp.uint32)
    p = positions_BxL.astype(jnp.uint32)
    idx = jnp.arange(t.shape[1], dtype=jnp.uint32)[None, :]
    h = (t * jnp.uint32(2654435761)) ^ (p * jnp.uint32(2246822519)) ^ (idx * jnp.uint32(3266489917))
    return jnp.sum(h * jnp.uint32(668265263), axis=1, dtype=jnp.uint32)


def lora_inputs(lora: LoraConfig | None, dtype, adapter_BxT=None, tokens_BxT=None, positions_BxT=None,
                *, training: bool = False) -> LoraInputs | None:
    """The blocks' ``LoraInputs`` (None when no adapter needs any): the rank mask when several adapters
    share the base (``adapter_BxT`` None: every token on adapter 0), row seeds when training with dropout."""
    if lora is None:
        return None
    mask = None
    if lora.num_adapters > 1:
        if adapter_BxT is None:
            adapter_BxT = jnp.zeros(tokens_BxT.shape, jnp.int32)
        mask = rank_mask(adapter_BxT, lora, dtype)
    seeds = row_seeds(tokens_BxT, positions_BxT) if training and lora.dropout else None
    if mask is None and seeds is None:
        return None
    return LoraInputs(rank_mask_BxTxR=mask, row_seed_B=seeds)


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def adapter_weights(module: nn.Module, name: str, in_shape: tuple[int, ...], in_axes: tuple, out_shape: tuple[int, ...],
                    out_axes: tuple):
    """(A [*in, R], B [R, *out]) of projection ``name`` of ``module`` from the "lora" collection, or None if
    the projection carries no adapter. Created at init with one adapter's rank (R = r); at apply R is
    whatever ``effective`` made (N adapters x r)."""
    lora = module.config.lora  # type: ignore[attr-defined]  # every model block carries its ModelConfig
    if lora is None or name not in lora.modules:
        return None
    r = lora.rank
    fan_in = math.prod(in_shape[1:] if in_axes[:1] == ("expert",) else in_shape)

    def make(init, shape, axes):
        box = nn.with_logical_partitioning(init, axes)
        return lambda: box(module.make_rng("params"), shape, jnp.float32)

    a = module.variable(COLLECTION, f"{name}_lora_a", make(_uniform(fan_in**-0.5), (*in_shape, r), (*in_axes, RANK_AXIS)))
    lead = 1 if in_axes[:1] == ("expert",) else 0  # experts: B is [E, r, *out]
    b_shape = (*in_shape[:lead], r, *out_shape)
    b = module.variable(COLLECTION, f"{name}_lora_b", make(nn.initializers.zeros, b_shape,
                                                         (*in_axes[:lead], RANK_AXIS, *out_axes)))
    return nn.unbox(a.value), nn.unbox(b.value)


def dropped(module: nn.Module, x_BxTx_, lora_in: LoraInputs | None):
    """The adapter's input: ``x`` with LoRA dropout where training (a "lora_dropout" rng and row seeds given)."""
    lora = module.config.lora  # type: ignore[attr-defined]
    if not lora.dropout or lora_in is None or lora_in.row_seed_B is None or not module.has_rng(DROPOUT_RNG):
        return x_BxTx_
    key = module.make_rng(DROPOUT_RNG)
    keep_p = 1.0 - lora.dropout
    keys_B = jax.vmap(jax.random.fold_in, (None, 0))(key, lora_in.row_seed_B)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, keep_p, x_BxTx_.shape[1:]))(keys_B)
    return jnp.where(keep, x_BxTx_ / keep_p, 0).astype(x_BxTx_.dtype)


def delta(module: nn.Module, x_BxTx_, ab, lora_in: LoraInputs | None, n_in: int):
    """s * dropout(x) @ A @ B for an adapted projection (``ab`` from ``adapter_weights``): ``n_in`` trailing
    dims of x are the projection's input; the scale is already in B (``effective``)."""
    dt = x_BxTx_.dtype
    a, b = ab
    x = dropped(module, x_BxTx_, lora_in)
    lead = x.ndim - n_in
    xa = jnp.tensordot(x, a.astype(dt), axes=(list(range(lead, x.ndim)), list(range(n_in))))
    if lora_in is not None and lora_in.rank_mask_BxTxR is not None:
        xa = xa * lora_in.rank_mask_BxTxR.astype(dt)
    return jnp.tensordot(xa, b.astype(dt), axes=([xa.ndim - 1], [0]))


# ---- adapters as trees: init, the effective collection, merging -------------------------------------
def _with_one_adapter(config):
    return config.replace(lora=dataclasses.replace(config.lora, num_adapters=1),
                          context_parallel_axis=None, expert_parallel_axis=None)


def init_adapter_boxed(config, rng):
    """One adapter ``{"lora": ...}`` with nn.Partitioned boxes (logical axes), for ``StateSpec``."""
    from gyre_jax.model.transformer import Transformer, _dummy_inputs

    if config.lora is None:
        raise ValueError("init_adapter: the model config has no lora")
    variables = Transformer(_with_one_adapter(config)).init(rng, *_dummy_inputs())
    return {COLLECTION: variables[COLLECTION]}


@functools.partial(jax.jit, static_argnums=0)
def init_adapter(config, rng):
    """One fresh adapter ``{"lora": ...}`` (B = 0: the base model exactly); the base's init is dead code here."""
    return nn.unbox(init_adapter_boxed(config, rng))


def init_adapters(config, rng) -> tuple:
    """The run's ``config.lora.num_adapters`` fresh adapters, each from its own key."""
    return tuple(init_adapter(config, jax.random.fold_in(rng, a)) for a in range(config.lora.num_adapters))


@functools.lru_cache(maxsize=64)
def adapter_logical_axes(config):
    """PartitionSpec tree of logical names of one adapter (``{"lora": ...}``)."""
    abstract = jax.eval_shape(functools.partial(init_adapter_boxed, config), jax.random.key(0))
    return nn.get_partition_spec(abstract)


def _stack_layers(config) -> dict[str, tuple[int, int]]:
    return {name: (start, stop) for name, start, stop, _ in config.layer_runs()}


def _leaves_with_axes(config, adapter):
    """[(path keys, leaf, logical axes)] of one adapter tree."""
    logical = adapter_logical_axes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapter)
    axes = treedef.flatten_up_to(logical)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef stub omits it
    return leaves, treedef, axes


def effective(config, adapters) -> dict:
    """The "lora" collection the model applies: ``adapters`` (a tuple of ``{"lora": ...}``, one per adapter)
    joined along the rank axis, each B times its layer's scale (module docstring)."""
    if isinstance(adapters, dict):
        adapters = (adapters,)
    scale_Y = jnp.asarray(config.lora.layer_scale(config.n_layers))
    stacks = _stack_layers(config)
    first, treedef, axes = _leaves_with_axes(config, adapters[0])
    per_adapter = [treedef.flatten_up_to(a) for a in adapters]  # type: ignore[attr-defined]
    out = []
    for i, ((path, _), spec) in enumerate(zip(first, axes)):
        rank_axis = tuple(spec).index(RANK_AXIS)
        parts = [leaves[i] for leaves in per_adapter]
        x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=rank_axis)
        if path[-1].key.endswith("_lora_b"):
            start, stop = stacks[path[1].key]
            s = scale_Y[start:stop].astype(x.dtype)
            x = x * s.reshape((-1,) + (1,) * (x.ndim - 1))
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)[COLLECTION]


def variables(config, base, adapters) -> dict:
    """``{"params": base, "lora": effective(adapters)}``: what ``Transformer(config).apply`` takes."""
    return {"params": base["params"], COLLECTION: effective(config, adapters)}


def _targets_of(config, base, adapter):
    """(stack, module, name, W [Y, *lead, *in, *out], A [Y, *lead, *in, r], B [Y, *lead, r, *out]) per
    adapted projection, with B already scaled (``effective``)."""
    eff = effective(config, (adapter,))
    for stack, mods in eff.items():
        for mod, names in mods.items():
            for key in names:
                if key.endswith("_lora_a"):
                    name = key[: -len("_lora_a")]
                    yield (stack, mod, name, base["params"][stack][mod][name], names[key],
                           names[name + "_lora_b"])


def delta_weight(a, b, *, experts: bool):
    """A @ B as a weight [Y, *lead, *in, *out] in float32 (lead: the experts axis of an MoE layer)."""
    lead = 2 if experts else 1
    in_shape, out_shape = a.shape[lead:-1], b.shape[lead + 1:]
    a2 = a.astype(jnp.float32).reshape(*a.shape[:lead], math.prod(in_shape), a.shape[-1])
    b2 = b.astype(jnp.float32).reshape(*b.shape[:lead + 1], math.prod(out_shape))
    return jnp.matmul(a2, b2).reshape(*a.shape[:lead], *in_shape, *out_shape)


def merge(config, base, adapter) -> dict:
    """``{"params": ...}`` with one adapter folded in: W + s * A @ B per adapted projection, summed in
    float32 and stored in W's dtype. The base tree is not modified."""
    params = jax.tree.map(lambda x: x, base["params"])  # a new tree (same leaves) to rebuild in place
    for stack, mod, name, w, a, b in _targets_of(config, base, adapter):
        d = delta_weight(a, b, experts=mod == "moe")
        params[stack][mod][name] = (w.astype(jnp.float32) + d).astype(w.dtype)
    return {"params": params}


def adapter_bytes(adapters) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(adapters))


def count_adapter_params(config) -> int:
    """Trainable parameters of one adapter (abstractly: no arrays made)."""
    abstract = jax.eval_shape(functools.partial(init_adapter_boxed, config), jax.random.key(0))
    return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(abstract)))

