"""Tree rebuild: exact prefix sharing over token ids, trainable only where a call generated."""
import numpy as np
import pytest

from gyre_jax.trajectory.records import ModelCallRecord
from gyre_jax.trajectory.serialize import serialize_tree
from gyre_jax.trajectory.tree import build_tree, rebuild


def mk(ci, prompt, out, *, agent=0, role=None, version=0, lp=None, parent=None):
    role = role or ("main" if agent == 0 else "subagent")
    if role == "subagent" and parent is None:
        parent = 0
    lp = -(np.arange(len(out)) + 1.0 + ci / 10) if lp is None else lp
    return ModelCallRecord(run_id="run", rollout_id="r", task_id="t", group_id="g", agent_id=agent, parent_agent_id=parent,
                           role=role, call_index=ci, prompt_ids=np.asarray(prompt, np.int32), output_ids=np.asarray(out, np.int32),
                           output_logprobs=np.asarray(lp, np.float32), policy_version=version, t_start=0.0, t_end=1.0, finish_reason="stop")


def seq(c):
    return list(c.prompt_ids) + list(c.output_ids)


def check_rebuild(calls):
    """Check the rebuilt tree against a plain per-prefix reference; return it."""
    rt = rebuild(calls)
    root = rt.root
    parent, nodes = {}, list(root.walk())
    for n in nodes:
        for ch in n.children:
            parent[id(ch)] = n
        if n is not root:
            assert n.tokens.shape[0] >= 1, "only the root may be empty"
        firsts = [int(ch.tokens[0]) for ch in n.children]
        assert len(set(firsts)) == len(firsts), "children must start with distinct tokens"

    def path(n):
        chain = []
        while n is not None:
            chain.append(n)
            n = parent.get(id(n))
        return chain[::-1]

    # Reference: the set of distinct prefixes; trainable ones and their owner (lowest call index).
    by_index = sorted(calls, key=lambda c: c.call_index)
    prefixes, owner = set(), {}
    for c in by_index:
        s, p = seq(c), c.prompt_ids.shape[0]
        for i in range(len(s)):
            prefixes.add(tuple(s[: i + 1]))
            if i >= p:
                owner.setdefault(tuple(s[: i + 1]), (c, i - p))
    # Every recorded sequence is exactly one root-to-node path.
    for c in calls:
        end = rt.end_nodes[c.call_index]
        toks = np.concatenate([n.tokens for n in path(end)])
        np.testing.assert_array_equal(toks, seq(c))
        assert c.call_index in end.call_ids
    # Every tree token is a distinct recorded prefix; trainable exactly where an output covers it.
    seen = set()
    for n in nodes:
        before = [int(t) for m in path(n)[:-1] for t in m.tokens]
        for k in range(n.tokens.shape[0]):
            pre = tuple(before + [int(t) for t in n.tokens[: k + 1]])
            assert pre in prefixes and pre not in seen
            seen.add(pre)
            if pre in owner:
                c, j = owner[pre]
                assert n.trainable[k] and n.logprobs[k] == c.output_logprobs[j]
                assert (n.role, n.agent_id, n.policy_version) == (c.role, c.agent_id, c.policy_version)
                assert c.call_index in n.call_ids
            else:
                assert not n.trainable[k] and n.logprobs[k] == 0
    assert seen == prefixes
    assert rt.unique_tokens == len(prefixes) and rt.trainable_tokens == len(owner)
    assert rt.recorded_tokens == sum(len(seq(c)) for c in calls)
    # The packing contract: serializes, and every trainable token is a target once.
    assert serialize_tree(root).num_trainable == len(owner)
    return rt


def spans(node):
    """Nested (tokens, trainable-per-node) structure for exact shape assertions."""
    t = node.trainable
    assert t.all() or not t.any(), "nodes are split at output boundaries"
    return (list(map(int, node.tokens)), bool(t.any()), [spans(c) for c in node.children])


SYS = [1, 2, 3]


def test_linear_multi_turn():
    c0 = mk(0, SYS + [10], [20, 21])
    c1 = mk(1, seq(c0) + [30, 31], [22])
    c2 = mk(2, seq(c1) + [32], [23, 24])
    rt = check_rebuild([c0, c1, c2])
    assert spans(rt.root) == (SYS + [10], False, [([20, 21], True, [([30, 31], False, [([22], True, [([32], False, [([23, 24], True, [])])])])])])
    assert rt.end_nodes[0].call_ids == (0,) and rt.end_nodes[2].call_ids == (2,)


def test_retries_share_prompt_and_common_output_prefix():
    c0 = mk(0, SYS, [5, 6, 7], version=1)
    c1 = mk(1, SYS, [5, 6, 9], version=2)
    c2 = mk(2, SYS, [8])
    rt = check_rebuild([c2, c0, c1])  # input order does not matter
    assert spans(rt.root) == (SYS, False, [([5, 6], True, [([7], True, []), ([9], True, [])]), ([8], True, [])])
    shared = rt.root.children[0]
    assert shared.call_ids == (0, 1) and shared.policy_version == 1  # owner: lowest call index
    np.testing.assert_array_equal(shared.logprobs, c0.output_logprobs[:2])


def test_identical_retry_trains_once():
    c0, c1 = mk(0, SYS, [5, 6]), mk(1, SYS, [5, 6])
    rt = check_rebuild([c0, c1])
    assert spans(rt.root) == (SYS, False, [([5, 6], True, [])])
    assert rt.trainable_tokens == 2 and rt.end_nodes[0] is rt.end_nodes[1] and rt.end_nodes[1].call_ids == (0, 1)


def test_compaction_shares_only_system_prompt():
    c0 = mk(0, SYS + [10], [20])
    c1 = mk(1, seq(c0) + [30], [21])
    summ = mk(2, seq(c1) + [90], [40, 41, 42], role="summary")
    c3 = mk(3, SYS + [91, 40, 41, 42, 92], [50])  # the summary re-enters as prompt tokens
    rt = check_rebuild([c0, c1, summ, c3])
    assert spans(rt.root) == (SYS, False, [
        ([10], False, [([20], True, [([30], False, [([21], True, [([90], False, [([40, 41, 42], True, [])])])])])]),
        ([91, 40, 41, 42, 92], False, [([50], True, [])]),
    ])
    assert rt.end_nodes[2].role == "summary"


def test_subagent_own_context_empty_root():
    c0 = mk(0, SYS, [20])
    s0 = mk(1, [7, 8], [60], agent=1)
    s1 = mk(2, [7, 8, 60, 61], [62], agent=1)
    c1 = mk(3, seq(c0) + [70, 62], [21])  # the sub-agent's answer comes back as a tool result
    rt = check_rebuild([c0, s0, s1, c1])
    assert rt.root.tokens.shape[0] == 0
    assert spans(rt.root) == ([], False, [
        (SYS, False, [([20], True, [([70, 62], False, [([21], True, [])])])]),
        ([7, 8], False, [([60], True, [([61], False, [([62], True, [])])])]),
    ])
    sub = rt.end_nodes[2]
    assert (sub.role, sub.agent_id) == ("subagent", 1)


def test_drift_branches_at_first_differing_token():
    c0 = mk(0, SYS, [10, 11, 12, 13])
    c1 = mk(1, SYS + [10, 11, 99, 98, 13, 30], [40])  # 12 re-tokenized as 99 98
    rt = check_rebuild([c0, c1])
    assert spans(rt.root) == (SYS, False, [([10, 11], True, [([12, 13], True, []), ([99, 98, 13, 30], False, [([40], True, [])])])])
    assert rt.trainable_tokens == 5


def test_prompt_prefix_of_another_prompt_and_output_gets_child():
    c0 = mk(0, [1, 2, 3, 4, 5], [8, 9])
    c1 = mk(1, [1, 2, 3], [7])  # c1's prompt is a prefix of c0's
    c2 = mk(2, seq(c0) + [10], [11])  # c0's output node gets a child
    c3 = mk(3, [1, 2], [3, 4, 6])  # c3 generated what c0 saw as prompt: those prefixes are trainable once
    rt = check_rebuild([c0, c1, c2, c3])
    assert spans(rt.root) == ([1, 2], False, [
        ([3], True, [
            ([4], True, [([5], False, [([8, 9], True, [([10], False, [([11], True, [])])])]), ([6], True, [])]),
            ([7], True, []),
        ]),
    ])
    assert rt.root.children[0].call_ids == (3,) and rt.root.children[0].logprobs[0] == c3.output_logprobs[0]


def test_empty_output_call_ends_at_prompt_node():
    c0 = mk(0, SYS + [4], [5])
    c1 = mk(1, SYS, [])
    rt = check_rebuild([c0, c1])
    assert spans(rt.root) == (SYS, False, [([4], False, [([5], True, [])])])
    assert rt.end_nodes[1] is rt.root and rt.end_nodes[1].call_ids == (1,)


def test_all_features_combined():
    c = [mk(0, SYS + [10], [20, 21], version=0)]
    c.append(mk(1, seq(c[0]) + [30], [22, 23], version=0))
    c.append(mk(2, seq(c[0]) + [30], [22, 24], version=1))  # retry of call 1
    c.append(mk(3, SYS + [80], [81], agent=1))  # sub-agent
    c.append(mk(4, seq(c[3]) + [82], [83], agent=1))
    c.append(mk(5, seq(c[2]) + [31, 83], [25], version=1))  # sub-agent result returns
    c.append(mk(6, seq(c[5]) + [90], [40, 41], role="summary", version=2))  # compaction
    c.append(mk(7, SYS + [91, 40, 41], [26], version=2))
    c.append(mk(8, SYS + [10, 20, 77, 30], [27], version=2))  # drift: 21 re-tokenized as 77
    c.append(mk(9, [5, 5], [5]))  # a context sharing nothing
    check_rebuild(c)


def test_bad_inputs():
    c0 = mk(0, SYS, [4])
    with pytest.raises(ValueError, match="two calls with call_index 0"):
        build_tree([c0, mk(0, SYS, [5])])
    other = ModelCallRecord(**{**{f: getattr(c0, f) for f in c0.__dataclass_fields__}, "rollout_id": "r2", "call_index": 1})
    with pytest.raises(ValueError, match="mixed with rollout 'r'"):
        build_tree([c0, other])
    with pytest.raises(ValueError, match="no calls"):
        build_tree([])


def random_rollout(rng, n_calls, vocab):
    """Random agentic call sequences: continue, retry, compact, sub-agent, drift, fresh context."""
    calls, ctx = [], {0: list(rng.integers(0, vocab, rng.integers(1, 4)))}
    for ci in range(n_calls):
        agent = int(rng.choice(list(ctx))) if rng.random() < 0.8 else len(ctx)
        if agent not in ctx:
            ctx[agent] = list(ctx[0][: rng.integers(0, 3)]) + list(rng.integers(0, vocab, rng.integers(1, 3)))
        prompt = list(ctx[agent])
        kind = rng.random()
        if kind < 0.15 and calls:  # prompt is a prefix of an earlier sequence
            s = seq(calls[rng.integers(len(calls))])
            prompt = s[: rng.integers(1, len(s) + 1)]
        out = list(rng.integers(0, vocab, rng.integers(0, 4)))
        calls.append(mk(ci, prompt, out, agent=agent, version=int(rng.integers(0, 3)), lp=-rng.random(len(out))))
        r = rng.random()
        if r < 0.2:
            continue  # retry: context unchanged
        new = prompt + out
        if r < 0.35 and out:  # drift: re-tokenize one output token
            k = len(prompt) + int(rng.integers(len(out)))
            new = new[:k] + list(rng.integers(0, vocab, 2)) + new[k + 1 :]
        if r > 0.9:  # compaction: keep a short head, then a summary-like tail
            new = new[: rng.integers(0, 3)] + out
        ctx[agent] = new + list(rng.integers(0, vocab, rng.integers(0, 3)))
    return calls


@pytest.mark.parametrize("seed", range(40))
def test_property_random_rollouts(seed):
    rng = np.random.default_rng(seed)
    vocab = 3 if seed % 4 == 0 else 20  # a tiny vocabulary makes accidental sharing common
    calls = random_rollout(rng, int(rng.integers(1, 25)), vocab)
    check_rebuild(list(rng.permutation(np.array(calls, dtype=object))))


# ---------------------------------------------------------------- synthetic rollouts (synth.py)
from gyre_jax.trajectory.synth import SynthConfig, preset, synth_rollout, synth_rollouts  # noqa: E402


def by_rollout(calls):
    out = {}
    for c in calls:
        out.setdefault(c.rollout_id, []).append(c)
    return out


def test_synth_tiny_rebuilds_exactly():
    calls, outcomes = synth_rollouts(preset("tiny"))
    groups = by_rollout(calls)
    assert sorted(groups) == sorted(o.rollout_id for o in outcomes)
    for o in outcomes:
        assert o.num_calls == len(groups[o.rollout_id])
        check_rebuild(groups[o.rollout_id])


def test_synth_features_present_and_deterministic():
    cfg = preset("tiny", group_size=6, drift_rate=0.5)
    calls, outcomes = synth_rollouts(cfg)
    again, _ = synth_rollouts(cfg)
    assert [c.to_bytes() for c in calls] == [c.to_bytes() for c in again]
    assert {c.role for c in calls} == {"main", "subagent", "summary"}
    assert all(c.parent_agent_id == 0 for c in calls if c.role == "subagent")
    assert {o.status for o in outcomes} >= {"completed", "timeout"}
    assert all((o.score is None) == o.is_failure for o in outcomes)
    retries = drifts = 0
    for rc in by_rollout(calls).values():
        for a, b in zip(rc, rc[1:]):
            if a.finish_reason == "abort":  # a failed call is retried on the very same prompt
                assert a.agent_id == b.agent_id and a.prompt_ids is b.prompt_ids
                retries += 1
            elif a.agent_id == b.agent_id and b.role == a.role == "main":
                s, p = a.sequence, b.prompt_ids
                n = min(len(s), len(p))
                d = np.flatnonzero(s[:n] != p[:n])
                drifts += bool(d.size and d[0] >= a.prompt_ids.shape[0])  # diverges inside a's output
    assert retries >= 1 and drifts >= 1
    _, failed = synth_rollouts(preset("tiny", infra_error_rate=0.5, verifier_error_rate=0.5, timeout_rate=0.0))
    assert {o.status for o in failed} == {"infra_error", "verifier_error"}


def test_synth_config_validation():
    with pytest.raises(ValueError, match="retry_rate=1.5"):
        SynthConfig(retry_rate=1.5)
    with pytest.raises(ValueError, match="max_context=100"):
        SynthConfig(max_context=100)
    with pytest.raises(LookupError, match="unknown synth preset 'huge'"):
        preset("huge")


@pytest.mark.slow
def test_paper_preset_rebuild_exact_paths():
    """Paper scale (~300 calls, 128K contexts): every call is its path; report the rebuild time."""
    import time

    calls, outcome = synth_rollout(preset("paper"), 0, 0)
    t = time.perf_counter()
    rt = rebuild(calls)
    dt = time.perf_counter() - t
    parent = {id(ch): n for n in rt.root.walk() for ch in n.children}
    for c in calls:
        chain, n = [], rt.end_nodes[c.call_index]
        while n is not None:
            chain.append(n.tokens)
            n = parent.get(id(n))
        np.testing.assert_array_equal(np.concatenate(chain[::-1]), c.sequence)
    assert rt.trainable_tokens == sum(n.trainable.sum() for n in rt.root.walk())
    print(f"paper rebuild: {dt:.3f}s, recorded {rt.recorded_tokens}, unique {rt.unique_tokens}, trainable {rt.trainable_tokens}")
    assert 600_000 <= rt.unique_tokens <= 800_000 and max(c.prompt_ids.shape[0] for c in calls) <= 131_072
