"""Serialize one prefix-sharing tree into packed per-token arrays, and rows of trees.

Encoding (docs/design.md, "Tree packing"): tokens in depth-first order; per token
``position`` (index along its own root-to-token path), ``subtree_end`` (packed
index one past the subtree of the node holding it) and ``segment`` (which tree of
the row). Token i attends to token j iff::

    segment[i] == segment[j]  and  j <= i < subtree_end[j]

Branch-point rule. Packed position i predicts ``targets[i]``, the next token on
its path. At a node with several children the next token differs per child, so
the node's last token is *moved* into every child (one copy per child, same token
id, same position). The original is not kept, so no context ever sees the token
twice, and every target has exactly one predicting position. Cost: one extra
token per child beyond the first.

Everything here is numpy with a Python loop over nodes, never over tokens.
"""
from __future__ import annotations

import dataclasses

import chex
import numpy as np

from gyre_jax.trajectory.node import TreeNode

PAD_ID = 0

# dtype of every packed array (SerializedTree and PackedRows fields), checked where they are built.
_DTYPES = {
    "tokens": np.int32,
    "targets": np.int32,
    "loss_mask": np.bool_,
    "behavior_logprobs": np.float32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "subtree_end": np.int32,
    "target_version": np.int32,
    "node_index": np.int32,
    "loss_weights": np.float32,
    "advantages": np.float32,
    **{k: np.float32 for k in ("prox_logprobs", "trainer_logprobs", "ref_logprobs", "seq_log_ratio",
                               "seq_log_mismatch")},
}
_TOKEN_FIELDS = ("tokens", "targets", "loss_mask", "behavior_logprobs", "positions", "subtree_end",
                 "target_version", "node_index")  # SerializedTree's per-token arrays


@dataclasses.dataclass
class SerializedTree:
    """One tree in packed order. Index arrays are local to the tree (start at 0)."""

    tokens: np.ndarray  # int32[n] input token at each packed position
    targets: np.ndarray  # int32[n] next token on the path (PAD_ID where none)
    loss_mask: np.ndarray  # bool[n] target is a trainable recorded output token
    behavior_logprobs: np.ndarray  # float32[n] behavior log-prob of the target (0 where not trainable)
    positions: np.ndarray  # int32[n]
    subtree_end: np.ndarray  # int32[n]
    target_version: np.ndarray  # int32[n] policy version that sampled the target (-1 where none)
    node_index: np.ndarray  # int32[n] pre-order index of the node holding each packed token
    node_ranges: np.ndarray  # int32[num_nodes, 2] packed [start, end) of each node's own tokens
    node_parent: np.ndarray  # int32[num_nodes] pre-order index of the parent (-1 for the root)
    # MoE routing replay: int16 [n, R] experts recorded for the target's sampling step, placed at
    # its predicting position like behavior_logprobs (-1: none, routed live); None: no routing.
    routing: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def check(self, where: str = "SerializedTree") -> None:
        """Per-token arrays are [n], ``node_parent`` [nodes], ``node_ranges`` [nodes, 2], each with its dtype.

        One chex call per property (they are cheap that way); "input k" in a
        message is the k-th name listed with it.
        """
        chex.assert_rank([self.tokens, self.node_parent], 1, custom_message=f"{where}: [tokens, node_parent]")
        n, num_nodes = len(self), self.node_parent.shape[0]
        arrays = [getattr(self, k) for k in _TOKEN_FIELDS]
        chex.assert_shape(arrays, (n,), custom_message=f"{where}: {list(_TOKEN_FIELDS)} must be [n] like tokens")
        chex.assert_type(arrays, [_DTYPES[k] for k in _TOKEN_FIELDS], custom_message=f"{where}: {list(_TOKEN_FIELDS)}")
        chex.assert_shape(self.node_ranges, (num_nodes, 2), custom_message=f"{where}: node_ranges must be [nodes, 2]")
        chex.assert_type([self.node_ranges, self.node_parent], np.int32, custom_message=f"{where}: node arrays")
        if self.routing is not None:
            chex.assert_shape(self.routing, (n, None), custom_message=f"{where}: routing must be [n, R]")
            chex.assert_type(self.routing, np.int16, custom_message=f"{where}: routing")

    @property
    def num_trainable(self) -> int:
        return int(self.loss_mask.sum())

    def path_indices(self) -> list[np.ndarray]:
        """For each root-to-leaf path: the packed indices of its tokens, in path order.

        ``tokens[idx]`` is the path's token sequence and ``targets[idx[:-1]] ==
        tokens[idx[1:]]``. Used by tests and by expanded-path baselines.
        """
        num_nodes = self.node_parent.shape[0]
        has_child = np.zeros(num_nodes, bool)
        has_child[self.node_parent[self.node_parent >= 0]] = True
        out = []
        for leaf in np.flatnonzero(~has_child):
            chain, n = [], int(leaf)
            while n >= 0:
                chain.append(n)
                n = int(self.node_parent[n])
            ranges = [np.arange(*self.node_ranges[c]) for c in reversed(chain)]
            out.append(np.concatenate(ranges).astype(np.int32))
        return out


def serialize_tree(root: TreeNode) -> SerializedTree:
    """Depth-first serialization with the branch-point rule (module docstring)."""
    nodes, parent, depth, eff_src = _effective_entries(root)
    lay = _Layout.of(eff_src, parent)
    total, counts = lay.total, lay.counts
    # Gather per-token attributes from the source nodes in one concatenation.
    tok_all = np.concatenate([n.tokens for n in nodes]) if nodes else np.zeros(0, np.int32)
    tr_all = np.concatenate([n.trainable for n in nodes]) if nodes else np.zeros(0, bool)
    lp_all = np.concatenate([n.logprobs for n in nodes]) if nodes else np.zeros(0, np.float32)
    node_tok_start = np.concatenate([[0], np.cumsum([n.tokens.shape[0] for n in nodes])]).astype(np.int64)
    flat = node_tok_start[lay.src_node] + lay.src_off
    tokens = tok_all[flat]
    positions = (np.asarray(depth, np.int64)[lay.src_node] + lay.src_off).astype(np.int32)
    version_all = np.array([n.policy_version for n in nodes], np.int32)

    succ = _successors(lay, parent)
    has_succ = succ >= 0
    succ_c = np.where(has_succ, succ, 0)
    targets = np.where(has_succ, tokens[np.minimum(succ_c, max(total - 1, 0))], PAD_ID).astype(np.int32)
    tgt_flat = flat[np.minimum(succ_c, max(total - 1, 0))]
    loss_mask = has_succ & tr_all[tgt_flat]
    behavior = np.where(loss_mask, lp_all[tgt_flat], 0.0).astype(np.float32)
    target_version = np.where(has_succ, version_all[lay.src_node[np.minimum(succ_c, max(total - 1, 0))]], -1)
    out = SerializedTree(
        tokens=tokens.astype(np.int32),
        targets=targets,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        positions=positions,
        subtree_end=np.repeat(lay.sub_end, counts).astype(np.int32),
        target_version=target_version.astype(np.int32),
        node_index=np.repeat(np.arange(len(nodes), dtype=np.int32), counts),
        node_ranges=np.stack([lay.starts[:-1], lay.starts[1:]], axis=1).astype(np.int32),
        node_parent=np.asarray(parent, np.int32),
        routing=_packed_routing(nodes, tgt_flat, has_succ),
    )
    out.check("serialize_tree")
    return out


_Entries = list[tuple[int, np.ndarray]]  # a node's effective tokens: (source node, offsets into its tokens)


def _effective_entries(root: TreeNode) -> tuple[list[TreeNode], list[int], list[int], list[_Entries]]:
    """Pass 1 (pre-order): (nodes, parent index, path position of each node's first own token, and
    each node's effective token list). An entry is (source node, offsets into its tokens); a
    carried-down copy keeps its source, hence its position."""
    nodes: list[TreeNode] = []
    parent: list[int] = []
    depth: list[int] = []
    eff_src: list[_Entries] = []
    stack: list[tuple[TreeNode, int, int, _Entries]] = [(root, -1, 0, [])]
    while stack:
        node, par, d, carry = stack.pop()
        if par >= 0 and node.tokens.shape[0] == 0:
            raise ValueError(f"serialize_tree: node with call_ids={node.call_ids} has no tokens; only a root may be empty")
        idx = len(nodes)
        nodes.append(node)
        parent.append(par)
        depth.append(d)
        entries = list(carry) + [(idx, np.arange(node.tokens.shape[0], dtype=np.int32))]
        child_carry: list = []
        if len(node.children) >= 2:
            entries, child_carry = _pop_last(entries)
        eff_src.append(entries)
        nd = d + node.tokens.shape[0]
        for child in reversed(node.children):
            stack.append((child, idx, nd, child_carry))
    return nodes, parent, depth, eff_src


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Pass 2: where each node's effective tokens go in the packed arrays."""

    counts: np.ndarray  # int64[nodes]: packed tokens per node
    starts: np.ndarray  # int64[nodes + 1]: packed start of each node (and the total)
    sub_end: np.ndarray  # int64[nodes]: packed end of each node's subtree
    src_node: np.ndarray  # int32[total]: source node of each packed token
    src_off: np.ndarray  # int32[total]: its offset in that node's tokens

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    @classmethod
    def of(cls, eff_src: list[_Entries], parent: list[int]) -> _Layout:
        counts = np.array([sum(o.shape[0] for _, o in e) for e in eff_src], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # subtree end: pre-order, so a node's subtree is contiguous; compute bottom-up.
        sub_end = starts[1:].copy()
        for i in range(len(eff_src) - 1, 0, -1):
            p = parent[i]
            sub_end[p] = max(sub_end[p], sub_end[i])
        total = int(starts[-1])
        src_node = np.empty(total, np.int32)
        src_off = np.empty(total, np.int32)
        pos = 0
        for entries in eff_src:
            for s, offs in entries:
                n = offs.shape[0]
                src_node[pos : pos + n] = s
                src_off[pos : pos + n] = offs
                pos += n
        return cls(counts, starts, sub_end, src_node, src_off)


def _successors(lay: _Layout, parent: list[int]) -> np.ndarray:
    """The packed index of each packed token's successor along its path (-1: a path's end): the
    next packed token within the node, else the first packed token of its (single or any) child:
    after the move all children start with the same carried entry."""
    num_nodes = len(parent)
    succ = np.arange(1, lay.total + 1, dtype=np.int64)
    last_of_node = lay.starts[1:] - 1
    first_child = np.full(num_nodes, -1, np.int64)
    for i in range(num_nodes - 1, 0, -1):
        first_child[parent[i]] = i
    for i in range(num_nodes):
        if lay.counts[i] == 0:
            continue
        c = first_child[i]
        # A child with no effective tokens cannot exist: it would own at least the carry.
        succ[last_of_node[i]] = lay.starts[c] if c >= 0 else -1
    return succ


def _packed_routing(nodes: list[TreeNode], tgt_flat: np.ndarray, has_succ: np.ndarray) -> np.ndarray | None:
    """Each packed position's routing: its target's recorded routing (-1 rows where no target or none)."""
    widths = {n.routing.shape[1] for n in nodes if n.routing is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"serialize_tree: nodes carry routing of widths {sorted(widths)}")
    (w,) = widths
    # Only the routed nodes' rows are gathered (prompt nodes hold none): flat token -> row of `routed`.
    sizes = np.array([n.tokens.shape[0] for n in nodes], np.int64)
    has = np.array([n.routing is not None for n in nodes])
    routed = np.concatenate([n.routing for n in nodes if n.routing is not None])
    row_start = np.concatenate([[0], np.cumsum(np.where(has, sizes, 0))])[:-1]
    row_of_flat = np.where(np.repeat(has, sizes), np.repeat(row_start - np.cumsum(sizes) + sizes, sizes)
                           + np.arange(int(sizes.sum())), -1)
    out = np.full((tgt_flat.shape[0], w), -1, np.int16)
    if row_of_flat.shape[0] == 0:
        return out
    rows = np.where(has_succ, row_of_flat[np.minimum(tgt_flat, row_of_flat.shape[0] - 1)], -1)
    sel = rows >= 0
    out[sel] = routed[rows[sel]]
    return out


def _pop_last(entries):
    """Split off the last token of an entry list: (entries without it, [that token])."""
    entries = [(s, o) for s, o in entries if o.shape[0]]
    if not entries:
        return [], []
    s, o = entries[-1]
    head = entries[:-1] + ([(s, o[:-1])] if o.shape[0] > 1 else [])
    return head, [(s, o[-1:])]


SCORE_FIELDS = ("prox_logprobs", "trainer_logprobs", "ref_logprobs", "seq_log_ratio", "seq_log_mismatch")


@dataclasses.dataclass
class PackedRows:
    """A batch of packed rows, every array [B, L]. ``segment_ids`` 0 is padding."""

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    behavior_logprobs: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    subtree_end: np.ndarray
    target_version: np.ndarray
    loss_weights: np.ndarray  # float32, filled by the trajectory processor (counting rule)
    advantages: np.ndarray  # float32, per token (one value per rollout)
    # Filled by the trainer's per-step pass when the objective reads them (0 otherwise;
    # gyre_jax/cells/score.py): the trainer's log-probs under the step's params (proximal),
    # under each token's behaviour version, under the reference params, and per-rollout
    # statistics broadcast to its tokens (GSPO's mean log-ratio, the mismatch's log-product).
    # None given = zeros: __post_init__ fills them, so after construction each is an array.
    prox_logprobs: np.ndarray = None  # type: ignore[assignment]
    trainer_logprobs: np.ndarray = None  # type: ignore[assignment]
    ref_logprobs: np.ndarray = None  # type: ignore[assignment]
    seq_log_ratio: np.ndarray = None  # type: ignore[assignment]
    seq_log_mismatch: np.ndarray = None  # type: ignore[assignment]
    # An MoE model's recorded routing, int16 [B, L, R] (-1: routed live; SerializedTree.routing);
    # None for a dense model. The one field that is not [B, L].
    routing: np.ndarray | None = None
    # Multi-LoRA (gyre_jax/model/lora.py): int32 [B, L], the adapter each token's rollout trains; None with one
    # adapter (the trainer fills it; padding 0).
    adapter: np.ndarray | None = None

    def __post_init__(self):
        for k in SCORE_FIELDS:
            if getattr(self, k) is None:
                setattr(self, k, np.zeros(self.tokens.shape, np.float32))

    def as_dict(self) -> dict[str, np.ndarray]:
        d = dataclasses.asdict(self)
        for k in ("routing", "adapter"):  # absent, not None: jitted steps see one pytree
            if d[k] is None:
                del d[k]
        return d

    def check(self, where: str = "PackedRows") -> None:
        """Every field is [B, L] (the shape of ``tokens``) with its dtype ("input k" is the k-th field);
        ``routing``, if present, int16 [B, L, R]."""
        chex.assert_rank(self.tokens, 2, custom_message=f"{where}: tokens must be [B, L]")
        names = [f.name for f in dataclasses.fields(self) if f.name not in ("routing", "adapter")]
        arrays = [getattr(self, k) for k in names]
        chex.assert_shape(arrays, self.tokens.shape, custom_message=f"{where}: {names} must be [B, L] like tokens")
        chex.assert_type(arrays, [_DTYPES[k] for k in names], custom_message=f"{where}: {names}")
        if self.routing is not None:
            chex.assert_shape(self.routing, (*self.tokens.shape, None), custom_message=f"{where}: routing must be [B, L, R]")
            chex.assert_type(self.routing, np.int16, custom_message=f"{where}: routing")
        if self.adapter is not None:
            chex.assert_shape(self.adapter, self.tokens.shape, custom_message=f"{where}: adapter must be [B, L]")


def pack_rows(rows: list[list[SerializedTree]], row_len: int, *, routing_width: int | None = None) -> PackedRows:
    """Lay out given trees side by side in rows of ``row_len`` (no bin-packing here).

    Padding gets segment 0, attends only to itself (so no softmax row is empty)
    and carries no loss. ``routing_width``: R of the rows' ``routing`` (an MoE model's
    MoE layers x top-k; every batch of a run has the field, -1 where a tree has none),
    0 for none, None to take it from the trees.
    """
    b = len(rows)
    widths = {t.routing.shape[1] for trees in rows for t in trees if t.routing is not None}
    if routing_width is None:
        if len(widths) > 1:
            raise ValueError(f"pack_rows: trees carry routing of widths {sorted(widths)}")
        routing_width = widths.pop() if widths else 0
    elif widths - {routing_width}:
        raise ValueError(f"pack_rows: trees carry routing of widths {sorted(widths)}, rows take {routing_width} "
                         "(the model's MoE layers x top-k)")
    out = PackedRows(
        tokens=np.full((b, row_len), PAD_ID, np.int32),
        targets=np.full((b, row_len), PAD_ID, np.int32),
        loss_mask=np.zeros((b, row_len), bool),
        behavior_logprobs=np.zeros((b, row_len), np.float32),
        positions=np.zeros((b, row_len), np.int32),
        segment_ids=np.zeros((b, row_len), np.int32),
        subtree_end=np.tile(np.arange(1, row_len + 1, dtype=np.int32), (b, 1)),
        target_version=np.full((b, row_len), -1, np.int32),
        loss_weights=np.zeros((b, row_len), np.float32),
        advantages=np.zeros((b, row_len), np.float32),
        routing=np.full((b, row_len, routing_width), -1, np.int16) if routing_width else None,
    )
    for r, trees in enumerate(rows):
        start = 0
        for seg, t in enumerate(trees, start=1):
            n = len(t)
            if start + n > row_len:
                raise ValueError(
                    f"row {r}: trees need {start + n} tokens, more than row_len={row_len}"
                )
            sl = slice(start, start + n)
            out.tokens[r, sl] = t.tokens
            out.targets[r, sl] = t.targets
            out.loss_mask[r, sl] = t.loss_mask
            out.behavior_logprobs[r, sl] = t.behavior_logprobs
            out.positions[r, sl] = t.positions
            out.segment_ids[r, sl] = seg
            out.subtree_end[r, sl] = t.subtree_end + start
            out.target_version[r, sl] = t.target_version
            if out.routing is not None and t.routing is not None:
                out.routing[r, sl] = t.routing
            start += n
    out.check("pack_rows")
    return out


def tree_attention_mask_np(segment_ids: np.ndarray, subtree_end: np.ndarray) -> np.ndarray:
    """Reference dense mask [..., L, L] (query i, key j), for tests and debugging."""
    L = segment_ids.shape[-1]
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    return same & (j <= i) & (i < subtree_end[..., None, :])
