"""Splitting and bin-packing: exact context per part, each trainable token a target once,
rollout-first weights that sum to 1 over the step."""
import numpy as np
import pytest

from gyre_jax.trajectory.binpack import (
    PathTooLongError,
    first_fit_decreasing,
    pack_trees,
    serialized_len,
    split_tree,
)
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import serialize_tree, tree_attention_mask_np


def random_tree(rng, max_depth=4, max_len=6):
    def make(depth):
        n = int(rng.integers(1, max_len))
        node = TreeNode(
            tokens=rng.integers(1, 50, n),
            trainable=rng.random(n) < 0.6,
            logprobs=-rng.random(n).astype(np.float32),
            policy_version=int(rng.integers(0, 3)),
        )
        if depth < max_depth:
            k = int(rng.choice([0, 1, 2, 3], p=[0.25, 0.3, 0.3, 0.15]))
            node.children = [make(depth + 1) for _ in range(k)]
        return node

    return make(0)


def max_path_len(root):
    return max(sum(n.tokens.shape[0] for n in p) for p in root.root_to_leaf_paths())


def targets_with_context(st, mask):
    """Multiset of (context tokens..., target, logprob, version) for every loss position,
    read through the attention mask (what the model actually sees)."""
    out = []
    for i in np.flatnonzero(st.loss_mask):
        vis = np.flatnonzero(mask[i])
        # Context in position order must be 0..k exactly (exact positions, no gaps).
        np.testing.assert_array_equal(st.positions[vis], np.arange(vis.size))
        out.append((tuple(st.tokens[vis]), int(st.targets[i]), float(st.behavior_logprobs[i]), int(st.target_version[i])))
    return sorted(out)


def check_parts_exact(root, parts):
    """Each part: every path's visible set is exactly its prefix, and the path is a prefix
    of an original root-to-leaf path (same tokens, same positions)."""
    orig = [np.concatenate([n.tokens for n in p]) for p in root.root_to_leaf_paths()]
    for st in parts:
        mask = tree_attention_mask_np(np.ones(len(st), np.int32), st.subtree_end)
        for idx in st.path_indices():
            toks = st.tokens[idx]
            np.testing.assert_array_equal(st.positions[idx], np.arange(len(idx)))
            assert any(len(o) >= len(toks) and np.array_equal(o[: len(toks)], toks) for o in orig)
            for k in range(len(idx)):
                np.testing.assert_array_equal(np.flatnonzero(mask[idx[k]]), np.sort(idx[: k + 1]))


@pytest.mark.parametrize("seed", range(12))
def test_split_exact_and_counted_once(seed):
    rng = np.random.default_rng(seed)
    root = random_tree(rng)
    full = serialize_tree(root)
    assert serialized_len(root) == len(full)
    L = max(max_path_len(root), int(rng.integers(4, 20)))
    res = split_tree(root, L)
    assert all(len(p) <= L for p in res.parts)
    check_parts_exact(root, res.parts)
    # Counted once: the (context, target) multiset over all parts equals the unsplit one.
    ref = targets_with_context(full, tree_attention_mask_np(np.ones(len(full), np.int32), full.subtree_end))
    got = []
    for st in res.parts:
        got += targets_with_context(st, tree_attention_mask_np(np.ones(len(st), np.int32), st.subtree_end))
    assert sorted(got) == ref
    assert sum(p.num_trainable for p in res.parts) == full.num_trainable
    # Duplicated tokens are exactly the extra tokens beyond the unsplit serialization,
    # up to branch copies that a split removes (a branch node split across parts).
    assert sum(len(p) for p in res.parts) <= len(full) + res.duplicated_tokens
    if len(full) <= L:
        assert len(res.parts) == 1 and res.duplicated_tokens == 0


def test_empty_root_sizes_exact():
    # tree.py gives an empty root when contexts share no first token.
    root = TreeNode.span([], children=[TreeNode.span([1, 2, 3], children=[TreeNode.span([4], trainable=True)]),
                                       TreeNode.span([5, 6], children=[TreeNode.span([7], trainable=True)])])
    assert serialized_len(root) == len(serialize_tree(root)) == 7
    assert len(split_tree(root, 7).parts) == 1
    parts = split_tree(root, 4).parts
    assert [len(p) for p in parts] == [4, 3] and sum(p.num_trainable for p in parts) == 2


def test_split_carries_ancestor_path_untrained():
    sys = TreeNode.span([1, 2, 3], trainable=False)
    a = TreeNode.span([10, 11, 12, 13], trainable=True)
    b = TreeNode.span([20, 21, 22, 23], trainable=True)
    sys.children = [a, b]
    res = split_tree(sys, 8)
    assert len(res.parts) == 2 and res.duplicated_tokens == 3
    p0, p1 = res.parts
    np.testing.assert_array_equal(p0.tokens, [1, 2, 3, 10, 11, 12, 13])
    np.testing.assert_array_equal(p1.tokens, [1, 2, 3, 20, 21, 22, 23])
    np.testing.assert_array_equal(p1.positions, np.arange(7))
    # The copy's last token predicts b's first token (trainable); copies themselves are not targets.
    np.testing.assert_array_equal(p1.loss_mask, [0, 0, 1, 1, 1, 1, 0])

    # Trainable ancestors: owned by the first part only.
    root = TreeNode.span([1, 2], trainable=True, children=[
        TreeNode.span([3, 4, 5], trainable=True), TreeNode.span([6, 7, 8], trainable=True)])
    parts = split_tree(root, 5).parts
    np.testing.assert_array_equal(parts[0].loss_mask, [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(parts[1].loss_mask, [0, 1, 1, 1, 0])


def test_path_longer_than_row_is_an_error():
    root = TreeNode.span([1, 2, 3], children=[TreeNode.span([4, 5, 6, 7], trainable=True, call_ids=(9,))])
    with pytest.raises(PathTooLongError, match=r"rollout 'r7'.*call_ids=\(9,\).*7 tokens.*row_len=6"):
        split_tree(root, 6, name="rollout 'r7'")
    with pytest.raises(PathTooLongError, match="rollout 'r7'"):
        pack_trees([root], [0.0], 6, names=["rollout 'r7'"])


def test_first_fit_decreasing():
    rows = first_fit_decreasing([5, 3, 7, 2, 4, 1], 8)
    L = np.array([5, 3, 7, 2, 4, 1])
    assert sorted(k for r in rows for k in r) == list(range(6))
    assert all(L[r].sum() <= 8 for r in rows)
    assert rows == [[2, 5], [0, 1], [4, 3]]  # FFD by hand: 7,5,4,3,2,1
    with pytest.raises(ValueError, match="row_len"):
        first_fit_decreasing([9], 8)


def test_pack_trees_weights_advantages_fill():
    rng = np.random.default_rng(7)
    trees = [random_tree(rng, max_depth=3) for _ in range(6)]
    for t in trees:  # every rollout has trainable targets
        t.children.append(TreeNode.span([7, 8], trainable=True))
    trees[3] = None  # nothing selected: no tokens, still one of the R rollouts
    adv = np.array([0.5, -1.0, 2.0, 0.0, 0.25, -0.75], np.float32)
    L = max(max_path_len(t) for t in trees if t is not None) + 4
    res = pack_trees(trees, adv, L, num_step_rollouts=6)
    rows = res.rows
    mask = tree_attention_mask_np(rows.segment_ids, rows.subtree_end)
    for r, t in enumerate(trees):
        sel = res.rollout_index == r
        if t is None:
            assert not sel.any()
            continue
        n_r = int((rows.loss_mask & sel).sum())
        assert n_r == serialize_tree(t).num_trainable == res.num_targets[r]
        np.testing.assert_allclose(rows.loss_weights[rows.loss_mask & sel], 1.0 / (n_r * 6), rtol=1e-6)
        np.testing.assert_array_equal(rows.advantages[sel], adv[r])
        # No position of rollout r sees a token of another rollout (segments isolate).
        b, i = np.nonzero(sel)
        for bb, ii in zip(b[:50], i[:50]):
            assert (res.rollout_index[bb][mask[bb, ii]] == r).all()
    assert not rows.loss_weights[~rows.loss_mask].any()
    assert res.rollout_index[rows.segment_ids == 0].max(initial=-1) == -1
    # 5 of 6 rollouts have tokens: weights sum to 5/6 with R=6, to 1 over the 5 trained.
    np.testing.assert_allclose(rows.loss_weights.astype(np.float64).sum(), 5 / 6, rtol=1e-5)
    res5 = pack_trees([t for t in trees if t is not None], adv[[0, 1, 2, 4, 5]], L)
    np.testing.assert_allclose(res5.rows.loss_weights.astype(np.float64).sum(), 1.0, rtol=1e-5)
    assert res.packed_tokens == int((rows.segment_ids > 0).sum())
    assert res.packed_tokens == res.unique_tokens + res.duplicated_tokens + res.branch_copies
    assert 0 < res.fill <= 1


def test_streaming_weights_sum_over_calls():
    rng = np.random.default_rng(3)
    trees = [random_tree(rng, max_depth=3) for _ in range(4)]
    for t in trees:
        t.children.append(TreeNode.span([7, 8], trainable=True))
    L = max(max_path_len(t) for t in trees) + 2
    a = pack_trees(trees[:2], [1.0, -1.0], L, num_step_rollouts=4)
    b = pack_trees(trees[2:], [1.0, -1.0], L, num_step_rollouts=4)
    total = a.rows.loss_weights.astype(np.float64).sum() + b.rows.loss_weights.astype(np.float64).sum()
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    with pytest.raises(ValueError, match="num_step_rollouts"):
        pack_trees(trees, [0.0] * 4, L, num_step_rollouts=3)
