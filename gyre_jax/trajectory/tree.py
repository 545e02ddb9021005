"""Rebuild one rollout's exact prefix-sharing tree from its model-call records.

Each call contributes one sequence, ``prompt_ids + output_ids``, and the tree is
the compressed trie (radix tree) of those sequences over token ids, never over
messages. So:

* every recorded sequence is exactly one root-to-node path, ending at a node
  boundary (``RebuiltTree.end_nodes[call_index]``);
* a token is trainable iff its tree position (= its whole prefix) is covered by
  some call's *output* span. Prompt positions are never trainable, even when the
  same ids appear in an earlier output somewhere else. Where a later prompt
  reproduces an earlier output exactly, its path runs through that output's node,
  whose tokens are trainable once, there. Where it re-tokenized the output
  differently (drift), the paths branch at the first differing token and the
  recorded output stays trainable only on its own branch;
* retries (same prompt, other outputs) branch after the shared prompt; a
  compaction or a sub-agent is a new context that shares only its common prefix
  (often just the system prompt; nothing, and the root is an empty node).

Nodes are split at the start and end of every call's output span as well as at
branch points, so within a node every token has the same set of covering
outputs. Its *owner* is the covering call with the lowest call index: the
node's log-probs, policy version, role and agent id are the owner's (identical
contexts, so any covering call's log-prob is a valid behavior log-prob; the
earliest is kept, deterministically). A node no output covers takes role, agent
and version from the lowest-index call whose path passes through it.
``TreeNode.call_ids`` lists (sorted) the calls whose output covers the node plus
the calls whose sequence ends at it. Children are ordered by first insertion
(call index order).

Algorithm and cost. Calls are inserted in call-index order. A call is first
compared with the previous call of the same agent in one vectorized
``flatnonzero(a != b)`` over the shorter length: in linear multi-turn that
matches the whole previous context at once, and for retries the whole prompt.
From the previous call's end node we walk up parent links to the node holding
the divergence point, then continue down the trie comparing whole node spans
with numpy. Each recorded token is compared at most twice, so the work is
O(R) vectorized (R = recorded tokens: sum of prompt + output lengths) plus a
Python step per node visited: O(calls) in the usual shapes, O(calls x depth) at
worst (a call that shares nothing with its agent's previous call walks the tree
from the root). No per-token Python loops. Node tokens are views into one
caller's sequence, so the tree holds O(unique tokens + calls) extra memory
beyond the sequences still referenced.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.records import ModelCallRecord


class _N:
    """Internal radix-trie node: tokens are ``seq[s:e]``, s/e are path positions."""

    __slots__ = ("seq", "s", "e", "parent", "children", "creator", "owner", "covers", "ends")

    def __init__(self, seq, s, e, parent, creator):
        self.seq, self.s, self.e, self.parent = seq, s, e, parent
        self.children: dict[int, _N] = {}
        self.creator = creator  # first call (insertion index) whose path passes through
        self.owner = -1  # first call whose output covers this node, or -1
        self.covers: list[int] = []  # calls whose output covers this node
        self.ends: list[int] = []  # calls whose sequence ends here


def _split(x: _N, m: int) -> _N:
    """Split x at path position m (x.s < m < x.e); x keeps the lower part, returns the upper.

    The lower part keeps the object so end-node references and children stay valid.
    """
    u = _N(x.seq, x.s, m, x.parent, x.creator)
    u.owner, u.covers = x.owner, list(x.covers)
    u.children[int(x.seq[m])] = x
    x.parent.children[int(x.seq[x.s])] = u
    x.s, x.parent = m, u
    return u


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first a[i] != b[i] (equal lengths), or len(a)."""
    d = np.flatnonzero(a != b)
    return int(d[0]) if d.shape[0] else a.shape[0]


@dataclasses.dataclass
class RebuiltTree:
    root: TreeNode
    end_nodes: dict[int, TreeNode]  # call_index -> node where its prompt + output ends
    recorded_tokens: int  # sum over calls of len(prompt) + len(output)
    unique_tokens: int  # tokens in the tree
    trainable_tokens: int  # unique trainable tokens in the tree


def _check_calls(calls: Sequence[ModelCallRecord]) -> list[ModelCallRecord]:
    if not calls:
        raise ValueError("build_tree: no calls")
    first = calls[0]
    seen: dict[int, ModelCallRecord] = {}
    for c in calls:
        if not isinstance(c, ModelCallRecord):
            raise TypeError(f"build_tree: expected ModelCallRecord, got {type(c).__name__}")
        if (c.run_id, c.rollout_id) != (first.run_id, first.rollout_id):
            raise ValueError(f"build_tree: {c.where} of run {c.run_id!r} mixed with rollout {first.rollout_id!r} of run {first.run_id!r}")
        if c.call_index in seen:
            raise ValueError(f"build_tree: rollout {c.rollout_id!r} has two calls with call_index {c.call_index}")
        seen[c.call_index] = c
    return [seen[k] for k in sorted(seen)]


def rebuild(calls: Sequence[ModelCallRecord]) -> RebuiltTree:
    """The exact prefix-sharing tree of one rollout's calls (module docstring)."""
    calls = _check_calls(calls)
    root = _N(np.zeros(0, np.int32), 0, 0, None, 0)
    ends: list[_N] = []
    last_of_agent: dict[int, tuple[np.ndarray, _N]] = {}
    recorded = 0
    for ci, call in enumerate(calls):
        seq = np.concatenate([call.prompt_ids, call.output_ids])
        recorded += seq.shape[0]
        node, pos = _jump(root, seq, last_of_agent.get(call.agent_id))
        end = _walk_down(node, pos, seq, ci)
        end.ends.append(ci)
        _cover_output(end, call.prompt_ids.shape[0], ci)
        last_of_agent[call.agent_id] = (seq, end)
        ends.append(end)
    return _to_tree_nodes(root, calls, ends, recorded)


def _jump(root: _N, seq: np.ndarray, ref: tuple[np.ndarray, _N] | None) -> tuple[_N, int]:
    """Step 1: (node, position) to resume the walk from: the longest common prefix with this
    agent's previous call (``ref``: its sequence and end node), found in one compare."""
    if ref is None:
        return root, 0
    ref_seq, ref_end = ref
    m = min(seq.shape[0], ref_seq.shape[0])
    lcp = _first_mismatch(seq[:m], ref_seq[:m])
    node = ref_end
    while node.s >= lcp and node is not root:
        node = node.parent
    return node, (lcp if node is not root else 0)


def _walk_down(node: _N, pos: int, seq: np.ndarray, ci: int) -> _N:
    """Step 2: walk down from ``node`` comparing whole node spans, splitting or branching where
    ``seq`` leaves the tree; the node where call ``ci``'s sequence ends."""
    L = seq.shape[0]
    while True:
        if pos < node.e:
            n = min(node.e, L) - pos
            d = _first_mismatch(node.seq[pos : pos + n], seq[pos : pos + n])
            pos += d
            if d < n:  # diverges inside the node: branch off its upper part
                node = _split(node, pos)
                leaf = _N(seq, pos, L, node, ci)
                node.children[int(seq[pos])] = leaf
                return leaf
            if pos == L:  # ends inside (or at the end of) the node
                return _split(node, pos) if pos < node.e else node
        if pos == L:
            return node
        child = node.children.get(int(seq[pos]))
        if child is None:
            leaf = _N(seq, pos, L, node, ci)
            node.children[int(seq[pos])] = leaf
            return leaf
        node = child


def _cover_output(end: _N, P: int, ci: int) -> None:
    """Step 3, output coverage: a node boundary at the prompt's end ``P``, then the nodes of
    [P, L) on the path to ``end`` are marked as generated by call ``ci``."""
    node = end
    while node.e > P:
        if node.s < P:
            _split(node, P)
        if node.owner < 0:
            node.owner = ci
        node.covers.append(ci)
        node = node.parent


def _routing_width(calls) -> int:
    """R of the calls' recorded routing (0: none recorded); calls of one rollout must agree."""
    widths = {int(c.output_routing.shape[1]) for c in calls if c.output_routing is not None}
    if len(widths) > 1:
        raise ValueError(f"build_tree: rollout {calls[0].rollout_id!r} has routing of widths {sorted(widths)}; "
                         "one model's calls record one width")
    for c in calls:
        if c.output_routing is not None and c.output_routing.size and int(c.output_routing.max()) > 32767:
            raise ValueError(f"build_tree: {c.where}.output_routing has an expert id above 32767 (int16 rows)")
    return widths.pop() if widths else 0


def _to_tree_nodes(root: _N, calls, ends: list[_N], recorded: int) -> RebuiltTree:
    out: dict[int, TreeNode] = {}  # id(_N) -> TreeNode
    width = _routing_width(calls)
    unique = trainable = 0
    stack = [root]
    order = []
    while stack:  # pre-order, iterative
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(n.children.values()))
    for n in order:
        k = n.e - n.s
        routing = None  # prompt-only nodes hold none (serialization routes them live): no [k, R] of -1s
        if n.owner >= 0:
            oc = calls[n.owner]
            p0 = oc.prompt_ids.shape[0]
            lp = oc.output_logprobs[n.s - p0 : n.e - p0]
            if width and oc.output_routing is not None:  # the owner's, like its log-probs
                routing = oc.output_routing[n.s - p0 : n.e - p0].astype(np.int16)
            meta = oc
        else:
            lp = np.zeros(k, np.float32)
            meta = calls[n.creator]
        ids = {calls[i].call_index for i in n.covers} | {calls[i].call_index for i in n.ends}
        t = TreeNode(
            tokens=n.seq[n.s : n.e],
            trainable=np.full(k, n.owner >= 0),
            logprobs=lp,
            role=meta.role,
            agent_id=meta.agent_id,
            call_ids=tuple(sorted(ids)),
            policy_version=meta.policy_version,
            routing=routing,
        )
        out[id(n)] = t
        if n.parent is not None:
            out[id(n.parent)].children.append(t)
        unique += k
        trainable += k if n.owner >= 0 else 0
    tree_root = out[id(root)]
    if len(tree_root.children) == 1:  # contexts share a first token: no empty root
        tree_root = tree_root.children[0]
    end_nodes = {calls[i].call_index: out[id(e)] for i, e in enumerate(ends)}
    return RebuiltTree(root=tree_root, end_nodes=end_nodes, recorded_tokens=recorded, unique_tokens=unique, trainable_tokens=trainable)


def build_tree(calls: Sequence[ModelCallRecord]) -> TreeNode:
    """Root of the exact prefix-sharing tree of one rollout's calls (see ``rebuild``)."""
    return rebuild(calls).root
