"""Path selection: keep at most Jmax root-to-leaf paths of a rollout's tree.

Definitions (precise, because the ablations depend on them):
  * A *path* is a root-to-leaf node list of the rebuilt tree. Each leaf ends a
    recorded call (prompt + output), so a path is one context the model saw.
  * A trainable token's *role* is its node's role: the role of the call whose
    output produced it (tree.py's owner).
  * The *gain* of a path for role r is the number of trainable tokens of role r
    it adds to the paths already chosen (on its nodes not yet kept).
  * The *role of a path* (reported) is the highest-priority role with a positive
    gain when it was picked (``unbounded``: the highest-priority role it has
    trainable tokens of).

Order (greedy, deterministic): repeatedly take the path with the lexicographically
largest (main gain, subagent gain, summary gain), then the earliest leaf in
depth-first pre-order, recomputing gains after each pick. So role priority is
main > subagent > summary, ties broken by trainable tokens, exactly as the paper
says, but per token rather than per leaf. Why not "the role of the leaf's call":
a compacted context's main path ends in its summary call (the summary prompt
extends the context), so by leaf role every whole main context would count as a
summary path and the only "main" paths left would be retry and drift stubs. Why
gains, not a path's own count: retries deep in one long context each carry that
context's whole trainable prefix, and a static count would spend the budget on
near-duplicates of one context. Paths with zero gain train nothing and are never
picked in the budgeted modes.

Modes:
  * ``priority`` (default): up to ``jmax`` paths in that order.
  * ``unbounded``: every path (ablation: no budget).
  * ``main_only``: up to ``jmax`` paths ranked by main gain alone; a path that
    adds no main-agent token is never picked (the paper's "main path only"
    ablation; a path is atomic, so a compacted context brings its summary call).

The result is a new tree (union of the chosen paths); the input is not mutated.
Node token arrays are shared with the input (read-only by convention).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.vocab import ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUMMARY, ROLES

SELECT_MODES = ("priority", "unbounded", "main_only")
_ROLE_RANK = {r: i for i, r in enumerate(ROLES)}  # main=0 < subagent=1 < summary=2
assert ROLES == (ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUMMARY), "select.py's priority follows vocab.ROLES order"


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
    tree: TreeNode | None  # None when no path qualifies (no trainable token; main_only: no main token)
    paths_total: int
    paths_selected: int
    selected_roles: tuple  # role of each selected path, in selection order
    tokens_total: int  # unique tokens of the input tree
    tokens_kept: int  # unique tokens of the selected tree
    trainable_total: int
    trainable_kept: int
    expanded_tokens: int  # sum of the selected paths' lengths (each path expanded alone)
    # Which nodes of the input tree the selected tree keeps: their indices in ``root.preorder()``
    # (the run report marks the trained part of a rollout's tree with them).
    kept: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Counts:
    """One pre-order pass over a tree: its nodes, their parents, and the counts selection ranks by."""

    nodes: list  # TreeNode in pre-order
    parent: np.ndarray  # parent index of each node (-1: the root)
    ntok: np.ndarray  # tokens per node
    ntr: np.ndarray  # trainable tokens per node
    path_tok: np.ndarray  # tokens on the root path ending at each node
    leaves: np.ndarray  # leaf indices, in pre-order
    # Per-role trainable counts along each root path, [n + 1, roles]; row n: "no kept node" (zeros).
    # The kept set is closed under ancestors, so a path's gain is its count minus the count at its
    # deepest kept node.
    cum: np.ndarray

    @classmethod
    def of(cls, root: TreeNode) -> _Counts:
        nodes, parent = root.preorder()
        n = len(nodes)
        ntok = np.fromiter((x.tokens.shape[0] for x in nodes), np.int64, n)
        ntr = np.fromiter((int(np.count_nonzero(x.trainable)) for x in nodes), np.int64, n)
        path_tok = ntok.copy()
        for i in range(1, n):  # pre-order: parent before child
            path_tok[i] += path_tok[parent[i]]
        leaves = np.array([i for i in range(n) if not nodes[i].children], np.int64)
        role_idx = np.fromiter((_ROLE_RANK[x.role] for x in nodes), np.int64, n)
        cum = np.zeros((n + 1, len(ROLES)), np.int64)
        cum[np.arange(n), role_idx] = ntr
        for i in range(1, n):
            cum[i] += cum[parent[i]]
        return cls(nodes, np.asarray(parent), ntok, ntr, path_tok, leaves, cum)


def select_paths(root: TreeNode, config: SelectConfig = SelectConfig()) -> SelectionResult:
    c = _Counts.of(root)
    keep = np.zeros(len(c.nodes), bool)
    cand, roles = _pick_all(c, keep) if config.mode == "unbounded" else _pick_greedy(c, keep, config)
    tokens_total, trainable_total = int(c.ntok.sum()), int(c.ntr.sum())
    if not cand:
        return SelectionResult(None, int(c.leaves.size), 0, (), tokens_total, 0, trainable_total, 0, 0)
    return SelectionResult(
        tree=_kept_tree(c, keep),
        paths_total=int(c.leaves.size),
        paths_selected=len(cand),
        selected_roles=tuple(roles),
        tokens_total=tokens_total,
        tokens_kept=int(c.ntok[keep].sum()),
        trainable_total=trainable_total,
        trainable_kept=int(c.ntr[keep].sum()),
        expanded_tokens=int(c.path_tok[cand].sum()),
        kept=tuple(int(i) for i in np.flatnonzero(keep)),
    )


def _pick_all(c: _Counts, keep: np.ndarray) -> tuple[list[int], list[str]]:
    """``unbounded``: every path. No pick order: a path's role is the highest-priority role it has tokens of."""
    cand = [int(i) for i in c.leaves]
    roles = []
    for leaf in cand:
        _mark_path(keep, c.parent, leaf)
    for i in cand:
        has = np.flatnonzero(c.cum[i])
        roles.append(ROLES[int(has[0])] if has.size else c.nodes[i].role)
    return cand, roles


def _pick_greedy(c: _Counts, keep: np.ndarray, config: SelectConfig) -> tuple[list[int], list[str]]:
    """``priority`` / ``main_only``: up to jmax paths by largest gain (module docstring), marking them in ``keep``."""
    n = len(c.nodes)
    nroles = 1 if config.mode == "main_only" else len(ROLES)
    allowed = np.ones(c.leaves.size, bool)
    cand: list[int] = []
    roles: list[str] = []
    for _ in range(config.jmax):
        deepest = [n] * n  # deepest kept ancestor-or-self of each node (n: none)
        for i in range(n):
            deepest[i] = i if keep[i] else (deepest[c.parent[i]] if i else n)
        g = c.cum[c.leaves] - c.cum[np.asarray(deepest, np.int64)[c.leaves]]
        gain = g[:, :nroles] * allowed[:, None]
        if not gain.any():
            break
        # Largest (main, subagent, summary) gain, then earliest leaf. lexsort: last key is primary.
        keys = [c.leaves] + [-gain[:, r] for r in range(nroles - 1, -1, -1)]
        k = int(np.lexsort(keys)[0])
        cand.append(int(c.leaves[k]))
        roles.append(ROLES[int(np.flatnonzero(gain[k])[0])])
        _mark_path(keep, c.parent, int(c.leaves[k]))
        allowed[k] = False
    return cand, roles


def _kept_tree(c: _Counts, keep: np.ndarray) -> TreeNode | None:
    """The kept nodes rebuilt bottom-up (reverse pre-order: children before parents), in the original child order."""
    n = len(c.nodes)
    new: list[TreeNode | None] = [None] * n
    kept_children: list[list[TreeNode]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if not keep[i]:
            continue
        x = c.nodes[i]
        kids = kept_children[i]
        kids.reverse()  # filled in reverse pre-order
        node = TreeNode(
            tokens=x.tokens, trainable=x.trainable, logprobs=x.logprobs, children=kids,
            role=x.role, agent_id=x.agent_id, call_ids=x.call_ids, policy_version=x.policy_version,
            routing=x.routing,
        )
        new[i] = node
        if c.parent[i] >= 0:
            kept_children[c.parent[i]].append(node)
    return new[0]


def _mark_path(keep: np.ndarray, parent: np.ndarray, leaf: int) -> None:
    i = leaf
    while i >= 0 and not keep[i]:
        keep[i] = True
        i = parent[i]
