"""The objective library in the RL loop: chosen by name, validated at config time, run end to end.

Default: every registered name is accepted, an unknown one or an option the chosen
entry does not take fails with the field's name. Slow: the real loop (tests/test_rl_loop.py's
tiny sizes) with decoupled PPO, a sequence-level mismatch correction, KL to the warm
start and DAPO's dynamic sampling, then resumed (the reference comes back from disk).
"""
from __future__ import annotations

import json
import os

import pytest

from configs import demo as demo_config
from gyre_jax import jobs
from gyre_jax.errors import ConfigError
from gyre_jax.losses import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, POLICY_LOSSES, WEIGHT_BUILDERS
from gyre_jax.rl.config import RLConfig


def _cfg(**train):
    c = demo_config.get_config()
    for k, v in train.items():
        c.train[k] = v
    return RLConfig.from_config(c)


def test_every_registered_name_configures():
    for name in POLICY_LOSSES.names():
        assert _cfg(loss=name).train.loss == name
    for name in ADVANTAGE_ESTIMATORS.names():
        cfg = _cfg(advantage=name)
        assert cfg.train.advantage == name and type(cfg.train.advantage_options) is ADVANTAGE_ESTIMATORS.get(name).config
        assert cfg.stream_groups == (ADVANTAGE_ESTIMATORS.get(name).scope == "group")  # demo mode: elastic
    for name in WEIGHT_BUILDERS.names():
        assert _cfg(weights=name).train.weights == name
    for name in MISMATCH_CORRECTIONS.names():
        assert _cfg(mismatch=name).train.mismatch == name
    cfg = _cfg(loss="gspo", eps_low=1e-3, mismatch="tis_seq", mismatch_cap=3.0, kl_coef=0.01)
    lc = cfg.train  # the loss's config is the train section
    assert (lc.loss_options.eps_low, lc.loss_options.eps_high, lc.mismatch_options.mismatch_cap, lc.kl_coef) == (
        1e-3, 4e-4, 3.0, 0.01)
    assert lc.step_passes() == {"prox", "seq_log_ratio", "trainer", "seq_log_mismatch", "ref"}
    assert _cfg(dynamic_sampling=True).dynamic_sampling_budget() == 8 * 60  # budget 1.0 x G x steps


@pytest.mark.parametrize("train, match", [
    (dict(loss="ppo2"), r"config.train.loss='ppo2': unknown policy loss 'ppo2'; known: \['cispo', 'decoupled_ppo', "),
    (dict(advantage="mean_std"), r"config.train.advantage='mean_std': unknown advantage estimator 'mean_std'; "
                                 r"known: \['dr_grpo', 'grpo', 'reinforce_pp'"),
    (dict(weights="seq"), r"config.train.weights='seq': .*; known: \['constant', 'rollout_token_mean', 'token_mean'\]"),
    (dict(mismatch="tls"), r"config.train.mismatch='tls': .*; known: \['off', 'icepop', 'measure', 'mis'"),
    (dict(loss="gspo", clip_c=3.0), r"config.train: unknown field\(s\) \['clip_c'\]; clip_c is an option of "
                                    r"loss_options.decoupled_ppo .* or loss_options.ppo_clip \(policy loss 'ppo_clip'"),
    (dict(mismatch="tis", mismatch_high=3.0), r"unknown field\(s\) \['mismatch_high'\]; mismatch_high is an option "
                                              r"of mismatch_options.icepop"),
    (dict(mismatch_cap=2.0), r"mismatch_cap is an option of mismatch_options.tis \(mismatch correction 'tis': "
                             r"--config.train.mismatch=tis\)"),
    (dict(mismatch="icepop", mismatch_low=6.0), r"config.train.mismatch_options.icepop.mismatch_low=6.0 must be < "
                                                r"mismatch_high=5.0"),
    (dict(eps_high=-0.1), r"config.train.loss_options.ppo_clip.eps_high must be a finite number in \[0, inf\)"),
    (dict(loss="decoupled_ppo", behavior_cap=1.0), r"config.train.loss_options.decoupled_ppo.behavior_cap must be a "
                                                   r"finite number in \(1"),
    (dict(kl_coef=-1.0), r"config.train.kl_coef must be a finite number in \[0"),
    (dict(log_ratio_clamp=0.1), r"config.train.log_ratio_clamp=0.1 must exceed \|log\(1 - eps_low\)\|"),
    (dict(advantage="rloo", advantage_eps=0.1), r"advantage_eps is an option of advantage_options.grpo"),
    (dict(weights="token_mean", weights_normalizer=64), r"weights_normalizer is an option of weights_options.constant"),
    (dict(weights="constant", weights_normalizer=0), r"config.train.weights_options.constant.weights_normalizer must "
                                                     r"be a positive int"),
    (dict(overlong_max_tokens=80), r"config.train.overlong_buffer_tokens=0 must be in \[1, overlong_max_tokens=80\]"),
    (dict(dynamic_sampling_budget=-1.0), r"config.train.dynamic_sampling_budget must be >= 0"),
])
def test_bad_objective_config_fails_naming_the_field(train, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**train)


def test_command_line_sets_the_objective(tmp_path):
    """Through ``python -m launch.main``: the options (in their flat spelling, respelled as the chosen entry's)
    parse as their types, and an option the chosen loss does not take exits 2 within seconds, naming the
    entries that take it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "launch.main", "--config", "configs/demo.py", "--workdir", str(tmp_path),
                        "--config.train.loss=gspo", "--config.train.eps_low=0.001", "--config.train.weights=constant",
                        "--config.train.weights_normalizer=64",
                        "--config.train.dynamic_sampling=True", "--config.train.loss_options.gspo.eps_high=-1"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: config.train.loss_options.gspo.eps_high must be a finite "
                                                 "number in [0, inf), got -1.0"), p.stderr
    assert "note: --config.train.eps_low is --config.train.loss_options.gspo.eps_low" in p.stderr
    from launch import cli_errors

    argv = ["--config.train.loss=gspo", "--config.train.clip_c=3"]
    assert cli_errors.bad_override(demo_config.get_config(), argv) == (
        "--config.train.clip_c: config.train has no field 'clip_c'; it is an option of "
        "--config.train.loss_options.decoupled_ppo.clip_c (with --config.train.loss=decoupled_ppo) or "
        "--config.train.loss_options.ppo_clip.clip_c (with --config.train.loss=ppo_clip)")


@pytest.mark.slow
def test_loop_decoupled_ppo_with_correction_kl_and_dynamic_sampling(tmp_path):
    """2 steps + 1 resumed: every rollout consumed once (trained, dropped for its failure class
    or for no signal), each step trains G groups (a dropped group was replaced), the
    objective's metrics and the per-step pass are in every record."""
    from tests.test_rl_loop import _outcomes, tiny_config

    c = tiny_config("elastic", steps=2)
    c.scheduler.staleness_bound = 2  # decoupled PPO's setting: three policies in play
    c.train.update(dict(loss="decoupled_ppo", behavior_cap=5.0, mismatch="tis_seq", kl_coef=0.05,
                        dynamic_sampling=True, dynamic_sampling_budget=0.5))  # at most 0.5 x 2 x 2 = 2 drops
    summary = jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "elastic")
    assert os.path.exists(os.path.join(wd, "reference", "params.npz"))
    c.steps = 3
    jobs.get(c.job)(c, str(tmp_path))  # resumes: the reference is read back
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [0, 1, 2] and summary["steps"] == 2
    for r in lines:
        for k in ("loss/mismatch_kl", "loss/mismatch_frac_truncated", "loss/kl_ref", "loss/behavior_weight_mean",
                  "score/score_forwards", "adv/no_variance_groups", "dynamic_sampling/dropped_groups"):
            assert k in r, (k, sorted(r))
        assert r["score/score_forwards"] >= 2  # the step's params (prox) and the reference at least
        assert len(r["groups"].split(",")) == 2  # G groups trained, dropped ones replaced
        assert r["staleness_max"] <= 2
    outs, consumed, _ = _outcomes(wd)
    no_signal = {rid for rid, e in consumed.items() if e["reason"] == "no_signal"}
    dropped_groups = {rid.split("-")[0] for rid in no_signal}
    # The budget (0.5 x G x steps) holds across the resume; a drop after a run's last record is
    # rewound with the checkpoint's cursor and made again, so records count at most the drops.
    assert 1 <= sum(r["dynamic_sampling/dropped_groups"] for r in lines) <= len(dropped_groups) <= 3
    for rid, e in consumed.items():
        o = outs[rid]
        assert e["state"] == ("trained" if not o.is_failure and rid not in no_signal else "dropped"), (rid, e)
        if o.is_failure:
            assert e["reason"] == o.status
