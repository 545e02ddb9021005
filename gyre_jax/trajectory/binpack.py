"""Split selected trees to fit rows of length L and bin-pack them; fill loss weights.

Splitting (a tree whose serialization exceeds L) works on whole subtrees. A *unit*
is an ancestor chain (root to some node v) plus whole subtrees hanging below it;
it serializes as one tree whose root-to-node paths are prefixes of the original's,
so serialize_tree gives every token exactly its original context and position.
Top down from the root: a subtree that fits below its chain is one unit. A node v
whose subtree does not fit is *split*: its children whose subtrees fit below
chain + v are grouped (first-fit decreasing) into units that share chain + v, and
the others are split in turn. Agent trees are a shared system prompt with long
contexts below it (compaction restarts, sub-agents), so this keeps each context
whole and copies only the short prefix above it; cutting a context in the middle
would copy everything above the cut.

Counted once: every node is *owned* by exactly one unit (a node inside a whole
subtree by that unit; a split node by the first unit whose chain holds it). In all
other copies its tokens are non-trainable, so each trainable token is a target
exactly once over all units. The copies are the reported duplicated tokens. A
single root-to-node path longer than L cannot fit any row: a clear error.

Packing: first-fit decreasing over all units of all rollouts of the call.

Loss weights: the registered weight builder's (``gyre_jax.losses.WEIGHT_BUILDERS``). By
default our counting rule (docs/design.md): a trainable target of rollout r gets
w = 1 / (N_r * R), N_r = the rollout's trainable targets over all its units (each
unique trainable token once), R = rollouts of the *global* step.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import chex
import numpy as np

from gyre_jax.losses.weights import build_loss_weights, get_weight_builder
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import PackedRows, SerializedTree, pack_rows, serialize_tree


class PathTooLongError(ValueError):
    """A root-to-node path longer than the row: no packing can give it its full context."""


@dataclasses.dataclass(frozen=True)
class SplitResult:
    parts: list  # list[SerializedTree], each len <= row_len
    duplicated_tokens: int  # ancestor-chain tokens copied into units that do not own them
    unique_tokens: int  # tokens of the input tree (sum over nodes)


def serialized_len(root: TreeNode) -> int:
    """len(serialize_tree(root)) without serializing: tokens + (children - 1) per
    branching node (serialize.py's branch-point rule; an empty root has no token to
    move, so it costs nothing)."""
    total = 0
    for n in root.walk():
        k = n.tokens.shape[0]
        total += k + (max(0, len(n.children) - 1) if k else 0)
    return total


def split_tree(root: TreeNode, row_len: int, *, name: str = "tree") -> SplitResult:
    """Serialize ``root`` as one or more units of at most ``row_len`` tokens (module doc)."""
    nodes, parent = root.preorder()
    n = len(nodes)
    ntok = np.fromiter((x.tokens.shape[0] for x in nodes), np.int64, n)
    unique = int(ntok.sum())
    depth = np.zeros(n, np.int64)  # tokens on the path above each node
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
    # Serialized size of each whole subtree (reverse pre-order: children first).
    nkids = np.bincount(parent[1:], minlength=n).astype(np.int64)
    size = ntok + np.where(ntok > 0, np.maximum(nkids - 1, 0), 0)
    for i in range(n - 1, 0, -1):
        size[parent[i]] += size[i]
    if size[0] <= row_len:
        return SplitResult([serialize_tree(root)], 0, unique)

    index = {id(x): i for i, x in enumerate(nodes)}
    units: list[tuple[int, list[TreeNode]]] = []  # (split node v, whole subtrees below it)
    stack = [0]  # split nodes, processed in pre-order so ownership follows the tree order
    while stack:
        v = stack.pop()
        room = row_len - int(path_end[v])  # below chain + v
        kids = [index[id(c)] for c in nodes[v].children]
        fit = [c for c in kids if size[c] <= room]
        big = [c for c in kids if size[c] > room]
        # Each extra child of a group costs one branch copy: weights size+1, capacity room+1.
        for group in first_fit_decreasing([int(size[c]) + 1 for c in fit], room + 1):
            units.append((v, [nodes[fit[k]] for k in sorted(group)]))
        stack.extend(reversed(big))

    out, dup = [], 0
    owned = np.zeros(n, bool)
    for v, subtrees in units:
        chain = _ancestors(parent, v) + [v]
        copies = [i for i in chain if owned[i]]
        owned[chain] = True
        t = serialize_tree(_build_unit(nodes, chain, owned_here=set(chain) - set(copies), subtrees=subtrees))
        if len(t) > row_len:  # the size bookkeeping above is the invariant; fail loudly
            raise AssertionError(f"{name}: split unit of {len(t)} tokens > row_len={row_len}")
        out.append(t)
        dup += int(ntok[copies].sum())
    return SplitResult(out, dup, unique)


def _ancestors(parent: np.ndarray, i: int) -> list[int]:
    chain = []
    p = int(parent[i])
    while p >= 0:
        chain.append(p)
        p = int(parent[p])
    chain.reverse()
    return chain


def _build_unit(nodes, chain, *, owned_here, subtrees) -> TreeNode:
    """Chain nodes (trainable only where owned here) ending in the given whole subtrees.

    The subtrees are the original nodes, shared, not copied: serialize_tree only reads.
    """
    made = []
    for i in chain:
        x = nodes[i]
        keep = i in owned_here
        made.append(TreeNode(
            tokens=x.tokens,
            trainable=x.trainable if keep else np.zeros(x.tokens.shape[0], bool),
            logprobs=x.logprobs if keep else np.zeros(x.tokens.shape[0], np.float32),
            children=[], role=x.role, agent_id=x.agent_id, call_ids=x.call_ids,
            policy_version=x.policy_version,
            routing=x.routing,  # a copy is context the engine computed with these experts: replayed too
        ))
    for a, b in zip(made, made[1:]):
        a.children.append(b)
    made[-1].children.extend(subtrees)
    return made[0]


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Item indices per row. Longest first; ties by index, so the result is deterministic."""
    sizes = np.asarray(lengths, np.int64)
    chex.assert_rank(sizes, 1, custom_message="first_fit_decreasing: lengths must be a flat sequence")
    if sizes.size and sizes.max() > row_len:
        raise ValueError(f"first_fit_decreasing: item of {int(sizes.max())} tokens > row_len={row_len}")
    order = np.lexsort((np.arange(sizes.size), -sizes))
    remaining = np.zeros(0, np.int64)
    rows: list[list[int]] = []
    for k in order:
        fits = np.flatnonzero(remaining >= sizes[k])
        if fits.size:
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            remaining = np.append(remaining, row_len)
        rows[r].append(int(k))
        remaining[r] -= sizes[k]
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
    weight_units: float = 0.0  # the weight builder's normaliser units in these rows (rollouts or tokens)
    weight_normalizer: float = 0.0  # what the weights were divided by (weight_units for a whole step)

    @property
    def fill(self) -> float:
        cap = self.rows.tokens.size
        return self.packed_tokens / cap if cap else 0.0


def pack_trees(
    trees: Sequence[TreeNode | None],
    advantages: Sequence[float] | np.ndarray,
    row_len: int,
    *,
    num_step_rollouts: int | None = None,
    names: Sequence[str] | None = None,
    min_rows: int = 0,
    weights: str = "rollout_token_mean",
    weights_config=None,
    routing_width: int | None = None,
) -> PackResult:
    """Split, serialize and bin-pack the selected trees of some rollouts into rows.

    ``trees[r]`` is rollout r's selected tree (None: nothing selected, no tokens).
    ``advantages[r]`` is its advantage. ``weights`` names the weight builder (its config:
    ``weights_config``). ``num_step_rollouts``: the rollouts of the *global* step when a
    step is packed in several calls (streaming); the weights are then divided by a
    nominal normaliser (R for rollout-counted builders, R * row_len for token-counted
    ones) and the caller rescales the step by ``weight_normalizer / sum(weight_units)``
    at its end. None: these trees are the whole step (divided by their own units).
    ``routing_width``: see ``pack_rows`` (an MoE model's recorded routing per row).
    """
    nr = len(trees)
    if len(advantages) != nr:
        raise ValueError(f"pack_trees: {nr} trees but {len(advantages)} advantages")
    if num_step_rollouts is not None and num_step_rollouts < nr:
        raise ValueError(f"pack_trees: num_step_rollouts={num_step_rollouts} < {nr} rollouts given")
    items, owner, dup, unique = _split_all(trees, row_len, names)
    assignment = first_fit_decreasing([len(t) for t in items], row_len)
    while len(assignment) < min_rows:
        assignment.append([])
    rows = pack_rows([[items[k] for k in row] for row in assignment], row_len, routing_width=routing_width)
    rollout_index = _rollout_index(assignment, owner, rows.segment_ids)
    valid = rollout_index >= 0
    ridx = np.where(valid, rollout_index, 0)
    num_targets = np.bincount(ridx[rows.loss_mask], minlength=nr).astype(np.int64)
    units, normalizer = _fill_weights(rows, ridx, nr, num_targets, weights, weights_config,
                                      None if num_step_rollouts is None else int(num_step_rollouts), row_len)
    # Lookup table with one spare entry so that ridx (0 on padding) indexes it even
    # when no rollout is given; padding is masked out.
    adv = np.zeros(nr + 1, np.float32)
    adv[:nr] = np.asarray(advantages, np.float32).reshape(nr)
    rows.advantages = np.where(valid, adv[ridx], 0.0).astype(np.float32)
    rows.check("pack_trees")
    chex.assert_shape(rollout_index, rows.tokens.shape, custom_message="pack_trees: rollout_index must be [B, L]")
    chex.assert_shape(num_targets, (nr,), custom_message="pack_trees: num_targets must be [rollouts]")
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
        weight_units=float(units),
        weight_normalizer=float(normalizer),
    )


def _split_all(trees: Sequence[TreeNode | None], row_len: int,
               names: Sequence[str] | None) -> tuple[list[SerializedTree], list[int], int, int]:
    """Every tree split into row-sized parts: (parts, the rollout of each, duplicated tokens, unique tokens)."""
    names = [f"rollout #{r}" for r in range(len(trees))] if names is None else list(names)
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
    return items, owner, dup, unique


def _rollout_index(assignment: list[list[int]], owner: list[int], segment_ids: np.ndarray) -> np.ndarray:
    """[B, L]: the rollout of each position (-1 on padding). Segment s (1-based) of row b holds
    item assignment[b][s-1]."""
    max_seg = max((len(row) for row in assignment), default=0)
    seg_owner = np.full((len(assignment), max_seg + 1), -1, np.int32)
    for b, row in enumerate(assignment):
        seg_owner[b, 1 : len(row) + 1] = [owner[k] for k in row]
    return np.take_along_axis(seg_owner, segment_ids.astype(np.int64), axis=1)


def _fill_weights(rows: PackedRows, ridx: np.ndarray, nr: int, num_targets: np.ndarray, weights: str,
                  weights_config, step_rollouts: int | None, row_len: int) -> tuple[float, float]:
    """``rows.loss_weights`` from the named builder (the losses package owns the aggregation; N_r is
    counted over all parts here); (its units in these rows, what the weights were divided by:
    their own units, or with ``step_rollouts`` R the step's nominal R or R * row_len)."""
    entry = get_weight_builder(weights)
    units, normalizer = 0.0, 0.0
    if nr:  # a rollout without tokens still counts in R (rollout-counted builders)
        _, units = entry.fn(rows.loss_mask, ridx, nr, num_targets,
                            entry.config() if weights_config is None else weights_config)
        normalizer = units if step_rollouts is None else (
            step_rollouts * row_len if entry.units == "tokens" else float(step_rollouts))
        rows.loss_weights, _ = build_loss_weights(weights, rows.loss_mask, ridx, nr, rollout_token_counts=num_targets,
                                                  config=weights_config, normalizer=normalizer)
    return units, normalizer
