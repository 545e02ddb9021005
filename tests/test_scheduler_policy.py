"""The role policy on hand-made cluster states."""
import ast
import collections
import dataclasses
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.scheduler import modes, vocab
from gyre_jax.scheduler import policy as P
from gyre_jax.scheduler.costs import move_pays


def cells(roles, *, slots=8, calls=None):
    calls = calls or {}
    return tuple(P.CellView(id=i, role=r, is_core=i == 0, slots=slots, active_calls=calls.get(i, 0))
                 for i, r in enumerate(roles))


def state(**kw):
    base = dict(cells=cells(["train"] + ["rollout"] * 15), queued_calls=0, running_rollouts=0, running_groups=(),
                ready_groups=(), launched_groups=0, steps_done=0, open_step_taken=0, pending_work_s=0.0,
                update_in_progress=False, published_version=0, publish_in_progress=False)
    base.update(kw)
    return P.ClusterState(**base)


def cfg(mode="elastic", **kw):
    base = dict(mode=mode, total_steps=10, groups_per_step=4, group_size=2, staleness_bound=1)
    base.update(kw)
    return P.PolicyConfig(**base)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_two_rollouts_left_keep_one_serving_cell_move_fourteen_to_training():
    # 16 cells: core training, 15 serving; two agents still running (on cell 3), the
    # step's work has arrived. One cell keeps a slot for each agent's next call, the
    # other 14 go to training (a switch is known to take a second each way).
    s = state(cells=cells(["train"] + ["rollout"] * 15, calls={3: 2}), running_rollouts=2,
              running_groups=((0, 1),), launched_groups=12, open_step_taken=3, pending_work_s=10_000.0,
              measured=P.Measured(switch_round_trip_s=2.0))
    c = cfg(total_steps=3, groups_per_step=4, staleness_bound=2)  # nothing left to launch
    acts = P.decide(s, c)
    assert of(acts, P.Launch) == []
    to_train = [a.cell for a in of(acts, P.ToTrain)]
    assert len(to_train) == 14
    assert 3 not in to_train and 0 not in to_train  # the busy cell keeps serving; the core never switches
    assert of(acts, P.ToRollout) == []


def test_serving_first_pulls_training_cells_back_when_agents_arrive():
    # 12 running agents need 2 cells of 8 slots; only one serves: one training cell
    # comes back (the lowest id), even with training work pending.
    roles = ["train"] * 15 + ["rollout"]
    s = state(cells=cells(roles), running_rollouts=12, running_groups=((0, 8),), launched_groups=8,
              pending_work_s=1e6)
    acts = P.decide(s, cfg(groups_per_step=8, staleness_bound=0))
    assert acts == (P.ToRollout(1),)


def test_switch_only_when_enough_work_per_cell():
    # 100 cell-seconds with the core training, a prior switch cost of 24 s: a second cell
    # gets 50 s (>= 24), a third 33 s, a fourth 25 s, a fifth would get 20 s: three switches.
    s = state(pending_work_s=100.0, launched_groups=40, open_step_taken=1, running_groups=())
    acts = P.decide(s, cfg(total_steps=10, groups_per_step=4, min_work_per_switch_s=24.0))
    assert len(of(acts, P.ToTrain)) == 3
    assert of(P.decide(dataclasses.replace(s, pending_work_s=0.0), cfg(total_steps=10)), P.ToTrain) == []
    # a measured round trip replaces the prior: 100 / 12 -> 8 training cells, 7 switches
    measured = P.Measured(switch_round_trip_s=12.0)
    acts = P.decide(dataclasses.replace(s, measured=measured), cfg(total_steps=10, min_work_per_switch_s=24.0))
    assert len(of(acts, P.ToTrain)) == 7


def test_work_coming_from_running_agents_pays_for_a_switch():
    # The open step holds nothing yet, but 60 running agents will each hand in 2 cell-seconds:
    # 120 s coming, 12 s per switch round trip -> 10 training cells (9 switches), as many as
    # serving can spare (60 agents at a reserve of 0.5 need 4 of the 15 satellites).
    # (serving 0.5 cell-seconds per rollout: the steady-state split wants 12+ training cells)
    m = P.Measured(work_s_per_rollout=2.0, serve_s_per_rollout=0.5, switch_round_trip_s=12.0, call_share=0.5)
    s = state(running_rollouts=60, running_groups=((0, 30),), launched_groups=30, measured=m)
    c = cfg(groups_per_step=30, staleness_bound=0, total_steps=1)
    assert P.train_cells_target(s, c) >= 10
    assert len(of(P.decide(s, c), P.ToTrain)) == 9
    # counting only the open step's work (none) would keep every cell serving
    assert of(P.decide(dataclasses.replace(s, measured=P.Measured(switch_round_trip_s=12.0)), c), P.ToTrain) == []
    # beyond the steady-state split only work already there moves cells (the tail)
    few = dataclasses.replace(m, serve_s_per_rollout=100.0)  # serving-bound: the split keeps the core alone
    assert P.train_cells_target(dataclasses.replace(s, measured=few), c) == 1
    assert of(P.decide(dataclasses.replace(s, measured=few), c), P.ToTrain) == []
    assert len(of(P.decide(dataclasses.replace(s, measured=few, pending_work_s=36.0), c), P.ToTrain)) == 2


def test_steady_state_split_is_the_last_training_bound_split_of_the_step_model():
    # brute force over k of the step model (serve / (n - k) vs train / k + update) against the
    # bisection: the largest k where training still bounds the step (serving's slack is lent to
    # training), k = 1 when even the core alone is serving-bound
    for serve, work, upd in ((0.1, 0.03, 10.0), (1.0, 0.01, 0.0), (0.01, 1.0, 5.0), (0.5, 0.5, 100.0),
                             (0.01, 5.0, 0.0), (0.3, 0.6, 0.0)):
        m = P.Measured(serve_s_per_rollout=serve, work_s_per_rollout=work, update_s=upd)
        c = cfg(groups_per_step=16, group_size=8)
        R = 128
        bound = [k for k in range(1, 16) if serve * R / (16 - k) < work * R / k + upd]
        want = max(bound) if bound else 1
        assert P.train_cells_target(state(measured=m), c) == want, (serve, work, upd)
    assert P.train_cells_target(state(), cfg()) == 1  # nothing measured: the core alone


def _split_state(training: int, rt: float, **kw):
    # 16 cells, `training` of them training; a step (8 rollouts) costs 60 training and 95
    # serving cell-seconds: 20 s with 3 training cells, 10 s with 6 (the best split)
    roles = ["train"] * training + ["rollout"] * (16 - training)
    m = P.Measured(serve_s_per_rollout=95 / 8, work_s_per_rollout=60 / 8, update_s=0.0, switch_round_trip_s=rt)
    return state(cells=cells(roles), measured=m, **kw)


def test_a_move_to_the_better_split_must_pay_for_itself_over_the_steps_left():
    # 10 s saved per step: over 10 steps left, 100 s pays a 12 s round trip, not a 900 s one
    assert P.train_cells_target(_split_state(3, 12.0), cfg(total_steps=10)) == 6
    assert P.train_cells_target(_split_state(3, 900.0), cfg(total_steps=10)) == 3
    # ... but 200 steps left (2,000 s saved) pay for it
    assert P.train_cells_target(_split_state(3, 900.0), cfg(total_steps=200)) == 6
    # and 1 step left of those 200 does not
    assert P.train_cells_target(_split_state(3, 900.0, steps_done=199), cfg(total_steps=200)) == 3
    # admission follows the kept split: 13 serving cells x 8 slots, not the best split's 10
    assert P.max_running_rollouts(_split_state(3, 900.0), cfg(total_steps=10)) == 13 * 8


def test_no_lending_when_a_round_trip_outlasts_a_step():
    # serving 100.5 s, training 60 s a step: 6 training cells are serving-bound (10.05 s a
    # step), 5 training-bound (12 s). With cheap switches elastic takes 5 and lends serving's
    # slack to training; a round trip longer than a step cannot be lent in time: 6, the faster.
    assert P.best_split(16, 100.5, 60.0, 0.0, 1.0) == 5
    assert P.best_split(16, 100.5, 60.0, 0.0, 100.0) == 6


def test_elastic_starts_at_the_split_its_priors_give():
    priors = P.Measured(serve_s_per_rollout=95 / 8, work_s_per_rollout=60 / 8, update_s=0.0, switch_round_trip_s=900.0)
    assert P.initial_roles(cfg(priors=priors), 16) == ("train",) * 6 + ("rollout",) * 10
    assert P.initial_roles(cfg(), 16) == ("train",) + ("rollout",) * 15  # no priors: the core alone
    # switches cheaper than a step: every satellite serves the first step, costs are measured
    cheap = dataclasses.replace(priors, switch_round_trip_s=1.0)
    assert P.initial_roles(cfg(priors=cheap), 16) == ("train",) + ("rollout",) * 15
    # a prior is used until the cost is measured
    s = _split_state(6, 900.0)
    blind = dataclasses.replace(s, measured=P.Measured(switch_round_trip_s=900.0))
    assert P.train_cells_target(blind, cfg(priors=priors)) == 6
    assert P.train_cells_target(blind, cfg()) == 1


def test_a_switch_in_progress_bounds_the_switch_cost_from_below():
    # nothing measured, prior 0: 100 cell-seconds of work move cells to training; once a
    # switch has been under way for 500 s, the round trip is known to cost at least that
    s = state(pending_work_s=100.0, launched_groups=40, open_step_taken=1)
    assert of(P.decide(s, cfg()), P.ToTrain)
    slow = dataclasses.replace(s, measured=P.Measured(switch_in_flight_s=500.0))
    assert P.switch_cost_s(slow, cfg()) == 500.0
    assert of(P.decide(slow, cfg()), P.ToTrain) == []


def test_a_cell_goes_back_below_the_split_only_when_a_round_trip_fits_in_a_step():
    # 8 cells at the split 5 train / 3 serve (slots 2); 12 running agents whose first call share
    # reads 1.0 need 6 serving cells. A step takes ~88 s here: with a 900 s round trip, sending
    # training cells back pays nothing (their calls wait); with a 9 s one, three go back.
    m = P.Measured(call_share=1.0, serve_s_per_rollout=27.3, work_s_per_rollout=53.6, update_s=2.0)
    s = state(cells=cells(["train"] * 5 + ["rollout"] * 3, slots=2), running_rollouts=12,
              running_groups=((0, 6),), launched_groups=6)
    c = cfg(groups_per_step=4, group_size=2, staleness_bound=1, total_steps=8)
    costly = dataclasses.replace(s, measured=dataclasses.replace(m, switch_round_trip_s=900.0))
    assert P.round_trip_outlasts_step(costly, c) and of(P.decide(costly, c), P.ToRollout) == []
    cheap = dataclasses.replace(s, measured=dataclasses.replace(m, switch_round_trip_s=9.0))
    assert not P.round_trip_outlasts_step(cheap, c)
    assert of(P.decide(cheap, c), P.ToRollout) == [P.ToRollout(1), P.ToRollout(2), P.ToRollout(3)]


def _lending_state(to_train_s, to_rollout_s, work_s):
    """8 cells of 8 slots: the core and one lent cell training, six serving two agents; ``work_s``
    cell-seconds of training already there, nothing measured but the switches."""
    m = P.Measured(switch_to_train_s=to_train_s, switch_to_rollout_s=to_rollout_s,
                   switch_round_trip_s=to_train_s + to_rollout_s, update_s=0.0)
    return state(cells=cells(["train"] * 2 + ["rollout"] * 6), running_rollouts=2, running_groups=((0, 1),),
                 launched_groups=12, open_step_taken=3, pending_work_s=work_s, measured=m)


def test_a_switch_starts_only_when_it_pays_before_its_cells_are_needed_back():
    # Issue 46. 2,800 cell-seconds of work on 2 training cells, a 600 s switch to train and 300 s back:
    # a third cell would start after the two did 1,200 of it and save 267 s of the rest, less than the
    # 300 s the next step's agents wait for it to come back. (It was lent: 2,800 / 900 s >= 3 cells.)
    c = cfg(total_steps=3, groups_per_step=4, staleness_bound=2)
    assert of(P.decide(_lending_state(600.0, 300.0, 2800.0), c), P.ToTrain) == []
    # switches of a minute: every spare cell pays (five: one keeps serving the two agents)
    assert len(of(P.decide(_lending_state(60.0, 30.0, 2800.0), c), P.ToTrain)) == 5
    # dear to train, cheap back: enough work pays for the wait
    assert len(of(P.decide(_lending_state(600.0, 10.0, 20_000.0), c), P.ToTrain)) == 5
    # a move to a better split: 2 steps left arrive after the run's end, 20 pay (step model:
    # serving 100 and training 100 cell-seconds a step on 8 cells, from 1 training cell to 3)
    assert not move_pays(8, (100.0, 100.0, 0.0), 1, 3, 600.0, 2.0)
    assert move_pays(8, (100.0, 100.0, 0.0), 1, 3, 600.0, 20.0)
    # ... and back down with a dear switch back: 20 steps of 100 s do not pay a 3,000 s one
    assert not move_pays(8, (100.0, 100.0, 0.0), 5, 3, 3000.0, 20.0)


def test_a_switch_of_unknown_cost_is_a_probe():
    # Nothing measured or given about switches (the RL loop's first run): one cell moves, and no
    # other until it has arrived; a 600 s switch then costs one cell, not every spare one.
    s = state(cells=cells(["train"] + ["rollout"] * 15), pending_work_s=10_000.0, launched_groups=12,
              open_step_taken=3, running_groups=())
    c = cfg(total_steps=3, groups_per_step=4, staleness_bound=2)
    assert len(of(P.decide(s, c), P.ToTrain)) == 1
    moving = dataclasses.replace(s, cells=cells(["train", "to_train"] + ["rollout"] * 14))
    assert of(P.decide(moving, c), P.ToTrain) == []
    # the first arrival measured the way to training; the way back, still unmeasured, may cost more
    # than the run has left (issue 46: 30 s there, 1,200 s back): the cell beyond the split probes it
    arrived = dataclasses.replace(moving, cells=cells(["train"] * 2 + ["rollout"] * 14),
                                  measured=P.Measured(switch_to_train_s=1.0))
    assert of(P.decide(arrived, c), P.ToTrain) == []
    # both ways measured (or stated by a prior): the rest follow
    known = dataclasses.replace(arrived, measured=P.Measured(switch_to_train_s=1.0, switch_to_rollout_s=1.0))
    assert len(of(P.decide(known, c), P.ToTrain)) == 14


def test_take_reserves_room_for_a_running_group_that_reaches_its_bound():
    # S=1, step 1 open with 3 of 4 taken. A version-0 group is still running: it must be
    # trained by step 1, so the ready version-1 group may not take the last position.
    s = state(steps_done=1, open_step_taken=3, published_version=1, launched_groups=9,
              running_groups=((0, 1), (1, 3)), ready_groups=(P.ReadyGroup(version=1, work_s=5.0),))
    assert P.takeable_groups(s, cfg(staleness_bound=1)) == 0
    # once it finished (oldest first in the buffer) both fit: it is taken first, the other waits
    s2 = dataclasses.replace(s, running_groups=((1, 3),),
                             ready_groups=(P.ReadyGroup(version=0, work_s=5.0), P.ReadyGroup(version=1, work_s=5.0)))
    assert P.takeable_groups(s2, cfg(staleness_bound=1)) == 1
    # with a looser bound the version-1 group may go now
    assert P.takeable_groups(s, cfg(staleness_bound=2)) == 1


def test_a_resume_past_the_bound_at_step_0_takes_the_oldest_groups_instead_of_stalling():
    # bench_chaos: a stop in step 1 resumed from checkpoint 0 with 15 finished and 9 re-running groups, all of
    # version 0 (the lost steps' tokens count as the restored policy's), while steps 0..S hold 16: more than
    # fit within the bound. No group is a must-take at step 0 (version <= -1), and the rule refused every
    # other take because step 1 was already over: nothing taken, nothing launched, for ever.
    c = cfg(groups_per_step=8, group_size=8, staleness_bound=1, total_steps=8)
    ready = tuple(P.ReadyGroup(version=0, work_s=1.0) for _ in range(15))
    s = state(ready_groups=ready, running_groups=((0, 9),), running_rollouts=72, launched_groups=24)
    assert of(P.decide(s, c), P.TakeGroups) == [P.TakeGroups(8)]
    assert P.launch_allowance(s, c, 8) == 0  # the excess is trained first, late; no new group adds to it
    # the next step takes the rest oldest first: version 0 is due by step 1 now
    s1 = dataclasses.replace(s, steps_done=1, published_version=1, ready_groups=ready[8:], launched_groups=24)
    assert P.takeable_groups(s1, c) == 7


def test_without_streaming_a_step_takes_only_a_whole_batch():
    ready = tuple(P.ReadyGroup(version=0, work_s=1.0) for _ in range(3))
    s = state(ready_groups=ready, running_groups=((0, 1),), launched_groups=4)
    assert P.takeable_groups(s, cfg("elastic", groups_per_step=4)) == 3
    assert P.takeable_groups(s, cfg("elastic_no_stream", groups_per_step=4)) == 0
    s4 = dataclasses.replace(s, ready_groups=ready + (P.ReadyGroup(version=0, work_s=1.0),), running_groups=())
    assert P.takeable_groups(s4, cfg("elastic_no_stream", groups_per_step=4)) == 4


def test_launch_allowance_is_the_staleness_bound():
    c = cfg(groups_per_step=4, staleness_bound=2, total_steps=10)
    s = state()  # fresh: steps 0, 1, 2 may hold version-0 groups
    assert P.launch_allowance(s, c, 0) == 12
    # 10 unassigned (running or ready) groups of version 0: two more
    s = state(running_groups=((0, 10),), launched_groups=10)
    assert P.launch_allowance(s, c, 0) == 2
    # after the first update is published, one more step's worth
    s = state(running_groups=((0, 8),), launched_groups=12, steps_done=1, published_version=1)
    assert P.launch_allowance(s, c, 0) == 4
    # never beyond the run's total
    assert P.launch_allowance(state(), cfg(groups_per_step=4, total_steps=2, staleness_bound=5), 0) == 8


def test_launch_paced_by_serving_capacity():
    # 15 satellites x 8 slots = 120 agents at reserve 1.0; 118 run: no room for a group of 4
    c = cfg(groups_per_step=100, group_size=4, staleness_bound=2)
    s = state(running_rollouts=118, running_groups=((0, 30),), launched_groups=30)
    assert P.launch_allowance(s, c, 0) == 0
    assert P.launch_allowance(dataclasses.replace(s, running_rollouts=110), c, 0) == 2
    # reserving half a slot per agent doubles the room
    assert P.launch_allowance(s, dataclasses.replace(c, serve_reserve=0.5), 0) == 30


def test_colocate_phases():
    c = cfg("colocate", groups_per_step=2, staleness_bound=3)  # the bound is 0 by construction
    roles = ["rollout"] * 4
    s = state(cells=cells(roles))
    assert of(P.decide(s, c), P.Launch) == [P.Launch(2, 0)]
    # batch done: take it, every cell to training; nothing launched meanwhile
    ready = (P.ReadyGroup(version=0, work_s=3.0),) * 2
    s = state(cells=cells(roles), ready_groups=ready, launched_groups=2)
    acts = P.decide(s, c)
    assert acts == (P.TakeGroups(2),) + tuple(P.ToTrain(i) for i in range(4))
    # step done: publish and go back; launch only once version 1 is published
    s = state(cells=cells(["train"] * 4), steps_done=1, launched_groups=2)
    acts = P.decide(s, c)
    assert acts == (P.Publish(1),) + tuple(P.ToRollout(i) for i in range(4))
    s = dataclasses.replace(s, cells=cells(roles), published_version=1)
    assert P.decide(s, c) == (P.Launch(2, 1),)


def test_async_keeps_its_fixed_split():
    c = cfg("async", async_train_cells=3)
    assert P.initial_roles(c, 8) == ("train",) * 3 + ("rollout",) * 5
    s = state(cells=cells(["train"] * 3 + ["rollout"] * 13), pending_work_s=1e6, running_rollouts=0)
    assert of(P.decide(s, c), P.ToTrain) == [] and of(P.decide(s, c), P.ToRollout) == []


def test_finished_run_decides_nothing():
    assert P.decide(state(steps_done=10, published_version=9), cfg(total_steps=10)) == ()


@pytest.mark.parametrize("kw, msg", [
    (dict(mode="elastc"), "mode"),
    (dict(groups_per_step=0), "groups_per_step"),
    (dict(staleness_bound=-1), "staleness_bound"),
    (dict(serve_reserve=0.0), "serve_reserve"),
])
def test_bad_config_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        cfg(**kw)


@settings(max_examples=150, deadline=None)
@given(
    roles=st.lists(st.sampled_from(vocab.CELL_ROLES), min_size=2, max_size=10),
    running=st.integers(0, 80),
    work=st.floats(0, 1e4),
    mode=st.sampled_from(P.MODES),
    taken=st.integers(0, 3),
    n_ready=st.integers(0, 6),
)
def test_actions_are_always_executable(roles, running, work, mode, taken, n_ready):
    roles[0] = "train" if mode != "colocate" else roles[0]
    c = cfg(mode, groups_per_step=4, async_train_cells=1)
    s = state(cells=cells(roles), running_rollouts=running, running_groups=((0, (running + 1) // 2),),
              launched_groups=20, pending_work_s=work, open_step_taken=taken,
              ready_groups=tuple(P.ReadyGroup(version=0, work_s=1.0) for _ in range(n_ready)))
    acts = P.decide(s, c)
    assert acts == P.decide(s, c)  # pure
    switched = [a.cell for a in acts if isinstance(a, (P.ToTrain, P.ToRollout))]
    assert len(switched) == len(set(switched))
    for a in acts:
        if isinstance(a, P.ToTrain):
            assert roles[a.cell] == "rollout" and (mode == "colocate" or a.cell != 0)
        if isinstance(a, P.ToRollout):
            assert roles[a.cell] == "train" and (mode == "colocate" or a.cell != 0)
        if isinstance(a, P.TakeGroups):
            assert 0 < a.n <= min(n_ready, 4 - taken)


def reference_takeable(s, c):
    """Group by group, straight from the rule (independent of the policy's version-run code)."""
    if s.update_in_progress or s.steps_done >= c.total_steps:
        return 0
    u, G, S, N = s.steps_done, c.groups_per_step, c.effective_staleness, c.total_steps
    slots_left = G - s.open_step_taken
    n = 0
    while n < min(slots_left, len(s.ready_groups)):
        g = s.ready_groups[n]
        if g.version <= u - S:
            n += 1
            continue
        unassigned = [v for v, k in s.running_groups for _ in range(k)] + [r.version for r in s.ready_groups[n + 1:]]
        # a step w the group is due by is no worse off for taking it (it holds a position one of w's would)
        if all(g.version <= w - S or sum(v <= w - S for v in unassigned) <= (slots_left - n - 1) + G * (w - u)
               for w in range(u, min(N - 1, u + S) + 1)):
            n += 1
        else:
            break
    return n if c.streaming or n == slots_left else 0


@settings(max_examples=300, deadline=None)
@given(
    u=st.integers(0, 5),
    bound=st.integers(0, 3),
    taken=st.integers(0, 4),
    ready=st.lists(st.integers(0, 5), max_size=9),
    running=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), max_size=3, unique_by=lambda t: t[0]),
    mode=st.sampled_from(["elastic", "elastic_no_stream"]),
)
def test_takeable_matches_group_by_group_reference(u, bound, taken, ready, running, mode):
    c = cfg(mode, groups_per_step=5, staleness_bound=bound, total_steps=8)
    s = state(steps_done=u, open_step_taken=taken, published_version=u,
              ready_groups=tuple(P.ReadyGroup(version=min(v, u), work_s=1.0) for v in sorted(ready)),
              running_groups=tuple(sorted((min(v, u), k) for v, k in running)))
    assert P.takeable_groups(s, c) == reference_takeable(s, c)


def test_one_vocabulary_of_cell_roles_and_modes_and_no_jax_in_the_policy():
    # The policy, the simulator and the JAX side (cells.mesh.Role) share scheduler.vocab;
    # the policy itself stays free of jax and numpy so any host can run it.
    code = ("import sys, gyre_jax.scheduler.policy, gyre_jax.scheduler.modes; "
            "print(sorted(m for m in ('numpy', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    from gyre_jax.cells.mesh import Role
    assert {Role.TRAIN.value, Role.ROLLOUT.value} == {vocab.TRAIN, vocab.ROLLOUT}
    # the built-in modes' names are the vocabulary's, each a registered strategy object
    assert P.MODES is vocab.MODES and vocab.MODES == tuple(m.name for m in modes.BUILTIN)
    assert all(modes.get_mode(m).name == m for m in vocab.MODES)


def scheduler_module_imports() -> dict[str, set[str]]:
    """scheduler module -> the scheduler modules it imports: every import statement, inside
    functions and under ``if TYPE_CHECKING:`` too (a cycle hidden there is still a cycle)."""
    root = pathlib.Path(P.__file__).parent
    out: dict[str, set[str]] = {}
    for f in sorted(root.glob("*.py")):
        deps = out.setdefault(f.stem, set())
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, ast.ImportFrom) and n.module == "gyre_jax.scheduler":
                deps.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("gyre_jax.scheduler."):
                deps.add(n.module.split(".")[2])
            elif isinstance(n, ast.Import):
                deps.update(a.name.split(".")[2] for a in n.names if a.name.startswith("gyre_jax.scheduler."))
        deps.discard(f.stem)
    return out


def test_the_policy_modules_import_one_way():
    """policy.py split into state, policy_config, costs and admission (issue 43 item 5): each imports
    only those before it, and no scheduler module is in an import cycle (TYPE_CHECKING included)."""
    g = scheduler_module_imports()
    order = ["vocab", "state", "policy_config", "costs", "admission", "modes", "policy"]
    for i, m in enumerate(order):
        assert g[m] <= set(order[:i]), (m, sorted(g[m] - set(order[:i])))
    done: set[str] = set()

    def visit(m, path):
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        if m not in done:
            for d in sorted(g.get(m, ())):
                visit(d, path + [m])
            done.add(m)

    for m in g:
        visit(m, [])
    assert g["__init__"] == {"modes"}  # what makes the built-in modes known to any PolicyConfig


def test_multi_step_publishes_every_k_updates():
    """updates_per_publication=k: a Publish only once k updates are unpublished."""
    c = cfg(updates_per_publication=2, staleness_bound=1)
    pubs = [of(P.decide(state(steps_done=u, published_version=p), c), P.Publish) for u, p in ((1, 0), (2, 0), (3, 2))]
    assert pubs == [[], [P.Publish(2)], []]
    assert of(P.decide(state(steps_done=1, published_version=0), cfg()), P.Publish) == [P.Publish(1)]  # one-step
    assert of(P.decide(state(steps_done=2, published_version=0, publish_in_progress=True), c), P.Publish) == []
    with pytest.raises(ValueError, match=r"staleness_bound=1 must be >= updates_per_publication - 1 = 2"):
        cfg(updates_per_publication=3, staleness_bound=1)
    with pytest.raises(ValueError, match="colocate is on-policy"):
        cfg("colocate", updates_per_publication=2)
    with pytest.raises(ValueError, match="updates_per_publication=0"):
        cfg(updates_per_publication=0)


@pytest.mark.parametrize("mode", ["elastic", "async_stream"])
def test_multi_step_runs_to_the_end_within_its_staleness_bound(mode):
    """The simulator (same policy) in multi-step mode: every step trains, no rollout is
    discarded, staleness stays within S, and publications come every k updates."""
    from gyre_jax.scheduler import simulator
    from gyre_jax.testing.fake_cluster import tiny_sim_config

    for k, bound in ((2, 1), (3, 2)):
        r = simulator.simulate(tiny_sim_config(mode, **{"policy.updates_per_publication": k,
                                                        "policy.staleness_bound": bound, "policy.total_steps": 7}))
        p = r.config.policy
        assert len(r.step_end_s) == 7 and r.rollouts_trained == 7 * p.groups_per_step * p.group_size
        assert r.staleness_max <= bound
        pubs = [a.version for d in r.decisions for a in d.actions if isinstance(a, P.Publish)]
        assert pubs == list(range(k, 7, k)), pubs


def test_out_of_service_cells_get_no_work():
    """A cell taken out of service is neither switched nor counted as serving capacity."""
    roles = ["train", vocab.OUT, "rollout", vocab.OUT]
    s = state(cells=cells(roles), running_rollouts=0, pending_work_s=1e6, ready_groups=())
    acts = P.decide(s, cfg(min_work_per_switch_s=0.0))
    assert all(a.cell not in (1, 3) for a in of(acts, P.ToTrain) + of(acts, P.ToRollout))
    assert P.max_running_rollouts(s, cfg()) == 8  # one live serving cell of 8 slots
    s = state(cells=cells(roles), running_rollouts=30, pending_work_s=0.0)
    assert all(a.cell not in (1, 3) for a in of(P.decide(s, cfg()), P.ToRollout))


def _run_after_rewind(c, u0, ready, running, sizes):
    """Drive ``P.decide`` from a resumed state to the run's end: groups finish at once, each step closes when it
    holds its size. Returns the staleness of every trained group, and how many were launched."""
    ready, running = sorted(ready), list(running)
    launched = u0 * c.groups_per_step + len(ready) + len(running)
    u, pub, open_, stale = u0, u0, [], []
    for _ in range(10 * c.total_steps * c.groups_per_step):
        if u >= c.total_steps:
            break
        s = state(steps_done=u, open_step_taken=len(open_), published_version=pub, launched_groups=launched,
                  ready_groups=tuple(P.ReadyGroup(version=v, work_s=1.0) for v in ready),
                  running_groups=tuple(sorted(collections.Counter(running).items())), step_sizes=sizes)
        for a in P.decide(s, c):
            if isinstance(a, P.Publish):
                pub = a.version
            elif isinstance(a, P.TakeGroups):
                open_, ready = open_ + ready[:a.n], ready[a.n:]
                if len(open_) == P.step_groups(s, c, u):
                    stale += [u - v for v in open_]
                    u, open_ = u + 1, []
            elif isinstance(a, P.Launch):
                running += [a.version] * a.n_groups
                launched += a.n_groups
        ready, running = sorted(ready + running), []
    assert u == c.total_steps, f"stalled at step {u} with {len(ready)} ready"
    assert ready == [] and open_ == []  # every admitted group trained
    return stale, launched


def test_a_rewind_past_the_bound_trains_every_group_within_it_in_oversized_steps():
    # A kill two steps after checkpoint 1 (S=1, G=4): the lost steps' 8 groups and the 4 in flight all count as
    # sampled by the restored version 1, so all 12 are due by step 2 while steps 1-2 hold 8 at G each.
    c = cfg(groups_per_step=4, staleness_bound=1, total_steps=6)
    ready, running = [1] * 10, [1] * 2
    stale, _ = _run_after_rewind(c, 1, ready, running, P.NOMINAL)
    assert max(stale) == 2  # G per step: the excess trains one step late (what bench_chaos measured)
    sizes = P.resume_step_sizes(ready + running, 1, c)
    assert sizes == P.StepSizes(1, (6, 6))  # 12 due by step 2: two steps of 4 + ceil(4 / 2)
    stale, launched = _run_after_rewind(c, 1, ready, running, sizes)
    # steps 1-5 trained 6 + 6 + 4 x 3 groups: the 4 extra positions are filled by groups launched for them
    assert max(stale) <= 1 and len(stale) == launched - 4 == 24
    # older groups bind an earlier step: 6 of version 0 are due by step 1 itself
    assert P.resume_step_sizes([0] * 6 + [1] * 4, 1, c) == P.StepSizes(1, (6, 6))
    assert P.resume_step_sizes([0] * 3 + [1] * 5, 1, c) is P.NOMINAL  # fits at G: nothing changes
    # the run's last step takes every group left, whatever its version
    assert P.resume_step_sizes([5] * 6, 5, c) == P.StepSizes(5, (6,))
    # a rerun stopped again inside oversized steps (its lost lineage launched for the extra positions): the groups
    # left are all due by u + S, so the sizes that hold them within the bound hold them all
    sizes = P.resume_step_sizes([1] * 3 + [2] * 15, 2, c)
    assert sizes == P.StepSizes(2, (9, 9))
    stale, _ = _run_after_rewind(c, 2, [1] * 3 + [2] * 13, [2] * 2, sizes)
    assert max(stale) <= 1 and len(stale) == 9 + 9 + 4 + 4
    with pytest.raises(ValueError, match="a group of version 3 after a resume at step 2"):
        P.resume_step_sizes([3], 2, c)


def test_an_oversized_step_closes_at_its_own_size():
    c = cfg(groups_per_step=4, staleness_bound=1, total_steps=6)
    sizes = P.StepSizes(1, (6, 6))
    ready = tuple(P.ReadyGroup(version=1, work_s=1.0) for _ in range(8))
    s = state(steps_done=1, published_version=1, open_step_taken=4, ready_groups=ready, launched_groups=12,
              step_sizes=sizes)
    assert P.takeable_groups(s, c) == 2  # step 1 holds 6
    assert P.launch_allowance(s, c, 2) == 0  # the next step's 6 positions hold the 6 left
    s3 = dataclasses.replace(s, steps_done=3, published_version=3, open_step_taken=0, ready_groups=ready[:5],
                             launched_groups=26)
    assert P.takeable_groups(s3, c) == 4  # past the oversized steps: G again
    # step 4's 4 positions less the 1 group left would admit 3; the cap is 6 x 4 + the 4 extra - 26 launched
    assert P.launch_allowance(s3, c, 4) == 2
    assert P.launch_allowance(dataclasses.replace(s3, step_sizes=P.NOMINAL), c, 4) == 0
