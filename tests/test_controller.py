"""The controller on fakes (virtual clock) takes the simulator's decisions."""
import pytest

from gyre_jax.scheduler import policy as P
from gyre_jax.scheduler import simulator, workloads
from gyre_jax.scheduler.controller import Controller
from gyre_jax.testing.fake_cluster import fake_cluster, tiny_sim_config


def run_on_fakes(cfg):
    rollouts = workloads.rollouts_for(cfg)
    cfg = simulator.resolve(cfg, rollouts)  # the priors the simulator gives the policy
    fc = fake_cluster(cfg, rollouts, P.initial_roles(cfg.policy, cfg.cluster.n_cells))
    ctl = Controller(cfg.policy, cells=fc.cells, proxy=fc.proxy, rollouts=fc.rollouts, trainer=fc.trainer,
                     clock=fc.clock)
    # the controller samples load every sample_s: a real loop polls that often at least
    for i in range(1, 10_000):
        fc.clock.at(i * ctl.sample_s, lambda: None)
    ticks = 0
    while not ctl.done():
        ctl.tick()  # after every instant, call events included: more often than the simulator
        ticks += 1
        assert fc.clock.advance(), "fakes ran out of events before the last step"
    return ctl, fc, ticks


@pytest.mark.parametrize("mode", ["elastic", "colocate", "async_stream", "elastic_no_stream"])
def test_simulator_and_controller_on_fakes_decide_the_same(mode):
    cfg = tiny_sim_config(mode)
    sim = simulator.simulate(cfg)
    ctl, fc, ticks = run_on_fakes(cfg)
    assert ticks > 3 * len(sim.decisions)
    assert len(ctl.decisions) == len(sim.decisions)
    for a, b in zip(ctl.decisions, sim.decisions):
        assert a.actions == b.actions
        assert a.time == pytest.approx(b.time, abs=1e-6)
    assert fc.trainer.staleness and max(fc.trainer.staleness) <= cfg.policy.staleness_bound
    assert fc.rollouts.truncated == sim.truncated_rollouts


def test_controller_drains_before_switching_and_admits_after():
    cfg = tiny_sim_config("elastic")
    ctl, fc, _ = run_on_fakes(cfg)
    to_train = [a.cell for d in ctl.decisions for a in d.actions if isinstance(a, P.ToTrain)]
    to_rollout = [a.cell for d in ctl.decisions for a in d.actions if isinstance(a, P.ToRollout)]
    assert to_train and to_rollout
    drains = [c for op, c in fc.proxy.log if op == "drain"]
    admits = [c for op, c in fc.proxy.log if op == "admit"]
    assert drains == to_train  # one drain per switch to training, in order
    assert sorted(admits) == sorted(to_rollout)  # each cell back in routing once its switch finished


def test_controller_rejects_objects_that_miss_a_protocol():
    cfg = tiny_sim_config("elastic")
    fc = fake_cluster(cfg, workloads.rollouts_for(cfg), P.initial_roles(cfg.policy, 8))
    with pytest.raises(TypeError, match="proxy.*Proxy"):
        Controller(cfg.policy, cells=fc.cells, proxy=object(), rollouts=fc.rollouts, trainer=fc.trainer,
                   clock=fc.clock)


def test_run_loop_finishes_the_run_on_a_virtual_clock():
    cfg = tiny_sim_config("elastic")
    fc = fake_cluster(cfg, workloads.rollouts_for(cfg), P.initial_roles(cfg.policy, 8))
    ctl = Controller(cfg.policy, cells=fc.cells, proxy=fc.proxy, rollouts=fc.rollouts, trainer=fc.trainer,
                     clock=fc.clock)
    ctl.run(poll_s=1.0, wait=lambda _s: fc.clock.advance(), max_s=1e6)
    assert fc.trainer.steps_done == cfg.policy.total_steps
    assert len(fc.trainer.staleness) == cfg.policy.total_steps * cfg.policy.groups_per_step
