"""Path selection: role priority, trainable-token ties, modes, input untouched."""
import numpy as np
import pytest

from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.select import SelectConfig, select_paths


def leaf(tag, n_train, role):
    return TreeNode.span([tag] * max(n_train, 1), trainable=n_train > 0, role=role, call_ids=(tag,))


def fixture_tree():
    # sys prompt -> 8 leaves: main (3), subagent (3), summary (2), varied trainable counts.
    kids = [
        leaf(1, 2, "summary"), leaf(2, 5, "main"), leaf(3, 1, "subagent"), leaf(4, 5, "main"),
        leaf(5, 7, "subagent"), leaf(6, 9, "summary"), leaf(7, 3, "main"), leaf(8, 4, "subagent"),
    ]
    return TreeNode.span([100, 101], children=kids)


def leaf_tags(tree):
    return [int(p[-1].tokens[0]) for p in tree.root_to_leaf_paths()]


def test_priority_order_and_ties():
    root = fixture_tree()
    res = select_paths(root, SelectConfig(jmax=5))
    # main by trainable desc (2 and 4 tie at 5: earlier leaf first), then subagent 5 (7), 8 (4).
    assert res.selected_roles == ("main", "main", "main", "subagent", "subagent")
    assert sorted(leaf_tags(res.tree)) == [2, 4, 5, 7, 8]
    assert leaf_tags(res.tree) == [2, 4, 5, 7, 8]  # original child order kept
    assert res.paths_total == 8 and res.paths_selected == 5
    assert res.tokens_total == 2 + 2 + 5 + 1 + 5 + 7 + 9 + 3 + 4
    assert res.tokens_kept == 2 + 5 + 5 + 7 + 3 + 4
    assert res.trainable_kept == 5 + 5 + 7 + 3 + 4
    assert res.expanded_tokens == 5 * 2 + 24
    res2 = select_paths(root, SelectConfig(jmax=2))
    assert leaf_tags(res2.tree) == [2, 4]
    res7 = select_paths(root, SelectConfig(jmax=7))
    assert sorted(leaf_tags(res7.tree)) == [2, 3, 4, 5, 6, 7, 8]  # summary 6 (9 tokens) before 1


def plain_trainable(root, tags=None):
    """Unique trainable token positions on the root-to-leaf paths whose leaf tag is in tags (all if None)."""
    seen = set()
    for path in root.root_to_leaf_paths():
        if tags is None or int(path[-1].tokens[0]) in tags:
            seen |= {(id(x), k) for x in path for k in np.flatnonzero(x.trainable)}
    return len(seen)


@pytest.mark.parametrize("jmax", [1, 2, 3, 5, 9])
def test_trainable_kept_and_total_exact(jmax):
    # Shared trainable prefixes (counted once) and paths of every role.
    a2 = TreeNode.span([5] * 5, trainable=True, children=[leaf(7, 2, "summary"), leaf(12, 4, "subagent")])
    a1 = TreeNode.span([4] * 5, trainable=True, children=[leaf(6, 1, "main"), a2])
    trees = [fixture_tree(), TreeNode.span([1], children=[a1, leaf(8, 3, "subagent"), leaf(9, 0, "main")])]
    for root in trees:
        res = select_paths(root, SelectConfig(jmax=jmax))
        assert res.trainable_total == plain_trainable(root)
        assert res.trainable_kept == plain_trainable(root, set(leaf_tags(res.tree)))
    assert select_paths(trees[0], SelectConfig(jmax=jmax)).trainable_total == 2 + 5 + 1 + 5 + 7 + 9 + 3 + 4


def test_modes_and_input_untouched():
    root = fixture_tree()
    before = [(n.tokens.copy(), len(n.children)) for n in root.walk()]
    u = select_paths(root, SelectConfig(mode="unbounded", jmax=1))
    assert sorted(leaf_tags(u.tree)) == list(range(1, 9)) and u.tokens_kept == u.tokens_total
    assert u.selected_roles == ("summary", "main", "subagent", "main", "subagent", "summary", "main", "subagent")
    m = select_paths(root, SelectConfig(mode="main_only", jmax=2))
    assert m.selected_roles == ("main", "main") and leaf_tags(m.tree) == [2, 4]
    after = [(n.tokens, len(n.children)) for n in root.walk()]
    assert len(before) == len(after)
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(before, after))
    assert u.tree is not root and all(x is not y for x in u.tree.walk() for y in root.walk())
    no_main = TreeNode.span([1], children=[leaf(2, 1, "subagent")])
    r = select_paths(no_main, SelectConfig(mode="main_only"))
    assert r.tree is None and r.paths_selected == 0
    with pytest.raises(ValueError, match="mode"):
        SelectConfig(mode="all")
    with pytest.raises(ValueError, match="jmax"):
        SelectConfig(jmax=0)


def test_priority_is_per_token_role_not_leaf_role():
    # A compacted main context ends in its summary call: the path's leaf is a summary
    # node but it carries the context's main-agent tokens, so it outranks a retry stub.
    a2 = TreeNode.span([5] * 5, trainable=True, children=[leaf(7, 2, "summary")])
    a1 = TreeNode.span([4] * 5, trainable=True, children=[leaf(6, 1, "main"), a2])
    root = TreeNode.span([1], children=[a1, leaf(8, 3, "subagent")])
    res = select_paths(root, SelectConfig(jmax=1))
    assert leaf_tags(res.tree) == [7] and res.selected_roles == ("main",)
    res = select_paths(root, SelectConfig(jmax=3))
    # then the retry (1 new main token) before the sub-agent (3 sub-agent tokens)
    assert res.selected_roles == ("main", "main", "subagent") and leaf_tags(res.tree) == [6, 7, 8]
    m = select_paths(root, SelectConfig(mode="main_only", jmax=5))
    assert leaf_tags(m.tree) == [6, 7] and m.selected_roles == ("main", "main")
    # A sub-agent path sharing trainable main tokens with a picked path is a sub-agent path.
    shared = TreeNode.span([5, 6, 7, 8], trainable=True, role="main")
    shared.children = [leaf(9, 1, "main"), leaf(10, 1, "subagent")]
    root = TreeNode.span([1], children=[shared, leaf(11, 3, "main")])
    res = select_paths(root, SelectConfig(jmax=3))
    assert leaf_tags(res.tree) == [9, 10, 11] and res.selected_roles == ("main", "main", "subagent")
    assert res.tokens_kept == 1 + 4 + 1 + 1 + 3


def test_gain_not_static_count_avoids_near_duplicate_retries():
    # One long context with two retries at its end, and a second, shorter context.
    ctx = TreeNode.span([5] * 10, trainable=True, children=[leaf(1, 2, "main"), leaf(2, 1, "main")])
    root = TreeNode.span([9], children=[ctx, leaf(3, 8, "main")])
    res = select_paths(root, SelectConfig(jmax=2))
    # Static counts would pick both retries (12, 11); gains pick 12 then the other context's 8.
    assert leaf_tags(res.tree) == [1, 3] and res.trainable_kept == 20
    res3 = select_paths(root, SelectConfig(jmax=3))
    assert leaf_tags(res3.tree) == [1, 2, 3]
    # A path that adds no trainable token is never picked in the budgeted modes.
    zero = TreeNode.span([9], children=[leaf(1, 2, "main"), leaf(2, 0, "main")])
    assert leaf_tags(select_paths(zero, SelectConfig(jmax=5)).tree) == [1]
    assert leaf_tags(select_paths(zero, SelectConfig(mode="unbounded")).tree) == [1, 2]


def test_deterministic_and_deep():
    # 2000-deep chain: no recursion limits; the same call twice gives the same tree.
    node = TreeNode.span([1], role="main")
    root = node
    for k in range(2000):
        nxt = TreeNode.span([k + 2], trainable=True)
        node.children = [nxt, leaf(k + 5000, 1, "summary")]
        node = nxt
    a, b = select_paths(root), select_paths(root)
    assert leaf_tags(a.tree) == leaf_tags(b.tree) and a.paths_total == 2001
    assert a.selected_roles[0] == "main" and a.paths_selected == 5
