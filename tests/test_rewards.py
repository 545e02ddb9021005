"""Rewards: partial credit for timeouts, failures out of training and out of the baseline."""
import dataclasses
import logging

import numpy as np
import pytest

from gyre_jax.losses import NormConfig
from gyre_jax.trajectory.rewards import AdvantageConfig, compute_advantages, has_signal, overlong_penalty


def acfg(mode, eps=1e-6, **kw):
    """grpo (mean/std) with its eps, or dr_grpo (mean only)."""
    return AdvantageConfig(advantage=mode, advantage_options=NormConfig(advantage_eps=eps) if mode == "grpo" else None, **kw)


@dataclasses.dataclass
class O:  # RolloutOutcome-like; group_id defaults to the task (one group per task)
    rollout_id: str
    task_id: str
    status: str
    score: float | None
    group_id: str = ""

    def __post_init__(self):
        self.group_id = self.group_id or "g_" + self.task_id


def ref_adv(scores, mode, eps):
    """Plain float64 reference for one group's valid scores."""
    r = np.asarray(scores, np.float64)
    if r.size <= 1 or np.all(r == r[0]):
        return np.zeros_like(r)
    c = r - r.mean()
    return c / (np.sqrt(((r - r.mean()) ** 2).mean()) + eps) if mode == "grpo" else c


@pytest.mark.parametrize("mode", ["dr_grpo", "grpo"])
def test_failures_excluded_from_mean_timeouts_keep_partial_credit(mode, caplog):
    outs = [
        O("a", "t1", "completed", 1.0),
        O("b", "t1", "timeout", 0.4),  # partial credit from the workspace grader
        O("c", "t1", "infra_error", None),
        O("d", "t1", "verifier_error", 0.0),  # a crash's "0" must not enter the mean
        O("e", "t1", "completed", 0.1),
        O("f", "t2", "completed", 0.3),
        O("g", "t2", "timeout", 0.9),
    ]
    cfg = acfg(mode, 1e-6)
    with caplog.at_level(logging.INFO, logger="gyre_jax.trajectory.rewards"):
        res = compute_advantages(outs, cfg)
    np.testing.assert_array_equal(res.valid, [1, 1, 0, 0, 1, 1, 1])
    exp = np.zeros(7)
    exp[[0, 1, 4]] = ref_adv([1.0, 0.4, 0.1], mode, 1e-6)
    exp[[5, 6]] = ref_adv([0.3, 0.9], mode, 1e-6)
    np.testing.assert_allclose(res.advantages, exp, rtol=1e-6, atol=1e-7)
    assert res.advantages[2] == 0 and res.advantages[3] == 0
    assert res.excluded == {"infra_error": 1, "verifier_error": 1}
    assert res.counts["timeout"] == 2 and res.counts["completed"] == 3
    assert np.isnan(res.scores[2]) and res.scores[1] == np.float32(0.4)
    assert "1 infra_error and 1 verifier_error" in caplog.text
    if mode == "dr_grpo":  # the baseline is mean(1.0, 0.4, 0.1) = 0.5, not mean with the crash's 0
        np.testing.assert_allclose(res.advantages[0], 0.5, rtol=1e-6)


@pytest.mark.parametrize("mode", ["dr_grpo", "grpo"])
def test_no_variance_gives_zero_not_nan(mode):
    outs = [
        O("a", "one_valid", "completed", 0.7), O("b", "one_valid", "infra_error", None),
        O("c", "equal", "completed", 0.1), O("d", "equal", "timeout", 0.1), O("e", "equal", "completed", 0.1),
        O("f", "all_fail", "infra_error", None), O("g", "all_fail", "verifier_error", None),
    ]
    res = compute_advantages(outs, acfg(mode, 0.0))
    assert np.all(np.isfinite(res.advantages)) and not res.advantages.any()
    assert res.zero_variance_groups == 2 and res.empty_groups == 1 and res.num_groups == 3
    assert res.num_valid == 4


@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_negative_advantage_scale_multiplies_only_negative_advantages(scale):
    scores = [1.0, 0.5, 0.0, 0.0]
    outs = [O(str(i), "t", "completed", s) for i, s in enumerate(scores)]
    ref = ref_adv(scores, "grpo", 1e-6)
    got = compute_advantages(outs, AdvantageConfig(negative_advantage_scale=scale)).advantages
    np.testing.assert_allclose(got, np.where(ref < 0, ref * scale, ref), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="negative_advantage_scale"):
        AdvantageConfig(negative_advantage_scale=-1.0)


def test_all_failures():
    res = compute_advantages([O("a", "t", "infra_error", None), O("b", "t", "verifier_error", None)])
    assert res.num_valid == 0 and not res.advantages.any() and res.empty_groups == 1
    assert res.excluded == {"infra_error": 1, "verifier_error": 1}
    assert compute_advantages([]).num_groups == 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"rollout 'x'.*outside \[0, 1\]"):
        compute_advantages([O("x", "t", "completed", 1.5)])
    with pytest.raises(ValueError, match=r"rollout 'x'.*outside"):
        compute_advantages([O("x", "t", "timeout", float("nan"))])
    with pytest.raises(ValueError, match=r"rollout 'x'.*non-numeric score None"):
        compute_advantages([O("x", "t", "timeout", None)])
    with pytest.raises(ValueError, match="unknown status 'crashed'"):
        compute_advantages([O("x", "t", "crashed", 0.0)])
    with pytest.raises(ValueError, match="appears twice"):
        compute_advantages([O("x", "t", "completed", 0.0), O("x", "t", "completed", 1.0)])
    with pytest.raises(ValueError, match="group 'g' mixes tasks 't1' and 't2'.*rollout 'y'"):
        compute_advantages([O("x", "t1", "completed", 0.0, "g"), O("y", "t2", "completed", 1.0, "g")])
    with pytest.raises(LookupError, match=r"unknown advantage estimator 'median'; known: \['dr_grpo', 'grpo', "):
        AdvantageConfig(advantage="median")
    with pytest.raises(TypeError, match="'grpo' takes a NormConfig"):
        AdvantageConfig(advantage="grpo", advantage_options=object())
    with pytest.raises(ValueError, match="overlong_buffer_tokens=0 must be in \\[1, overlong_max_tokens=10\\]"):
        AdvantageConfig(overlong_max_tokens=10)
    with pytest.raises(ValueError, match="one length per outcome"):
        compute_advantages([O("x", "t", "completed", 0.0)], AdvantageConfig(overlong_max_tokens=10,
                                                                             overlong_buffer_tokens=4))


def test_real_records_and_group_field():
    from gyre_jax.trajectory.records import RolloutOutcome

    mk = lambda rid, g, st, sc: RolloutOutcome(run_id="run", rollout_id=rid, task_id="t", group_id=g, status=st, score=sc)
    outs = [mk("a", "g1", "completed", 1.0), mk("b", "g1", "timeout", 0.0), mk("c", "g2", "completed", 0.2),
            mk("d", "g2", "infra_error", None)]
    by_group = compute_advantages(outs, acfg("dr_grpo"))
    np.testing.assert_allclose(by_group.advantages, [0.5, -0.5, 0.0, 0.0])
    by_task = compute_advantages(outs, acfg("dr_grpo"), group_field="task_id")
    np.testing.assert_allclose(by_task.advantages, [0.6, -0.4, -0.2, 0.0], rtol=1e-6)
    assert by_task.num_groups == 1 and by_group.num_groups == 2


def test_overlong_shaping_is_dapos_soft_punishment():
    """DAPO eq. 13 with Lmax = 20, Lc = 8: 0 up to 12 tokens, linear to -1 at 20, -1 beyond; x penalty."""
    cfg = acfg("dr_grpo", overlong_max_tokens=20, overlong_buffer_tokens=8, overlong_penalty=0.5)
    lengths = [5, 12, 13, 16, 20, 21, 400]
    ref = [0.0, 0.0, -1 / 8, -4 / 8, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(overlong_penalty(lengths, cfg), 0.5 * np.asarray(ref), rtol=1e-12)
    outs = [O(str(i), "t", "completed", 1.0) for i in range(len(lengths))]
    res = compute_advantages(outs, cfg, lengths=lengths)
    np.testing.assert_allclose(res.rewards, 1.0 + 0.5 * np.asarray(ref), rtol=1e-6)
    assert (res.scores == 1.0).all()  # the graders' scores stay as they were
    np.testing.assert_allclose(res.advantages, res.rewards - res.rewards.mean(), rtol=1e-5, atol=1e-7)
    # Shaping gives an all-correct group a signal; without it the group has none.
    assert has_signal(outs, cfg, lengths) and not has_signal(outs, acfg("grpo"))


def test_has_signal_ignores_failures():
    outs = [O("a", "t", "completed", 1.0), O("b", "t", "infra_error", None), O("c", "t", "timeout", 1.0)]
    assert not has_signal(outs, acfg("grpo"))
    assert has_signal(outs + [O("d", "t", "timeout", 0.5)], acfg("grpo"))
    assert not has_signal(outs[:2], acfg("grpo"))  # one valid rollout: nothing to compare
