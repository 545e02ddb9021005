"""Scheduling modes are strategy objects registered by name (gyre_jax/scheduler/modes.py):
a mode registered here, and nowhere else, runs in the simulator and configures the RL loop."""
import re

import pytest

from gyre_jax.errors import ConfigError
from gyre_jax.rl.config import SchedulerConfig
from gyre_jax.scheduler import modes, simulator
from gyre_jax.scheduler import policy as P
from gyre_jax.testing.fake_cluster import tiny_sim_config

TOY = "colocate_stream"


@pytest.fixture
def toy_mode():
    """Always colocate (every cell generates, then every cell trains), but groups stream into
    the open step as they finish instead of waiting for the whole batch."""
    modes.register_mode(modes.Colocate(name=TOY, streams=True))
    yield modes.get_mode(TOY)
    modes.unregister_mode(TOY)


def _takes(result):
    return [a.n for d in result.decisions for a in d.actions if isinstance(a, P.TakeGroups)]


def test_a_mode_registered_in_a_test_runs_in_the_simulator(toy_mode):
    cfg = tiny_sim_config(TOY)
    assert cfg.policy.strategy is toy_mode and cfg.policy.streaming and cfg.policy.effective_staleness == 0
    r = simulator.simulate(cfg)
    p = r.config.policy
    assert r.rollouts_trained == p.total_steps * p.groups_per_step * p.group_size  # nothing lost
    assert r.staleness_max == 0 and len(r.step_end_s) == p.total_steps  # colocated: on-policy
    assert P.initial_roles(p, 8) == ("rollout",) * 8
    # It streams: groups join the open step a few at a time, where colocate takes each whole batch at once.
    assert any(n < p.groups_per_step for n in _takes(r))
    assert set(_takes(simulator.simulate(tiny_sim_config("colocate")))) == {p.groups_per_step}


def test_the_rl_loop_asks_the_mode(toy_mode):
    s = SchedulerConfig(mode=TOY)
    assert s.stream_groups and not SchedulerConfig(mode="colocate").stream_groups
    assert list(toy_mode.serving_cells(4, async_train_cells=1)) == [0, 1, 2, 3]  # every cell gets an engine


def test_an_unknown_mode_names_the_known_ones():
    known = re.escape(str(modes.mode_names()))  # a new built-in mode is a known one too
    assert "'elastic'" in known and "'colocate'" in known
    with pytest.raises(LookupError, match=f"unknown scheduling mode 'sideways'; known: {known}"):
        modes.get_mode("sideways")
    with pytest.raises(ValueError, match=f"PolicyConfig.mode='sideways'; known modes: {known}"):
        tiny_sim_config("sideways")
    with pytest.raises(ConfigError, match=f"config.scheduler.mode='sideways'; known: {known}"):
        SchedulerConfig(mode="sideways")
    with pytest.raises(ValueError, match="'elastic' is already registered"):
        modes.register_mode(modes.Elastic(name="elastic", streams=True))
