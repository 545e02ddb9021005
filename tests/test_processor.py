"""End to end on tiny synthetic rollouts: records -> packed rows with exact contexts,
rollout-first weights, failures out, stats consistent."""
import numpy as np
import pytest

from gyre_jax.trajectory.binpack import PathTooLongError
from gyre_jax.trajectory.processor import ProcessorConfig, process_step
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.select import SelectConfig
from gyre_jax.trajectory.serialize import tree_attention_mask_np


class Rollout:
    """Builds one rollout's call records like an agent harness would."""

    def __init__(self, rid, task, rng, version=0):
        self.rid, self.task, self.rng, self.version = rid, task, rng, version
        self.calls = []

    def call(self, prompt, n_out, *, role="main", agent=0, parent=None):
        out = self.rng.integers(1000, 2000, n_out)
        lp = -self.rng.random(n_out).astype(np.float32)
        self.calls.append(ModelCallRecord(
            run_id="run", rollout_id=self.rid, task_id=self.task, group_id="g_" + self.task,
            agent_id=agent, parent_agent_id=parent, role=role, call_index=len(self.calls),
            prompt_ids=np.asarray(prompt), output_ids=out, output_logprobs=lp,
            policy_version=self.version, t_start=0.0, t_end=1.0, finish_reason="stop"))
        return list(prompt) + list(out)

    def outcome(self, status, score):
        return RolloutOutcome(run_id="run", rollout_id=self.rid, task_id=self.task, group_id="g_" + self.task,
                              status=status, score=score, num_calls=len(self.calls))


def make_rollout(rid, task, seed, version=0):
    """Multi-turn + retry + compaction (summary) + sub-agent, all small."""
    rng = np.random.default_rng(seed)
    r = Rollout(rid, task, rng, version)
    sys = [1, 2, 3, 4]
    ctx = r.call(sys + [10, 11], 3)
    ctx = r.call(ctx + [20, 21, 22], 2)  # tool result, then the next turn
    r.call(ctx + [30], 2)  # a failed attempt ...
    ctx = r.call(ctx + [30], 3)  # ... retried with the same prompt
    summary = r.call(ctx + [40], 2, role="summary")[len(ctx) + 1:]
    ctx = r.call(sys + [41] + summary, 3)  # compaction: new context after the system prompt
    r.call([5, 6, 7, 8, 9], 3, role="subagent", agent=1, parent=0)
    return r


def reference_targets(calls):
    """Every recorded output token with its exact context (independent of the tree code)."""
    ref = {}
    for c in calls:
        seq = list(c.prompt_ids) + list(c.output_ids)
        p = len(c.prompt_ids)
        for k in range(len(c.output_ids)):
            ref.setdefault((tuple(seq[: p + k]), int(c.output_ids[k])), (float(c.output_logprobs[k]), c.policy_version))
    return ref


def packed_targets(rows, ridx):
    """(context read through the tree mask, target) -> (logprob, version, rollout, weight, adv)."""
    got = {}
    for b in range(rows.tokens.shape[0]):
        mask = tree_attention_mask_np(rows.segment_ids[b], rows.subtree_end[b])
        for i in np.flatnonzero(rows.loss_mask[b]):
            vis = np.flatnonzero(mask[i])
            np.testing.assert_array_equal(rows.positions[b, vis], np.arange(vis.size))
            key = (tuple(int(t) for t in rows.tokens[b, vis]), int(rows.targets[b, i]))
            assert key not in got, "a target is trained twice"
            got[key] = (float(rows.behavior_logprobs[b, i]), int(rows.target_version[b, i]), int(ridx[b, i]),
                        float(rows.loss_weights[b, i]), float(rows.advantages[b, i]))
    return got


@pytest.mark.parametrize("row_len", [64, 24])  # 24 forces splitting across rows
def test_end_to_end_exact_counted_once_weights(row_len):
    rs = [make_rollout(f"r{i}", "tA" if i < 3 else "tB", seed=i, version=i % 2) for i in range(5)]
    outcomes = [rs[0].outcome("completed", 1.0), rs[1].outcome("timeout", 0.25), rs[2].outcome("infra_error", None),
                rs[3].outcome("completed", 0.5), rs[4].outcome("verifier_error", None)]
    calls = [c for r in rs for c in r.calls]
    cfg = ProcessorConfig(row_len=row_len, select=SelectConfig(mode="unbounded"), advantage="dr_grpo")
    batch = process_step(calls[::-1], outcomes, cfg)  # call order must not matter
    st = batch.stats
    assert batch.rollout_ids == ("r0", "r1", "r3")
    np.testing.assert_allclose(batch.advantages, [0.375, -0.375, 0.0])  # tA mean 0.625 without r2's crash
    assert st.failures == {"completed": 2, "timeout": 1, "infra_error": 1, "verifier_error": 1}
    assert st.calls_dropped == {"infra_error": 7, "verifier_error": 7} and st.calls == 35
    got = packed_targets(batch.rows, batch.rollout_index)
    for k, rid in enumerate(batch.rollout_ids):
        r = rs[int(rid[1:])]
        ref = reference_targets(r.calls)
        mine = {key: v for key, v in got.items() if v[2] == k}
        assert set(mine) == set(ref)  # every recorded output token exactly once, nothing else
        for key, (lp, ver, _, w, adv) in mine.items():
            assert lp == pytest.approx(ref[key][0], abs=0) and ver == ref[key][1]
            assert w == pytest.approx(1.0 / (len(ref) * 3), rel=1e-6) and adv == batch.advantages[k]
    np.testing.assert_allclose(batch.rows.loss_weights.astype(np.float64).sum(), 1.0, rtol=1e-5)
    assert st.trainable_targets == len(got) and st.trained_rollouts == 3
    assert st.packed_tokens == int((batch.rows.segment_ids > 0).sum())
    assert st.packed_tokens == st.selected_tokens + st.duplicated_tokens + st.branch_copies
    assert st.selected_tokens == st.unique_tokens < st.recorded_tokens and st.expanded_tokens > st.selected_tokens
    assert st.recorded_tokens == sum(len(c.prompt_ids) + len(c.output_ids) for r in (rs[0], rs[1], rs[3]) for c in r.calls)
    assert (row_len == 24) == (st.duplicated_tokens > 0)
    assert (st.trainable_unique, st.trainable_dropped, st.rollouts_truncated) == (len(got), 0, 0)  # unbounded
    assert 0 < st.fill <= 1 and st.dedup_factor > 1


def test_priority_selection_and_streaming_weights():
    rs = [make_rollout(f"r{i}", "t", seed=10 + i) for i in range(4)]
    outs = [r.outcome("completed", s) for r, s in zip(rs, [0.0, 1.0, 0.5, 0.5])]
    cfg = ProcessorConfig(row_len=64, select=SelectConfig(jmax=2))
    full = process_step([c for r in rs for c in r.calls], outs, cfg)
    assert full.stats.paths_selected == 8 and full.stats.paths_total == 4 * 4  # failed attempt, summary, compacted context, sub-agent
    assert full.stats.selected_tokens < full.stats.unique_tokens
    # Streaming: two halves of the step, R given, disjoint rollout indices; same weights.
    a = process_step([c for r in rs[:2] for c in r.calls], outs[:2], cfg, num_step_rollouts=4)
    b = process_step([c for r in rs[2:] for c in r.calls], outs[2:], cfg, num_step_rollouts=4, rollout_index_offset=2)
    total = sum(x.rows.loss_weights.astype(np.float64).sum() for x in (a, b))
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    assert set(np.unique(b.rollout_index)) == {-1, 2, 3}
    ga, gb, gf = (packed_targets(x.rows, x.rollout_index) for x in (a, b, full))
    assert {k: v[3] for k, v in {**ga, **gb}.items()} == pytest.approx({k: v[3] for k, v in gf.items()})


def test_selection_drops_counted_exactly():
    """Trainable tokens kept vs dropped by Jmax, against an independent count.

    Per rollout, the whole rollout's trainable tokens are its unique (context,
    output token) pairs read off the records; the kept ones are the targets the
    packed rows actually train on. Neither count goes through select.py.
    """
    rs = [make_rollout(f"r{i}", "t", seed=20 + i) for i in range(4)]
    rs[2] = Rollout("r2", "t", np.random.default_rng(0))  # one context only: Jmax=2 keeps all of it
    rs[2].call([1, 2, 3], 4)
    rs[3].call([5, 6, 7, 8, 9, 1], 10, role="subagent", agent=2, parent=0)  # r3 loses most
    outs = [r.outcome("completed", s) for r, s in zip(rs, [0.0, 1.0, 0.5, 0.25])]
    for jmax in (1, 2, 6):
        b = process_step([c for r in rs for c in r.calls], outs, ProcessorConfig(row_len=64, select=SelectConfig(jmax=jmax)))
        st = b.stats
        got = packed_targets(b.rows, b.rollout_index)
        total = [len(reference_targets(r.calls)) for r in rs]
        kept = [sum(v[2] == k for v in got.values()) for k in range(len(rs))]
        assert st.trainable_unique == sum(total) and st.trainable_selected == sum(kept) == st.trainable_targets
        assert st.trainable_dropped == sum(total) - sum(kept)
        frac = [(t - k) / t for t, k in zip(total, kept)]
        assert st.rollouts_truncated == sum(f > 0 for f in frac)
        assert st.max_dropped_fraction == max(frac)
        assert st.max_dropped_rollout == (f"r{frac.index(max(frac))}" if max(frac) > 0 else None)
        assert st.as_dict()["trainable_dropped"] == st.trainable_dropped
        if jmax == 2:
            assert st.rollouts_truncated == 3 and st.max_dropped_rollout == "r3"  # r2 has one path
        if jmax == 6:  # every path fits: nothing lost
            assert (st.trainable_dropped, st.rollouts_truncated, st.max_dropped_rollout) == (0, 0, None)


def test_bad_inputs():
    r = make_rollout("r0", "t", seed=0)
    cfg = ProcessorConfig(row_len=64)
    with pytest.raises(ValueError, match=r"without an outcome.*'r0'"):
        process_step(r.calls, [], cfg)
    with pytest.raises(ValueError, match=r"rollout 'r0': outcome says 7 calls, 6 call records"):
        process_step(r.calls[:-1], [r.outcome("completed", 1.0)], cfg)
    with pytest.raises(PathTooLongError, match=r"rollout 'r0'.*row_len=12"):
        process_step(r.calls, [r.outcome("completed", 1.0)], ProcessorConfig(row_len=12))
    with pytest.raises(ValueError, match="row_len"):
        ProcessorConfig(row_len=1)
    # A step whose every rollout failed: no rows, nothing trained, everything counted.
    out = process_step(r.calls, [r.outcome("infra_error", None)], ProcessorConfig(row_len=64, min_rows=1))
    assert out.rows.tokens.shape == (1, 64) and not out.rows.loss_weights.any()
    assert out.stats.calls_dropped["infra_error"] == 7 and out.rollout_ids == ()


def test_synth_tiny_every_feature_exact():
    """H3a's tiny preset (retries, drift, compaction, sub-agents, timeouts, failures)."""
    from gyre_jax.trajectory.synth import preset, synth_rollouts

    calls, outcomes = synth_rollouts(preset("tiny"))
    L = max(len(c.prompt_ids) + len(c.output_ids) for c in calls)
    batch = process_step(calls, outcomes, ProcessorConfig(row_len=L, select=SelectConfig(mode="unbounded")))
    st = batch.stats
    valid = [o for o in outcomes if o.status in ("completed", "timeout")]
    assert batch.rollout_ids == tuple(o.rollout_id for o in valid) and st.duplicated_tokens > 0
    assert sum(st.failures.values()) == len(outcomes) and st.calls == len(calls)
    got = packed_targets(batch.rows, batch.rollout_index)
    for k, rid in enumerate(batch.rollout_ids):
        ref = reference_targets([c for c in calls if c.rollout_id == rid])
        mine = {key: v for key, v in got.items() if v[2] == k}
        assert set(mine) == set(ref), rid
        assert all(mine[key][:2] == ref[key] for key in ref)
    np.testing.assert_allclose(batch.rows.loss_weights.astype(np.float64).sum(), 1.0, rtol=1e-5)


def test_tree_shape_counts_match_an_independent_count():
    """Branch points against a plain count over the recorded sequences (a prefix where two different
    next tokens follow is a fork); roles and repeated prompts counted from the records."""
    from gyre_jax.trajectory.processor import tree_shape_counts
    from gyre_jax.trajectory.tree import build_tree

    rollouts = [make_rollout(f"r{i}", "t", seed=i) for i in range(3)]
    linear = Rollout("lin", "t", np.random.default_rng(9))
    ctx = linear.call([1, 2, 3], 2)
    linear.call(ctx + [7], 2)
    rollouts.append(linear)

    def forks(calls):
        seqs = [tuple(int(x) for x in np.concatenate([c.prompt_ids, c.output_ids])) for c in calls]
        nxt = {}
        for s in seqs:
            for i in range(len(s)):
                nxt.setdefault(s[:i], set()).add(s[i])
        return sum(len(v) > 1 for v in nxt.values())

    calls = [r.calls for r in rollouts]
    got = tree_shape_counts(calls, [build_tree(cs) for cs in calls])
    want_forks = [forks(cs) for cs in calls]
    assert want_forks[-1] == 0 and min(want_forks[:3]) >= 2
    assert got == dict(branch_points=sum(want_forks), branching_rollouts=3, compaction_calls=3, subagent_calls=3,
                       retried_calls=3)


def test_step_stats_carry_the_tree_shapes():
    rs = [make_rollout(f"r{i}", "t", seed=i) for i in range(2)]
    calls = [c for r in rs for c in r.calls]
    batch = process_step(calls, [r.outcome("completed", s) for r, s in zip(rs, (0.0, 1.0))],
                         ProcessorConfig(row_len=256))
    st = batch.stats
    assert (st.branching_rollouts, st.compaction_calls, st.subagent_calls, st.retried_calls) == (2, 2, 2, 2)
    assert st.paths_total > 2 * 1 and st.expanded_tokens > st.packed_tokens  # packing shared prefixes once pays
