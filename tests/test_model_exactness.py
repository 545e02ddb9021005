"""Exact context: log-probs read from a tree-packed row equal those of each
root-to-leaf path run alone as a plain causal sequence (float32, <= 1e-5).

Trees cover the shapes a long agent run produces: a retry (two outputs for one
prompt), a compaction (a new context sharing only the system prompt), a
sub-agent (its own root, so its own segment in the row) and a nested branch.
"""
import jax
import numpy as np
import pytest

from gyre_jax.model import Transformer, init_params, model_config_tiny
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree

TOL = 1e-5
ROW_LEN = 96
PATH_LEN = 48  # every single path is padded to this for the reference run
VOCAB = 128  # model_config_tiny().vocab_size


def span(rng, n, trainable=False, **meta):
    return TreeNode.span(rng.integers(1, VOCAB, n), trainable=trainable, **meta)


def retry_tree(rng):
    prompt = span(rng, 9)
    prompt.children = [span(rng, 6, True), span(rng, 4, True)]
    return prompt


def compaction_tree(rng):
    system = span(rng, 5)
    first = span(rng, 4)  # user turn of the first context
    first.children = [span(rng, 5, True, children=[span(rng, 3, children=[span(rng, 4, True)])])]
    summary_ctx = span(rng, 4, role="summary")  # new context: system prompt + summary only
    summary_ctx.children = [span(rng, 5, True, role="summary")]
    system.children = [first, summary_ctx]
    return system


def subagent_tree(rng):
    return span(rng, 6, role="subagent", agent_id=1, children=[span(rng, 5, True, role="subagent", agent_id=1)])


def nested_branch_tree(rng):
    # root -> a -> {b -> {c, d}, e}: a branch inside a branch, and a one-token node.
    c, d = span(rng, 2, True), span(rng, 3, True)
    b = span(rng, 1, True, children=[c, d])
    a = span(rng, 3, True, children=[b, span(rng, 2, True)])
    return span(rng, 5, children=[a])


def random_tree(rng, max_depth=3):
    def make(depth):
        node = span(rng, int(rng.integers(1, 5)), bool(rng.random() < 0.6))
        if depth < max_depth:
            node.children = [make(depth + 1) for _ in range(int(rng.choice([0, 1, 2, 3], p=[0.3, 0.3, 0.3, 0.1])))]
        return node

    return make(0)


@pytest.fixture(scope="module")
def model():
    cfg = model_config_tiny(tie_embeddings=False)  # same config as test_model.py: init compiles once
    assert cfg.vocab_size == VOCAB
    params = init_params(cfg, jax.random.key(7))
    fwd = jax.jit(Transformer(cfg).apply)
    return cfg, params, fwd


def logp_np(logits_LxV, targets_L):
    """float64 log-softmax gathered at the targets (independent of gyre_jax.losses)."""
    x = np.asarray(logits_LxV, np.float64)
    x = x - x.max(-1, keepdims=True)
    lse = np.log(np.exp(x).sum(-1))
    return x[np.arange(len(targets_L)), targets_L] - lse


def path_alone_logp(fwd, params, paths):
    """Run each path alone, causal, one per row (padding in segment 0)."""
    n = len(paths)
    tokens = np.zeros((n, PATH_LEN), np.int32)
    seg = np.zeros((n, PATH_LEN), np.int32)
    for r, p in enumerate(paths):
        assert len(p) <= PATH_LEN
        tokens[r, : len(p)] = p
        seg[r, : len(p)] = 1
    pos = np.tile(np.arange(PATH_LEN, dtype=np.int32), (n, 1))
    sub = np.where(seg > 0, PATH_LEN, pos + 1).astype(np.int32)
    logits = np.asarray(fwd(params, tokens, pos, seg, sub))
    return [logp_np(logits[r, : len(p) - 1], np.asarray(p[1:])) for r, p in enumerate(paths)]


def check_rows(model, rows_of_trees):
    cfg, params, fwd = model
    rows_st = [[serialize_tree(t) for t in trees] for trees in rows_of_trees]
    packed = pack_rows(rows_st, ROW_LEN)
    logits = np.asarray(fwd(params, packed.tokens, packed.positions, packed.segment_ids, packed.subtree_end))
    packed_logp = [logp_np(logits[r], packed.targets[r]) for r in range(len(rows_st))]

    expected, got, n_trainable_seen = [], [], 0
    for r, trees in enumerate(rows_st):
        start = 0
        for st in trees:
            for idx in st.path_indices():
                path = st.tokens[idx]
                # The packed targets along the path are the path's next tokens.
                np.testing.assert_array_equal(packed.targets[r, start + idx[:-1]], path[1:])
                expected.append(path)
                got.append(packed_logp[r][start + idx[:-1]])
                n_trainable_seen += int(st.loss_mask[idx[:-1]].sum())
            start += len(st)
    assert n_trainable_seen > 0
    ref = path_alone_logp(fwd, params, expected)
    worst = max((float(np.abs(g - e).max()) for g, e in zip(got, ref) if len(e)), default=0.0)
    assert worst <= TOL, f"max |logp_packed - logp_path| = {worst:.3g} > {TOL}"
    return worst


STRUCTURED = {
    "retry": retry_tree,
    "compaction": compaction_tree,
    "subagent": subagent_tree,
    "nested_branch": nested_branch_tree,
}


def test_structured_trees_one_per_row(model):
    rng = np.random.default_rng(0)
    check_rows(model, [[make(rng)] for make in STRUCTURED.values()])


def test_several_trees_per_row(model):
    rng = np.random.default_rng(1)
    trees = {name: make(rng) for name, make in STRUCTURED.items()}
    rows = [
        # A main rollout with its sub-agent: two roots, two segments of one row.
        [trees["compaction"], trees["subagent"]],
        [trees["retry"], trees["nested_branch"]],
        # All four in one row, in another order (offsets differ from the rows above).
        [trees["nested_branch"], trees["subagent"], trees["retry"], trees["compaction"]],
    ]
    rows.append([trees["subagent"]])  # short row, mostly padding
    check_rows(model, rows)


def test_random_trees(model):
    rng = np.random.default_rng(2)
    rows, row, used = [], [], 0
    while len(rows) < 4:
        t = random_tree(rng)
        n = len(serialize_tree(t))
        if n > PATH_LEN:
            continue
        if used + n > ROW_LEN:
            rows.append(row)
            row, used = [], 0
        row.append(t)
        used += n
    check_rows(model, rows)


def test_check_detects_a_wrong_mask(model):
    """The comparison can fail: one key let through the mask breaks exactness."""
    cfg, params, fwd = model
    rng = np.random.default_rng(0)
    st = serialize_tree(retry_tree(rng))
    packed = pack_rows([[st]], ROW_LEN)
    second = st.path_indices()[1]
    broken = packed.subtree_end.copy()
    # The first output's tokens end their subtree before the second output; extend them.
    first_out = st.path_indices()[0][-1]
    broken[0, first_out] = second[-1] + 1
    logits = np.asarray(fwd(params, packed.tokens, packed.positions, packed.segment_ids, broken))
    got = logp_np(logits[0], packed.targets[0])[second[:-1]]
    (ref,) = path_alone_logp(fwd, params, [st.tokens[second]])
    assert float(np.abs(got - ref).max()) > 100 * TOL
