"""Split selected trees to fit rows of length L and bin-pack them; fill loss weights.

Splitting (a tree whose serialization exceeds L). Walk the nodes in depth-first
pre-order and fill a part until the next node does not fit; then start a new part
that carries the next node's ancestor path. Nodes are never cut, so every part is
a tree whose root-to-node paths are prefixes of the original's: serialize_tree on
the part gives each token exactly its original context and position. Each node is
*owned* (trainable kept) by exactly one part, the one the sweep added it to; in the
ancestor copies every token is non-trainable, so each trainable token is still a
target exactly once over all parts. The copies are the reported duplicated tokens.
A single root-to-node path longer than L cannot fit any row: a clear error.

Why the sweep and not per-subtree bins: in pre-order the parent of the next node is
always already in the current part (it is an ancestor of the previous node, hence
in the part or in its carried chain), so a part only ever needs one ancestor chain
and parts come out near L long.

Packing: first-fit decreasing over all parts of all rollouts of the call.

Loss weights (docs/design.md, counting rule): a trainable target of rollout r gets
w = 1 / (N_r * R), N_r = the rollout's trainable targets over all its parts (each
unique trainable token once), R = rollouts of the *global* step.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import PackedRows, SerializedTree, pack_rows, serialize_tree


class PathTooLongError(ValueError):
    """A root-to-node path longer than the row: no packing can give it its full context."""


@dataclasses.dataclass(frozen=True)
class SplitResult:
    parts: list  # list[SerializedTree], each len <= row_len
    duplicated_tokens: int  # ancestor-path tokens copied into later parts (non-trainable there)
    unique_tokens: int  # tokens of the input tree (sum over nodes)


def _preorder(root: TreeNode):
    nodes, parent = [], []
    stack = [(root, -1)]
    while stack:
        node, par = stack.pop()
        idx = len(nodes)
        nodes.append(node)
        parent.append(par)
        for c in reversed(node.children):
            stack.append((c, idx))
    return nodes, np.asarray(parent, np.int64)


def serialized_len(root: TreeNode) -> int:
    """len(serialize_tree(root)) without serializing: tokens + (children - 1) per branch node."""
    total = 0
    for n in root.walk():
        total += n.tokens.shape[0] + max(0, len(n.children) - 1)
    return total


def split_tree(root: TreeNode, row_len: int, *, name: str = "tree") -> SplitResult:
    """Serialize ``root`` as one or more parts of at most ``row_len`` tokens (module doc)."""
    nodes, parent = _preorder(root)
    n = len(nodes)
    ntok = np.fromiter((x.tokens.shape[0] for x in nodes), np.int64, n)
    unique = int(ntok.sum())
    depth = np.zeros(n, np.int64)  # tokens on the path above each node
    nkids = np.fromiter((len(x.children) for x in nodes), np.int64, n)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + ntok[parent[i]]
    path_end = depth + ntok
    worst = int(np.argmax(path_end))
    if path_end[worst] > row_len:
        raise PathTooLongError(
            f"{name}: a root-to-node path (ending in call_ids={nodes[worst].call_ids}, "
            f"role={nodes[worst].role}) has {int(path_end[worst])} tokens, more than "
            f"row_len={row_len}; rows must cover the model's full context"
        )
    if unique + int(np.maximum(nkids - 1, 0).sum()) <= row_len:
        return SplitResult([serialize_tree(root)], 0, unique)

    # Sweep (module doc). parts: list of (chain node indices, owned node indices).
    parts: list[tuple[list[int], list[int]]] = []
    kids_in_part = np.zeros(n, np.int64)
    chain: list[int] = []
    owned: list[int] = []
    size = 0
    for i in range(n):
        p = parent[i]
        cost = ntok[i] + (1 if p >= 0 and kids_in_part[p] >= 1 else 0)
        if owned and size + cost > row_len:
            parts.append((chain, owned))
            kids_in_part[chain] = 0
            kids_in_part[owned] = 0
            chain = _ancestors(parent, i)
            owned = []
            kids_in_part[chain[:-1]] = 1  # chain[k] has one child in the part: chain[k+1]
            if chain:
                kids_in_part[chain[-1]] = 0
            size = int(depth[i])
            cost = ntok[i]
        if p >= 0:
            kids_in_part[p] += 1
        owned.append(i)
        size += int(cost)
    parts.append((chain, owned))

    out, dup = [], 0
    for chain, owned in parts:
        t = serialize_tree(_build_part(nodes, parent, chain, owned))
        if len(t) > row_len:  # the sweep's size bookkeeping is the invariant; fail loudly
            raise AssertionError(f"{name}: split part of {len(t)} tokens > row_len={row_len}")
        out.append(t)
        dup += int(ntok[chain].sum()) if chain else 0
    return SplitResult(out, dup, unique)


def _ancestors(parent: np.ndarray, i: int) -> list[int]:
    chain = []
    p = int(parent[i])
    while p >= 0:
        chain.append(p)
        p = int(parent[p])
    chain.reverse()
    return chain


def _build_part(nodes, parent, chain, owned) -> TreeNode:
    """A tree of the chain (non-trainable copies) plus the owned nodes, in pre-order."""
    made: dict[int, TreeNode] = {}
    for i in chain:
        x = nodes[i]
        made[i] = TreeNode(
            tokens=x.tokens, trainable=np.zeros(x.tokens.shape[0], bool),
            logprobs=np.zeros(x.tokens.shape[0], np.float32), children=[], role=x.role,
            agent_id=x.agent_id, call_ids=x.call_ids, policy_version=x.policy_version,
        )
    for i in owned:
        x = nodes[i]
        made[i] = TreeNode(
            tokens=x.tokens, trainable=x.trainable, logprobs=x.logprobs, children=[], role=x.role,
            agent_id=x.agent_id, call_ids=x.call_ids, policy_version=x.policy_version,
        )
    # chain then owned is pre-order, so appending keeps the original child order.
    for i in list(chain) + list(owned):
        p = int(parent[i])
        if p >= 0:
            made[p].children.append(made[i])
    return made[chain[0] if chain else owned[0]]


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Item indices per row. Longest first; ties by index, so the result is deterministic."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        raise ValueError(f"first_fit_decreasing: item of {int(lengths.max())} tokens > row_len={row_len}")
    order = np.lexsort((np.arange(lengths.size), -lengths))
    remaining = np.zeros(0, np.int64)
    rows: list[list[int]] = []
    for k in order:
        fits = np.flatnonzero(remaining >= lengths[k])
        if fits.size:
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            remaining = np.append(remaining, row_len)
        rows[r].append(int(k))
        remaining[r] -= lengths[k]
    return rows


@dataclasses.dataclass
class PackResult:
    rows: PackedRows  # [B, L]; loss_weights and advantages filled
    rollout_index: np.ndarray  # int32[B, L]: index into the given trees, -1 on padding
    num_targets: np.ndarray  # int64[n]: N_r, trainable targets per rollout
    unique_tokens: int  # tokens of the given (selected) trees
    packed_tokens: int  # non-padding tokens in rows (includes copies)
    duplicated_tokens: int  # ancestor-path copies from splitting
    branch_copies: int  # branch-point copies (serialize.py's rule), one per extra child
    num_parts: int

    @property
    def fill(self) -> float:
        cap = self.rows.tokens.size
        return self.packed_tokens / cap if cap else 0.0


def pack_trees(
    trees: Sequence[TreeNode | None],
    advantages: Sequence[float],
    row_len: int,
    *,
    num_step_rollouts: int | None = None,
    names: Sequence[str] | None = None,
    min_rows: int = 0,
) -> PackResult:
    """Split, serialize and bin-pack the selected trees of some rollouts into rows.

    ``trees[r]`` is rollout r's selected tree (None: nothing selected, no tokens).
    ``advantages[r]`` is its advantage. ``num_step_rollouts`` is R of the counting
    rule: the rollouts trained in the *global* step (default: len(trees)); pass it
    when a step's rollouts are packed in several calls (streaming), so that the
    weights of all calls together sum to 1.
    """
    nr = len(trees)
    if len(advantages) != nr:
        raise ValueError(f"pack_trees: {nr} trees but {len(advantages)} advantages")
    R = nr if num_step_rollouts is None else int(num_step_rollouts)
    if R < nr:
        raise ValueError(f"pack_trees: num_step_rollouts={R} < {nr} rollouts given")
    names = [f"rollout #{r}" for r in range(nr)] if names is None else list(names)

    items: list[SerializedTree] = []
    owner: list[int] = []
    dup = unique = 0
    for r, t in enumerate(trees):
        if t is None:
            continue
        s = split_tree(t, row_len, name=names[r])
        items.extend(s.parts)
        owner.extend([r] * len(s.parts))
        dup += s.duplicated_tokens
        unique += s.unique_tokens
    lengths = [len(t) for t in items]
    assignment = first_fit_decreasing(lengths, row_len)
    while len(assignment) < min_rows:
        assignment.append([])
    rows = pack_rows([[items[k] for k in row] for row in assignment], row_len)

    # Segment s (1-based) of row b holds item assignment[b][s-1]; map segments to rollouts.
    max_seg = max((len(row) for row in assignment), default=0)
    seg_owner = np.full((len(assignment), max_seg + 1), -1, np.int32)
    for b, row in enumerate(assignment):
        seg_owner[b, 1 : len(row) + 1] = [owner[k] for k in row]
    rollout_index = np.take_along_axis(seg_owner, rows.segment_ids.astype(np.int64), axis=1)

    valid = rollout_index >= 0
    ridx = np.where(valid, rollout_index, 0)
    num_targets = np.bincount(ridx[rows.loss_mask], minlength=nr).astype(np.int64)
    w_r = np.zeros(nr, np.float64)
    has = num_targets > 0
    w_r[has] = 1.0 / (num_targets[has].astype(np.float64) * R)
    rows.loss_weights = np.where(rows.loss_mask, w_r[ridx], 0.0).astype(np.float32)
    adv = np.asarray(advantages, np.float32).reshape(nr) if nr else np.zeros(1, np.float32)
    rows.advantages = np.where(valid, adv[ridx] if nr else 0.0, 0.0).astype(np.float32)

    packed = int(valid.sum())
    return PackResult(
        rows=rows,
        rollout_index=rollout_index.astype(np.int32),
        num_targets=num_targets,
        unique_tokens=unique,
        packed_tokens=packed,
        duplicated_tokens=dup,
        branch_copies=packed - unique - dup,
        num_parts=len(items),
    )
