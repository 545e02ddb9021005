"""Path selection: keep at most Jmax root-to-leaf paths of a rollout's tree.

Definitions (precise, because the ablations depend on them):
  * A *path* is a root-to-leaf node list of the rebuilt tree. Each leaf ends a
    recorded call (prompt + output), so a path is one context the model saw.
  * The *role of a path* is the role of its leaf node, i.e. of the call whose
    output ends it (a sub-agent's path can share the system prompt with a main
    path; the shared prefix does not make it a main path).
  * The *gain* of a path is the number of trainable tokens it adds to the paths
    already chosen (its trainable tokens on nodes not yet kept).

Order (greedy, deterministic): repeatedly take the path with the best key
(role priority main > subagent > summary, then larger gain, then the leaf's
depth-first pre-order index), recomputing gains after each pick. Ranking by gain
rather than by a path's own trainable count matters: retries deep in one long
context each carry that context's whole trainable prefix, and a static count would
spend the whole budget on near-duplicates of one context. Paths with zero gain
train nothing and are never picked (in the budgeted modes).

Modes:
  * ``priority`` (default): up to ``jmax`` paths in that order.
  * ``unbounded``: every path (ablation: no budget).
  * ``main_only``: main-role paths only, still at most ``jmax`` (ablation: the
    paper's "main path only" baseline).

The result is a new tree (union of the chosen paths); the input is not mutated.
Node token arrays are shared with the input (read-only by convention).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre_jax.trajectory.node import ROLES, TreeNode

SELECT_MODES = ("priority", "unbounded", "main_only")
_ROLE_RANK = {r: i for i, r in enumerate(ROLES)}  # main=0 < subagent=1 < summary=2
assert ROLES == ("main", "subagent", "summary"), "select.py's priority follows node.ROLES order"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectConfig:
    mode: str = "priority"  # one of SELECT_MODES
    jmax: int = 5  # paths per rollout in 'priority' and 'main_only'

    def __post_init__(self):
        if self.mode not in SELECT_MODES:
            raise ValueError(f"SelectConfig.mode={self.mode!r}; known: {SELECT_MODES}")
        if not (isinstance(self.jmax, int) and self.jmax >= 1):
            raise ValueError(f"SelectConfig.jmax={self.jmax!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class SelectionResult:
    tree: TreeNode | None  # None when no path qualifies (main_only on a tree without main paths)
    paths_total: int
    paths_selected: int
    selected_roles: tuple  # role of each selected path, in selection order
    tokens_total: int  # unique tokens of the input tree
    tokens_kept: int  # unique tokens of the selected tree
    trainable_total: int
    trainable_kept: int
    expanded_tokens: int  # sum of the selected paths' lengths (each path expanded alone)


def select_paths(root: TreeNode, config: SelectConfig = SelectConfig()) -> SelectionResult:
    # One pre-order pass: parent, per-node token/trainable counts, path lengths.
    nodes, parent = [], []
    stack = [(root, -1)]
    while stack:
        node, par = stack.pop()
        idx = len(nodes)
        nodes.append(node)
        parent.append(par)
        for c in reversed(node.children):
            stack.append((c, idx))
    n = len(nodes)
    ntok = np.fromiter((x.tokens.shape[0] for x in nodes), np.int64, n)
    ntr = np.fromiter((int(np.count_nonzero(x.trainable)) for x in nodes), np.int64, n)
    path_tok = ntok.copy()
    for i in range(1, n):  # pre-order: parent before child
        path_tok[i] += path_tok[parent[i]]
    leaves = np.array([i for i in range(n) if not nodes[i].children], np.int64)
    role_rank = np.array([_ROLE_RANK[nodes[i].role] for i in leaves], np.int64)
    keep = np.zeros(n, bool)

    if config.mode == "unbounded":
        cand = [int(i) for i in leaves]
        for leaf in cand:
            _mark_path(keep, parent, leaf)
    else:
        allowed = np.ones(leaves.size, bool) if config.mode == "priority" else role_rank == 0
        cand = []
        ntr_l = ntr.tolist()
        for _ in range(config.jmax):
            # New trainable tokens on the path to each node (pre-order: parent first).
            gain_node = [0] * n
            for i in range(n):
                own = 0 if keep[i] else ntr_l[i]
                gain_node[i] = own + (gain_node[parent[i]] if i else 0)
            gain = np.where(allowed, np.asarray(gain_node, np.int64)[leaves], 0)
            if not gain.any():
                break
            # Best: lowest role rank, then largest gain, then earliest leaf (lexsort: last key first).
            order = np.lexsort((leaves, -gain, role_rank + np.where(gain > 0, 0, len(ROLES))))
            k = int(order[0])
            cand.append(int(leaves[k]))
            _mark_path(keep, parent, int(leaves[k]))
            allowed[k] = False

    tokens_total, trainable_total = int(ntok.sum()), int(ntr.sum())
    if not cand:
        return SelectionResult(None, int(leaves.size), 0, (), tokens_total, 0, trainable_total, 0, 0)

    # Rebuild kept nodes bottom-up (reverse pre-order: children before parents),
    # preserving the original child order.
    new: list[TreeNode | None] = [None] * n
    kept_children: list[list[TreeNode]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if not keep[i]:
            continue
        x = nodes[i]
        kids = kept_children[i]
        kids.reverse()  # filled in reverse pre-order
        new[i] = TreeNode(
            tokens=x.tokens, trainable=x.trainable, logprobs=x.logprobs, children=kids,
            role=x.role, agent_id=x.agent_id, call_ids=x.call_ids, policy_version=x.policy_version,
        )
        if parent[i] >= 0:
            kept_children[parent[i]].append(new[i])

    return SelectionResult(
        tree=new[0],
        paths_total=int(leaves.size),
        paths_selected=len(cand),
        selected_roles=tuple(nodes[i].role for i in cand),
        tokens_total=tokens_total,
        tokens_kept=int(ntok[keep].sum()),
        trainable_total=trainable_total,
        trainable_kept=int(ntr[keep].sum()),
        expanded_tokens=int(path_tok[cand].sum()),
    )


def _mark_path(keep: np.ndarray, parent: list, leaf: int) -> None:
    i = leaf
    while i >= 0 and not keep[i]:
        keep[i] = True
        i = parent[i]
