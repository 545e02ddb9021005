"""Tree serializer: every path's context is exact, every trainable token is a target once."""
import numpy as np
import pytest

from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree, tree_attention_mask_np


def random_tree(rng, max_depth=4, root_len=None):
    def make(depth):
        n = int(rng.integers(1, 6))
        node = TreeNode(
            tokens=rng.integers(1, 50, n),
            trainable=rng.random(n) < 0.6,
            logprobs=-rng.random(n).astype(np.float32),
            policy_version=int(rng.integers(0, 3)),
        )
        if depth < max_depth:
            k = int(rng.choice([0, 1, 2, 3], p=[0.3, 0.3, 0.3, 0.1]))
            node.children = [make(depth + 1) for _ in range(k)]
        return node

    return make(0)


def check_tree(root):
    st = serialize_tree(root)
    mask = tree_attention_mask_np(np.ones(len(st), np.int32), st.subtree_end)
    node_paths = root.root_to_leaf_paths()
    idx_paths = st.path_indices()
    assert len(node_paths) == len(idx_paths)
    seen_targets = {}
    for nodes, idx in zip(node_paths, idx_paths):
        toks = np.concatenate([n.tokens for n in nodes])
        train = np.concatenate([n.trainable for n in nodes])
        lps = np.concatenate([n.logprobs for n in nodes])
        np.testing.assert_array_equal(st.tokens[idx], toks)
        np.testing.assert_array_equal(st.positions[idx], np.arange(len(toks)))
        np.testing.assert_array_equal(st.targets[idx[:-1]], toks[1:])
        np.testing.assert_array_equal(st.loss_mask[idx[:-1]], train[1:])
        np.testing.assert_array_equal(st.behavior_logprobs[idx[:-1]], np.where(train[1:], lps[1:], 0))
        # Exact context: position idx[k] sees exactly idx[:k+1].
        for k in range(len(idx)):
            visible = np.flatnonzero(mask[idx[k]])
            np.testing.assert_array_equal(visible, np.sort(idx[: k + 1]))
        # The path's target-bearing position for path token k+1 is unique per (node, offset).
        for k in range(len(idx) - 1):
            seen_targets.setdefault(int(idx[k]), set()).add(tuple(toks[: k + 2]))
    # Counted once: each packed position predicts one context-token pair.
    assert all(len(v) == 1 for v in seen_targets.values())
    # Every trainable token except a root's first appears exactly once as a target.
    n_train = sum(int(n.trainable.sum()) for n in root.walk()) - int(root.trainable[:1].sum())
    assert st.num_trainable == n_train
    return st


@pytest.mark.parametrize("seed", range(30))
def test_random_trees_exact(seed):
    check_tree(random_tree(np.random.default_rng(seed)))


def test_branch_point_moves_last_token():
    prompt = TreeNode.span([1, 2, 3])
    a = TreeNode.span([10, 11], trainable=True)
    b = TreeNode.span([20], trainable=True)
    prompt.children = [a, b]
    st = check_tree(prompt)
    np.testing.assert_array_equal(st.tokens, [1, 2, 3, 10, 11, 3, 20])
    np.testing.assert_array_equal(st.targets, [2, 3, 10, 11, 0, 20, 0])
    np.testing.assert_array_equal(st.positions, [0, 1, 2, 3, 4, 2, 3])
    np.testing.assert_array_equal(st.subtree_end, [7, 7, 5, 5, 5, 7, 7])
    np.testing.assert_array_equal(st.loss_mask, [0, 0, 1, 1, 0, 1, 0])


def test_single_token_branch_nodes_chain():
    # A one-token node with two children loses its only token to them.
    mid = TreeNode.span([5], children=[TreeNode.span([6], trainable=True), TreeNode.span([7], trainable=True)])
    root = TreeNode.span([1, 2], children=[mid, TreeNode.span([9], trainable=True)])
    check_tree(root)


def test_empty_inner_node_rejected():
    root = TreeNode.span([1], children=[TreeNode.span([], children=[TreeNode.span([2])])])
    with pytest.raises(ValueError, match="no tokens"):
        serialize_tree(root)


def test_pack_rows_segments_and_padding():
    rng = np.random.default_rng(0)
    trees = [serialize_tree(random_tree(rng, 2)) for _ in range(3)]
    L = sum(len(t) for t in trees) + 5
    rows = pack_rows([trees], L)
    mask = tree_attention_mask_np(rows.segment_ids[0], rows.subtree_end[0])
    start = 0
    for seg, t in enumerate(trees, 1):
        n = len(t)
        sub = mask[start : start + n, start : start + n]
        ref = tree_attention_mask_np(np.ones(n, np.int32), t.subtree_end)
        np.testing.assert_array_equal(sub, ref)
        assert not mask[start : start + n, :start].any() and not mask[start : start + n, start + n :].any()
        start += n
    pad = np.arange(start, L)
    np.testing.assert_array_equal(mask[pad][:, pad], np.eye(len(pad), dtype=bool))
    assert not rows.loss_mask[0, start:].any()
    with pytest.raises(ValueError, match="row_len"):
        pack_rows([trees], L - 6)


def test_array_contracts_are_checked_and_named():
    """serialize_tree and pack_rows check the arrays they build (chex); a broken one names its field."""
    import dataclasses

    rng = np.random.default_rng(3)
    st = serialize_tree(random_tree(rng, 2))
    st.check()
    rows = pack_rows([[st]], len(st) + 2)
    rows.check()
    with pytest.raises(AssertionError, match=r"input 2 has type int64 but expected bool.*'loss_mask'"):
        dataclasses.replace(st, loss_mask=st.loss_mask.astype(np.int64)).check()
    with pytest.raises(AssertionError, match=r"node_ranges must be \[nodes, 2\]"):
        dataclasses.replace(st, node_ranges=st.node_ranges[:, :1]).check()
    with pytest.raises(AssertionError, match=r"input 8 has shape \(1, 3\).*'loss_weights'"):
        dataclasses.replace(rows, loss_weights=np.zeros((1, 3), np.float32)).check("packed")


@pytest.mark.parametrize("seed", range(20))
def test_routing_sits_at_each_targets_predicting_position(seed):
    """Routing replay: a token's recorded routing (from the decode step that sampled it) lands where its
    log-prob does, at the position predicting it, along every path (branch copies take each child's);
    positions whose target has none hold -1 (routed live); pack_rows keeps it per row."""
    rng = np.random.default_rng(seed)
    root = random_tree(rng)
    for i, node in enumerate(root.walk()):
        if i % 2:  # some nodes recorded (sampled), others prompts
            node.routing = rng.integers(0, 8, (node.tokens.shape[0], 3)).astype(np.int16)
    if all(n.routing is None for n in root.walk()):
        root.routing = np.zeros((root.tokens.shape[0], 3), np.int16)
    st = serialize_tree(root)
    for nodes, idx in zip(root.root_to_leaf_paths(), st.path_indices()):
        want = np.concatenate([n.routing if n.routing is not None else np.full((n.tokens.shape[0], 3), -1, np.int16)
                               for n in nodes])
        np.testing.assert_array_equal(st.tokens[idx], np.concatenate([n.tokens for n in nodes]))
        np.testing.assert_array_equal(st.routing[idx[:-1]], want[1:])
    ends = np.ones(len(st), bool)
    ends[np.concatenate([i[:-1] for i in st.path_indices()])] = False
    assert (st.routing[ends] == -1).all()  # a path's last token predicts nothing
    rows = pack_rows([[st]], len(st) + 3)
    np.testing.assert_array_equal(rows.routing[0, : len(st)], st.routing)
    assert rows.routing.dtype == np.int16 and (rows.routing[0, len(st):] == -1).all()
    with pytest.raises(ValueError, match="rows take 0"):  # a dense model's rows cannot take routed trees
        pack_rows([[st]], len(st), routing_width=0)
