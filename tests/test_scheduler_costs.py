"""Measured scheduler costs carried between runs (issue 26 item 5): the costs file, the priors
flag, a resumed run's restore, and a switch that must pay for itself on the real controller."""
import dataclasses
import importlib.util
import json
import os

import pytest

from gyre_jax.errors import ConfigError
from gyre_jax.rl.config import RLConfig
from gyre_jax.scheduler import costs_file, simulator, workloads
from gyre_jax.scheduler import policy as P
from gyre_jax.scheduler.controller import Controller
from gyre_jax.scheduler.estimates import OnlineEstimates
from gyre_jax.testing.fake_cluster import fake_cluster, tiny_sim_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTLY = {"cluster.switch_to_train_s": 600.0, "cluster.switch_to_rollout_s": 300.0, "policy.total_steps": 8}


def rl_config(**scheduler):
    """configs/demo.py with tiny_sim_config's policy: the loop's PolicyConfig and the simulator's can be compared."""
    spec = importlib.util.spec_from_file_location("demo_cfg", os.path.join(ROOT, "configs", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.steps = 8
    c.scheduler.update(dict(groups_per_step=4, group_size=2, staleness_bound=1, serve_reserve=0.5, **scheduler))
    return RLConfig.from_config(c)


def own_costs(workdir):
    return costs_file.load_own(workdir)


def save_costs(workdir, controller):
    """What the loop's step hook writes (gyre_jax.rl.build._step_hooks)."""
    costs_file.save_own(workdir, controller.estimates.measured())


def loop_policy(cfg, n_cells, own=None):
    """The scheduler config the loop runs (config.scheduler, with this workdir's own costs), checked on n_cells."""
    policy = cfg.scheduler.with_own_costs(own)
    policy.check_cells(n_cells, cfg.cells.cell_size)
    return policy


def run_fakes(cfg, policy=None):
    """The real Controller (online estimates on) over the fakes of gyre_jax.testing.fake_cluster, ticked at every
    instant (more often than the simulator), as the RL loop ticks it: (controller, fakes, initial roles)."""
    rollouts = workloads.rollouts_for(cfg)
    if policy is not None:
        cfg = cfg.replace(policy=policy)
    roles = P.initial_roles(cfg.policy, cfg.cluster.n_cells)
    fc = fake_cluster(cfg, rollouts, roles)
    ctl = Controller(cfg.policy, cells=fc.cells, proxy=fc.proxy, rollouts=fc.rollouts, trainer=fc.trainer,
                     clock=fc.clock)
    for i in range(1, 2000):  # the load is sampled every sample_s: a real loop polls at least that often
        fc.clock.at(i * ctl.sample_s, lambda: None)
    while not ctl.done():
        ctl.tick()
        assert fc.clock.advance(), "fakes ran out of events before the last step"
    return ctl, fc, roles


def test_costs_file_round_trips_and_keeps_a_switch_in_flight_as_the_round_trips_lower_bound(tmp_path):
    path = str(tmp_path / costs_file.FILE_NAME)
    m = P.Measured(call_share=0.5, serve_s_per_rollout=19.5, work_s_per_rollout=39.25, update_s=2.0)
    costs_file.save(path, m)
    assert costs_file.load(path) == m
    assert os.listdir(tmp_path) == [costs_file.FILE_NAME]  # written whole through a temporary file
    # a 600 s switch still under way must not read as a free one in the next run
    costs_file.save(path, dataclasses.replace(m, switch_in_flight_s=450.0))
    assert costs_file.load(path) == dataclasses.replace(m, switch_round_trip_s=450.0)


@pytest.mark.parametrize("text, says", [
    (None, "cannot read"),
    ("{", "not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"serve_s": 1.0}', r"unknown field\(s\) \['serve_s'\]"),
    ('{"work_s_per_rollout": -1}', "field 'work_s_per_rollout' must be null or a number >= 0"),
    ('{"update_s": "2"}', "field 'update_s' must be null"),
    ('{"update_s": true}', "field 'update_s' must be null"),
])
def test_a_bad_priors_file_is_one_line_naming_the_flag_path_and_field(tmp_path, text, says):
    path = tmp_path / "costs.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config\.scheduler\.priors='{path}': {path}: {says}") as e:
        rl_config(priors=str(path))
    assert "\n" not in str(e.value)


def test_a_damaged_costs_file_in_the_workdir_names_it(tmp_path):
    (tmp_path / costs_file.FILE_NAME).write_text('{"call_share": "x"}')
    with pytest.raises(ConfigError, match=rf"^--workdir: {tmp_path}/scheduler_costs.json: field 'call_share'"):
        own_costs(str(tmp_path))
    assert own_costs(str(tmp_path / "fresh")) is None


def test_the_loop_and_the_simulator_run_one_policy_on_the_same_costs(tmp_path):
    # The simulator's pilot priors, written as a run writes its costs and given to the loop by the flag:
    # the loop's PolicyConfig is the simulator's, so every decision (initial split included) is the same.
    sim = tiny_sim_config("elastic", **COSTLY)
    resolved = simulator.resolve(sim, workloads.rollouts_for(sim))
    path = str(tmp_path / costs_file.FILE_NAME)
    costs_file.save(path, resolved.policy.priors)
    policy = loop_policy(rl_config(priors=path), sim.cluster.n_cells)
    fields = [f.name for f in dataclasses.fields(P.PolicyConfig) if f.name != "async_train_cells"]  # elastic: unread
    assert {k: getattr(policy, k) for k in fields} == {k: getattr(resolved.policy, k) for k in fields}
    a = simulator.simulate(resolved)
    b = simulator.simulate(sim.replace(policy=policy, model_priors=False))
    assert [d.actions for d in a.decisions] == [d.actions for d in b.decisions]
    assert P.initial_roles(policy, 8) == ("train",) * 5 + ("rollout",) * 3


def test_a_resumed_run_goes_on_from_its_own_costs_until_it_measures_them_again(tmp_path):
    earlier = P.Measured(serve_s_per_rollout=20.0, work_s_per_rollout=40.0, switch_round_trip_s=900.0, update_s=2.0)
    est = OnlineEstimates(group_size=2, slots_per_cell=2)
    est.restore(earlier)
    assert est.measured() == earlier  # not blind from its first tick
    est.on_switch_done("train", 5.0)
    est.on_tick(1.0, finished=0, steps_done=0, update_in_progress=False)
    # one direction timed is a lower bound, not a round trip: the earlier 900 s stands
    assert est.measured() == dataclasses.replace(earlier, switch_in_flight_s=5.0, switch_to_train_s=5.0)
    est.on_switch_done("rollout", 3.0)
    est.on_tick(2.0, finished=0, steps_done=0, update_in_progress=False)
    assert est.measured() == dataclasses.replace(earlier, switch_round_trip_s=8.0, switch_to_train_s=5.0,
                                                 switch_to_rollout_s=3.0)  # measured anew: this one
    # and the policy the resumed loop builds starts at the split those costs give, the flag's priors elsewhere
    flag = tmp_path / "pilot.json"
    flag.write_text(json.dumps({"call_share": 0.25, "serve_s_per_rollout": 1.0}))
    pc = loop_policy(rl_config(priors=str(flag)), 8, own=earlier)
    assert pc.priors == dataclasses.replace(earlier, call_share=0.25)


def test_switches_costlier_than_a_step_leave_a_pilot_seeded_run_at_the_best_fixed_split(tmp_path):
    # Issue 26: a role switch (600 s + 300 s) outlasts a training step (~90 s). A blind pilot measures
    # the costs on the real controller and writes them as the loop does; the next run, given them by
    # --config.scheduler.priors, starts at the split they give and stays there: at most one switch
    # (there were two: every agent starts in a model call, so the first call share read 1.0 and sent
    # training cells back to serve, each arriving 300 s later), as fast as async at its best split.
    sim = tiny_sim_config("elastic", **COSTLY)
    pilot, _, _ = run_fakes(sim.replace(model_priors=False))
    save_costs(str(tmp_path), pilot)
    policy = loop_policy(rl_config(priors=str(tmp_path / costs_file.FILE_NAME)), 8)
    ctl, fc, roles = run_fakes(sim, policy)
    assert ctl.switches <= 1, [d for d in ctl.decisions if any(isinstance(a, (P.ToTrain, P.ToRollout))
                                                                for a in d.actions)]
    assert tuple(fc.cells.role(c) for c in range(8)) == roles  # a fixed split
    best = min(run_fakes(sim, dataclasses.replace(sim.policy, mode="async_stream", async_train_cells=k))[1].clock.now()
               for k in range(1, 8))
    assert fc.clock.now() <= 1.02 * best, (fc.clock.now(), best)


def test_priors_of_a_full_weights_pilot_are_rescaled_to_a_lora_runs_smaller_move(tmp_path):
    """A pilot that moved 1 GB per switch in 6 of its 10 s: a LoRA run moving 10 MB pays 4.06 s each way;
    a run moving the same bytes takes the pilot's costs as they are; without a measured move, unchanged."""
    from gyre_jax.scheduler.costs import for_move_bytes
    from gyre_jax.scheduler.policy import Measured

    pilot = Measured(switch_to_train_s=10.0, switch_to_rollout_s=8.0, switch_round_trip_s=18.0, move_bytes=1e9,
                     move_s=6.0, work_s_per_rollout=2.0)
    lora = for_move_bytes(pilot, 1e7)
    assert lora.switch_to_train_s == pytest.approx(4.06) and lora.switch_to_rollout_s == pytest.approx(2.06)
    assert lora.switch_round_trip_s == pytest.approx(6.12) and lora.move_s == pytest.approx(0.06)
    assert lora.work_s_per_rollout == 2.0
    assert for_move_bytes(pilot, 1e9) is pilot and for_move_bytes(Measured(switch_round_trip_s=5.0), 1e7).switch_round_trip_s == 5.0
    path = str(tmp_path / "costs.json")
    costs_file.save(path, pilot)
    assert costs_file.load(path).move_bytes == 1e9  # the file keeps what the rescale needs


def test_an_rl_config_rescales_its_priors_to_its_own_move(tmp_path):
    """--config.train.lora.rank on a run given a full-weights pilot's costs: the policy's priors are the
    pilot's with the move cut down to the adapters' bytes."""
    from configs import demo as demo_config
    from gyre_jax.rl.config import RLConfig
    from gyre_jax.scheduler.policy import Measured

    c = demo_config.get_config()
    full = RLConfig.from_config(c)
    path = str(tmp_path / "pilot.json")
    costs_file.save(path, Measured(switch_to_train_s=3.0, switch_to_rollout_s=3.0, move_bytes=full.switch_move_bytes,
                                   move_s=2.0))
    c.scheduler.priors = path
    c.train.lora.rank = 4
    lora = RLConfig.from_config(c)
    assert lora.switch_move_bytes * 20 < full.switch_move_bytes
    pc = lora.policy()
    assert pc.priors.switch_to_train_s == pytest.approx(1.0 + 2.0 * lora.switch_move_bytes / full.switch_move_bytes)
