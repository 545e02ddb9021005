"""Mixture-of-experts feed-forward block (Qwen3-MoE): router, experts, load statistics.

Shapes: N tokens (B*T flattened), D d_model, E experts, K experts per token, F expert
hidden width, P devices on the expert-parallel mesh axis, M = N*K (token, expert) pairs.

Router: softmax over E in float32, the top K (``norm_topk_prob``: renormalised to sum
to 1), as HF's ``Qwen3MoeSparseMoeBlock``. Each token's output is the weighted sum of
its K experts' SwiGLU outputs. No capacity limit: no token is ever dropped, so every
implementation computes the same function:

* ``experts_ragged``: the M pairs sorted by expert and run as grouped matmuls
  (``jax.lax.ragged_dot``): E/K times fewer FLOPs than the dense reference;
* ``experts_dense``: every expert on every token, then masked (the reference in tests);
* ``experts_expert_parallel``: experts split over a mesh axis; inside ``shard_map``
  each device sends its pairs to the device owning the expert (all-to-all), runs its
  local experts as grouped matmuls and sends the results back (all-to-all again).
  Buffers are sized for the worst case (every pair to one device: [P, n*K, D] for n
  local tokens), so no pair can be dropped; a capacity factor would shrink them at the
  cost of exactness and is not done here.

Routing replay (R3, "rollout routing replay"): ``MoE`` may be given recorded routing
[B, T, K] (expert ids the engine chose for each token while sampling, -1 where none was
recorded: prompt tokens are routed live). Each recorded token's top-k set is compared with
the live one (``MoEStats.mismatch``); with ``config.routing_replay`` the recorded experts are
used instead of the live top-k, and their weights are the *live* router probabilities of
those experts (renormalised as ``norm_topk_prob`` says), as R3 does: the expert outputs then
match sampling, while the router still gets a gradient through the weights (and the aux
loss). Replaying the recorded weights too would freeze the router on replayed tokens and
make its gradient vanish exactly where the policy is trained.

Statistics per layer (``MoEStats``): how many pairs went to each expert and the summed
router probability, over real tokens only; ``load_balancing_loss`` turns a stack of
them into HF's auxiliary loss.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import dense_param
from gyre_jax.model.lora import adapter_weights as lora_adapter
from gyre_jax.sharding import RULES


@flax.struct.dataclass
class MoEStats:
    """One layer's routing over real tokens (stacked [Y, ...] by the layer scan)."""

    count_E: jax.Array  # float32: (token, expert) pairs routed to each expert
    prob_E: jax.Array  # float32: summed router probability of each expert
    tokens: jax.Array  # float32 scalar: real tokens routed
    experts: jax.Array | None = None  # int32 [N, K]: the experts each token used (what the engine records)
    mismatch: jax.Array | None = None  # float32 [N]: 1 where recorded routing's set differs from the live top-k


def route(x_NxD, router_DxE, k: int, norm_topk: bool):
    """(probs_NxE float32, weights_NxK float32, experts_NxK int32): softmax over experts, top k."""
    logits = jnp.einsum("nd,de->ne", x_NxD, router_DxE, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w_NxK, idx_NxK = jax.lax.top_k(probs, k)
    if norm_topk:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return probs, w_NxK, idx_NxK.astype(jnp.int32)


def replay_routing(probs_NxE, live_NxK, recorded_NxK, norm_topk: bool, replay: bool):
    """(weights_NxK, experts_NxK, mismatch_N): the recorded experts where a token has them (row of
    ids >= 0) if ``replay``, else the live ones; weights are the live probabilities of the experts
    used. mismatch_N is 1.0 where a recorded token's set of k experts differs from the live top-k."""
    e = probs_NxE.shape[-1]
    has_N = recorded_NxK[:, 0] >= 0
    # Ids come from the host (records); a bad one must not gather out of range inside the step.
    rec_NxK = jnp.clip(recorded_NxK.astype(jnp.int32), 0, e - 1)
    same_N = jnp.all(jnp.sort(live_NxK, axis=-1) == jnp.sort(rec_NxK, axis=-1), axis=-1)
    mismatch_N = (has_N & ~same_N).astype(jnp.float32)
    idx_NxK = jnp.where(has_N[:, None], rec_NxK, live_NxK) if replay else live_NxK
    w_NxK = jnp.take_along_axis(probs_NxE, idx_NxK, axis=-1)
    if norm_topk:
        w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
    return w_NxK, idx_NxK, mismatch_N


class ExpertLora(flax.struct.PyTreeNode):  # PyTreeNode: flax.struct.dataclass with a typed replace()
    """LoRA on the experts (model/lora.py): per projection A [E, in, R] and B [E, R, out] (scale in B, None
    where not adapted), and with several adapters each token's rank mask [N, R]."""

    gate: tuple | None = None
    up: tuple | None = None
    down: tuple | None = None
    mask_NxR: jax.Array | None = None

    def pairs(self, order_M, k: int) -> "ExpertLora":
        """The same adapters with the mask per (token, expert) pair in ``order_M`` (pair m = token m // k)."""
        return self if self.mask_NxR is None else self.replace(mask_NxR=self.mask_NxR[order_M // k])


def _grouped(x_MxI, w_ExIxO, group_sizes_E, ab, mask_MxR):
    y = jax.lax.ragged_dot(x_MxI, w_ExIxO, group_sizes_E)
    if ab is None:
        return y
    a, b = ab
    xa = jax.lax.ragged_dot(x_MxI, a.astype(x_MxI.dtype), group_sizes_E)
    if mask_MxR is not None:
        xa = xa * mask_MxR.astype(xa.dtype)
    return y + jax.lax.ragged_dot(xa, b.astype(xa.dtype), group_sizes_E)


def _swiglu_grouped(x_MxD, gate_ExDxF, up_ExDxF, down_ExFxD, group_sizes_E, lora: ExpertLora | None = None):
    """Rows of x sorted by expert; group_sizes_E rows each. Rows past the groups give zeros.
    ``lora``: the experts' adapters, its mask already per sorted row."""
    if lora is None:
        lora = ExpertLora()
    m = lora.mask_NxR
    h = nn.silu(_grouped(x_MxD, gate_ExDxF, group_sizes_E, lora.gate, m)) * _grouped(
        x_MxD, up_ExDxF, group_sizes_E, lora.up, m)
    return _grouped(h, down_ExFxD, group_sizes_E, lora.down, m)


def _combine(y_MxD, w_NxK):
    """Pairs in token-major order [N*K, D] -> [N, D] weighted sum over each token's K experts."""
    n, k = w_NxK.shape
    return jnp.sum(y_MxD.reshape(n, k, -1) * w_NxK[..., None].astype(y_MxD.dtype), axis=1)


def experts_ragged(x_NxD, w_NxK, idx_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, lora: ExpertLora | None = None):
    """Grouped matmuls over the N*K (token, expert) pairs sorted by expert."""
    n, k = idx_NxK.shape
    e = gate_ExDxF.shape[0]
    flat_M = idx_NxK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    sizes_E = jnp.zeros((e,), jnp.int32).at[flat_M].add(1)
    y_sorted = _swiglu_grouped(x_NxD[order_M // k], gate_ExDxF, up_ExDxF, down_ExFxD, sizes_E,
                               None if lora is None else lora.pairs(order_M, k))
    y_MxD = jnp.zeros_like(y_sorted).at[order_M].set(y_sorted)  # back to token-major pair order
    return _combine(y_MxD, w_NxK)


def _every_expert(x_Nx_, w_ExIxO, ab, mask_NxR, spec_in: str):
    """x through every expert's projection ([E, N, O]), plus its LoRA update; ``spec_in`` names x's axes."""
    y = jnp.einsum(f"{spec_in},eio->eno", x_Nx_, w_ExIxO)
    if ab is None:
        return y
    a, b = ab
    xa = jnp.einsum(f"{spec_in},eir->enr", x_Nx_, a.astype(x_Nx_.dtype))
    if mask_NxR is not None:
        xa = xa * mask_NxR.astype(xa.dtype)[None]
    return y + jnp.einsum("enr,ero->eno", xa, b.astype(xa.dtype))


def experts_dense(x_NxD, w_NxK, idx_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, lora: ExpertLora | None = None):
    """Reference: every expert on every token, weighted by the (mostly zero) routing weights."""
    n, _ = idx_NxK.shape
    e = gate_ExDxF.shape[0]
    comb_NxE = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx_NxK].add(w_NxK)
    if lora is None:
        lora = ExpertLora()
    m = lora.mask_NxR
    h = nn.silu(_every_expert(x_NxD, gate_ExDxF, lora.gate, m, "ni")) * _every_expert(x_NxD, up_ExDxF, lora.up, m, "ni")
    y_ExNxD = _every_expert(h, down_ExFxD, lora.down, m, "eni")
    return jnp.einsum("end,ne->nd", y_ExNxD, comb_NxE.astype(y_ExNxD.dtype))


def _token_axes(mesh, expert_axis: str) -> tuple[str, ...]:
    """Mesh axes the tokens are split over inside the dispatch: the batch rule's axes plus the expert axis."""
    batch = dict(RULES)["batch"]
    batch = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    axes = [a for a in batch if a in mesh.axis_names]
    if expert_axis not in axes:
        axes.append(expert_axis)
    return tuple(axes)


def experts_expert_parallel(x_NxD, w_NxK, idx_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, lora: ExpertLora | None = None,
                            *, axis: str):
    """Experts split over mesh ``axis`` (run under ``jax.set_mesh``); all-to-all dispatch and combine."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(f"expert_parallel_axis={axis!r}: run the model under jax.set_mesh(mesh) with a mesh that "
                         f"has that axis (mesh axes: {tuple(mesh.axis_names)})")
    p = mesh.shape[axis]
    e = gate_ExDxF.shape[0]
    if e % p:
        raise ValueError(f"expert parallelism: {e} experts do not split evenly over the {p} devices of mesh "
                         f"axis {axis!r}")
    tok_axes = _token_axes(mesh, axis)
    shards = 1
    for a in tok_axes:
        shards *= mesh.shape[a]
    n = x_NxD.shape[0]
    pad = -n % shards  # padding tokens (weight 0, expert 0) make N split evenly; cut off below
    if pad:
        x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
        w_NxK = jnp.pad(w_NxK, ((0, pad), (0, 0)))
        idx_NxK = jnp.pad(idx_NxK, ((0, pad), (0, 0)))
    tok, exp = P(tok_axes, None), P(axis, None, None)
    if lora is not None and lora.mask_NxR is not None:  # LoraConfig.check_model refuses it first
        raise ValueError("expert parallelism: several LoRA adapters on the experts are not covered")
    local = functools.partial(_dispatch_local, axis=axis, n_dev=p)
    args = (x_NxD, w_NxK, idx_NxK, gate_ExDxF, up_ExDxF, down_ExFxD) + (() if lora is None else (lora,))
    specs = (tok, tok, tok, exp, exp, exp) + (() if lora is None else (exp,))  # every adapter array is [E, ., .]
    y = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tok)(*args)
    return y[:n]


def _dispatch_local(x_nxD, w_nxK, idx_nxK, gate_ExDxF, up_ExDxF, down_ExFxD, lora=None, *, axis: str, n_dev: int):
    """One device: its n tokens' pairs out to the owners of their experts, local experts, results back.

    Local shapes: El = E/P experts here, m = n*K pairs of its own tokens.
    """
    n, k = idx_nxK.shape
    el = gate_ExDxF.shape[0]
    m = n * k
    flat_m = idx_nxK.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # sorted by expert = grouped by owning device
    x_sorted = x_nxD[order_m // k]
    e_sorted = flat_m[order_m]
    dest_sorted = e_sorted // el
    count_P = jnp.zeros((n_dev,), jnp.int32).at[dest_sorted].add(1)
    start_P = jnp.cumsum(count_P) - count_P
    # Send buffer [P, m, ...]: slot j of destination d holds its j-th pair (j < count[d]); the rest is padding
    # that carries the sentinel expert id El, sorts last on the receiver and is zeroed by ragged_dot.
    j_m = jnp.arange(m, dtype=jnp.int32)
    src_Pxm = jnp.clip(start_P[:, None] + j_m[None, :], 0, m - 1)
    real_Pxm = j_m[None, :] < count_P[:, None]
    send_x = jnp.where(real_Pxm[..., None], x_sorted[src_Pxm], 0)
    send_e = jnp.where(real_Pxm, e_sorted[src_Pxm] - jnp.arange(n_dev, dtype=jnp.int32)[:, None] * el, el)
    recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True).reshape(n_dev * m, -1)
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=True).reshape(n_dev * m)
    order_r = jnp.argsort(recv_e, stable=True)
    sizes_El = jnp.zeros((el,), jnp.int32).at[recv_e].add(1, mode="drop")  # the sentinel El is dropped
    y_sorted = _swiglu_grouped(recv_x[order_r], gate_ExDxF, up_ExDxF, down_ExFxD, sizes_El, lora)
    y_recv = jnp.zeros_like(y_sorted).at[order_r].set(y_sorted).reshape(n_dev, m, -1)
    back_Pxm = jax.lax.all_to_all(y_recv, axis, 0, 0, tiled=True)  # back[d, j]: my j-th pair sent to d
    pos_m = jnp.arange(m, dtype=jnp.int32) - start_P[dest_sorted]
    y_pairs_sorted = back_Pxm[dest_sorted, pos_m]
    y_m = jnp.zeros_like(y_pairs_sorted).at[order_m].set(y_pairs_sorted)
    return _combine(y_m, w_nxK)


_EXPERTS = {"ragged": experts_ragged, "dense": experts_dense}


class MoE(nn.Module):
    """Router + E SwiGLU experts; returns (y_BxTxD, MoEStats over the tokens where ``valid_BxT``).

    ``routing_BxTxK``: recorded expert ids (-1: none recorded) to compare with, and with
    ``config.routing_replay`` to use (module docstring)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, valid_BxT=None, routing_BxTxK=None, lora_in=None):
        cfg = self.config
        dt = cfg.jnp_dtype
        d, e, f, k = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok

        router_DxE = dense_param(self, "router", (d, e), ("embed", None), d)
        gate_ExDxF = dense_param(self, "gate", (e, d, f), ("expert", "embed", "moe_mlp"), d)
        up_ExDxF = dense_param(self, "up", (e, d, f), ("expert", "embed", "moe_mlp"), d)
        down_ExFxD = dense_param(self, "down", (e, f, d), ("expert", "moe_mlp", "embed"), f)
        b, t, _ = x_BxTxD.shape
        x_NxD = x_BxTxD.astype(dt).reshape(b * t, d)
        probs_NxE, w_NxK, idx_NxK = route(x_NxD, router_DxE, k, cfg.norm_topk_prob)
        mismatch_N = jnp.zeros((b * t,), jnp.float32)
        if routing_BxTxK is not None:
            w_NxK, idx_NxK, mismatch_N = replay_routing(probs_NxE, idx_NxK, routing_BxTxK.reshape(b * t, k),
                                                        cfg.norm_topk_prob, cfg.routing_replay)
        if cfg.expert_parallel_axis is not None:
            experts = functools.partial(experts_expert_parallel, axis=cfg.expert_parallel_axis)
        else:
            experts = _EXPERTS[cfg.moe_impl]
        y_NxD = experts(x_NxD, w_NxK.astype(dt), idx_NxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                        self._expert_lora(b * t, lora_in))
        valid_N = (jnp.ones((b * t,), jnp.float32) if valid_BxT is None
                   else valid_BxT.reshape(b * t).astype(jnp.float32))
        count_E = jnp.zeros((e,), jnp.float32).at[idx_NxK].add(jnp.broadcast_to(valid_N[:, None], idx_NxK.shape))
        stats = MoEStats(count_E=jax.lax.stop_gradient(count_E), prob_E=probs_NxE.T @ valid_N,
                         tokens=jnp.sum(valid_N), experts=idx_NxK, mismatch=mismatch_N * valid_N)
        return y_NxD.reshape(b, t, d), stats

    def _expert_lora(self, n: int, lora_in) -> ExpertLora | None:
        """The experts' adapters (model/lora.py), None when the config adapts none of them."""
        cfg = self.config
        d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
        ab = {name: lora_adapter(self, name, (e, i), ("expert", ia), (o,), (oa,))
              for name, i, ia, o, oa in (("gate", d, "embed", f, "moe_mlp"), ("up", d, "embed", f, "moe_mlp"),
                                         ("down", f, "moe_mlp", d, "embed"))}
        if all(v is None for v in ab.values()):
            return None
        mask = None if lora_in is None or lora_in.rank_mask_BxTxR is None else \
            lora_in.rank_mask_BxTxR.reshape(n, -1)
        return ExpertLora(gate=ab["gate"], up=ab["up"], down=ab["down"], mask_NxR=mask)


def load_balancing_loss(stats: MoEStats, num_experts: int):
    """HF's ``load_balancing_loss_func`` over all MoE layers at once (stats stacked [Y, E]).

    E * sum_e f_e * p_e with f_e = pairs routed to e / (layers * tokens) and p_e = the mean
    router probability of e over the same: 1 under perfectly uniform routing of K=1, K
    times that for K experts per token. Gradient flows through p_e only, as in HF.
    """
    total = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    f_E = jnp.sum(stats.count_E, axis=0) / total
    p_E = jnp.sum(stats.prob_E, axis=0) / total
    return num_experts * jnp.sum(f_E * p_E)


def expert_load(stats: MoEStats):
    """[Y, E] fraction of each layer's (token, expert) pairs that went to each expert (rows sum to 1)."""
    return stats.count_E / jnp.maximum(jnp.sum(stats.count_E, axis=-1, keepdims=True), 1.0)
