"""Dynamic data parallelism: the same step whoever computes it, and when satellites join.

One step (12 micro-batches of packed trees, weights normalized over the step)
is computed by the core alone, by the core with 1-3 satellites joining after
the core has finished k micro-batches (driven by events, no sleeps), by the
single-cell jitted ``train_step``, and by an independent single-device
full-batch reference (one value_and_grad over all rows + the same optax
update). New params and loss must agree.
"""
import concurrent.futures
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gyre_jax import cells
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig, loss_from_logits
from gyre_jax.model import Transformer, init_boxed, init_params, model_config_tiny, param_logical_axes
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree

M, B, L = 12, 2, 32  # micro-batches per step, rows per micro-batch, row length
VERSION = 3  # policy version being trained; rollouts come from versions 1..3
WAIT_S = 120  # deadlock guard for the pacing events (never reached when correct)

MODEL = model_config_tiny()
OPT = cells.OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)
LOSS = PolicyLossConfig()


def _tree(rng, version):
    """A prompt with two trainable branches (a retry), vocab ids in 1..127."""

    def span(n, trainable):
        toks = rng.integers(1, MODEL.vocab_size, n)
        lp = np.log(1.0 / MODEL.vocab_size) + 0.05 * rng.standard_normal(n)
        return TreeNode.span(toks, trainable=trainable, logprobs=lp.astype(np.float32), policy_version=version)

    root = span(4, False)
    root.children = [span(int(rng.integers(3, 7)), True), span(int(rng.integers(2, 5)), True)]
    return serialize_tree(root)


def make_step_batches(seed=0):
    """M micro-batches of [B, L]; weights w = 1 / (N_r * R) (design counting rule), sum 1 over the step."""
    rng = np.random.default_rng(seed)
    rows = [[_tree(rng, int(rng.integers(1, VERSION + 1))) for _ in range(2)] for _ in range(M * B)]
    packed = pack_rows(rows, L)
    n_rollouts = 2 * M * B
    adv = rng.standard_normal(n_rollouts).astype(np.float32)
    for r, trees in enumerate(rows):
        for s, t in enumerate(trees):
            seg = packed.segment_ids[r] == s + 1
            on = seg & packed.loss_mask[r]
            packed.loss_weights[r, on] = 1.0 / (t.num_trainable * n_rollouts)
            packed.advantages[r, seg] = adv[2 * r + s]
    d = packed.as_dict()
    return [{k: v[i * B : (i + 1) * B] for k, v in d.items()} for i in range(M)]


@pytest.fixture(scope="module")
def setup():
    """Cells, steps and the step's micro-batches; every executable compiled up front, in parallel."""
    cs = cells.split_cells(cells.CellConfig(cell_size=2))
    spec = cells.StateSpec.create(functools.partial(init_boxed, MODEL), cells.make_optimizer(OPT, param_logical_axes(MODEL)))
    steps = cells.CellSteps(spec, policy_loss_fn(MODEL, LOSS), cells.make_schedule(OPT), reductions=METRIC_REDUCTIONS)
    mbs = make_step_batches()
    params0 = init_params(MODEL, jax.random.key(0))
    with concurrent.futures.ThreadPoolExecutor(len(cs) + 2) as pool:
        futs = [pool.submit(steps.warm, c.train_mesh, mbs[0], core=c is cs[0]) for c in cs]
        futs.append(pool.submit(lambda: jax.block_until_ready(single_cell_step(steps, spec, cs, params0, mbs))))
        futs.append(pool.submit(reference_step, params0, mbs))
        results = [f.result() for f in futs]
    return dict(cells=cs, spec=spec, steps=steps, mbs=mbs, params0=params0, train_step=results[-2], reference=results[-1])


def single_cell_step(steps, spec, cs, params0, mbs):
    """The jitted train_step on the core cell alone, micro-batches stacked [M, B, L]."""
    state = spec.state_from_params(params0, cs[0].train_mesh, initial_version=VERSION)
    batch = {k: np.stack([m[k] for m in mbs]) for k in mbs[0]}
    return steps.train_step(cs[0].train_mesh)(state, batch)


def reference_step(params0, mbs):
    """Independent: one device, full batch, plain value_and_grad + the same optax update."""
    full = {k: np.concatenate([m[k] for m in mbs]) for k in mbs[0]}
    tx = cells.make_optimizer(OPT, param_logical_axes(MODEL))

    def loss_fn(p, batch):
        logits = Transformer(MODEL).apply(p, batch["tokens"], batch["positions"], batch["segment_ids"], batch["subtree_end"])
        return loss_from_logits(logits, batch, LOSS)[0]

    @jax.jit
    def ref(p, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, _ = tx.update(g, tx.init(p), p)
        return loss, jax.tree.map(jnp.add, p, u), optax.tree.norm(g)

    dev = jax.devices()[0]
    loss, params, grad_norm = ref(jax.device_put(params0, dev), jax.device_put(full, dev))
    # The gradient's norm too: AdamW's first update is nearly invariant to a uniform gradient scale,
    # so params alone would not catch a step whose scale (or normaliser) was computed but not applied.
    return float(loss), jax.device_get(params), float(grad_norm)


def fresh_trainer(setup):
    cs, spec = setup["cells"], setup["spec"]
    state = spec.state_from_params(setup["params0"], cs[0].train_mesh, initial_version=VERSION)
    return cells.ElasticTrainer(setup["steps"], cs[0], state)


def run_with_joins(trainer, mbs, joins):
    """Run one step; satellite ``cell`` joins once the core has finished ``k`` micro-batches.

    Pacing (events only): after satellite s is due, the core waits at its next
    pull until s has pulled once, and a satellite waits at its second pull until
    every satellite has pulled once, so every joined satellite gets work.
    """
    lock = threading.Lock()
    core_done = [0]
    due = {c.index: threading.Event() for c, _ in joins}
    pulled = {c.index: threading.Event() for c, _ in joins}
    n_pulls = {c.index: 0 for c, _ in joins}

    def mark_due():
        for c, k in joins:
            if core_done[0] >= k:
                due[c.index].set()

    def on_done(cell, i):
        if cell == 0:
            with lock:
                core_done[0] += 1
            mark_due()

    def on_pull(cell, i):
        if cell == 0:
            waits = [c.index for c, _ in joins if due[c.index].is_set()]
        else:
            with lock:
                n_pulls[cell] += 1
                first = n_pulls[cell] == 1
            pulled[cell].set()
            waits = [] if first else [c.index for c, _ in joins]
        for w in waits:
            assert pulled[w].wait(WAIT_S), f"pacing: satellite {w} never pulled"

    mark_due()
    step = trainer.start_step(mbs, on_pull=on_pull, on_done=on_done)
    for c, _ in sorted(joins, key=lambda ck: ck[1]):
        assert due[c.index].wait(WAIT_S), f"pacing: core never finished enough micro-batches for {c}"
        assert step.join(c), f"{c} found the queue empty"
    return step.wait()


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def param_scale(p):
    return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(p))


@pytest.fixture(scope="module")
def core_alone(setup):
    tr = fresh_trainer(setup)
    rep = tr.run_step(setup["mbs"])
    return rep, jax.device_get(tr.state.params)


@pytest.fixture(scope="module")
def reference(setup):
    return setup["reference"]


def test_core_alone_matches_single_device_reference(core_alone, reference):
    rep, params = core_alone
    ref_loss, ref_params, ref_grad_norm = reference
    assert rep.cell_of == (0,) * M
    assert rep.version == VERSION
    assert max_diff(params, ref_params) <= 1e-6 * param_scale(ref_params)
    assert rep.loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert rep.stats["weight_sum"] == pytest.approx(1.0, rel=1e-5)
    assert rep.grad_norm == pytest.approx(ref_grad_norm, rel=1e-5) and rep.update_norm > 0


@pytest.mark.parametrize(
    "joins",
    [((1, 2),), ((1, 0), (2, 3)), ((1, 1), (2, 1), (3, 2))],
    ids=["1sat@2", "2sat@0,3", "3sat@1,1,2"],
)
def test_satellites_joining_mid_step_give_the_same_step(setup, core_alone, reference, joins):
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    rep = run_with_joins(tr, mbs, [(cs[i], k) for i, k in joins])
    params = jax.device_get(tr.state.params)
    base_rep, base_params = core_alone
    # Ordered reduction: the same bits whichever cell computed what (stricter than the
    # 1e-6 relative bound; same executable on every cell, same summation order).
    assert max_diff(params, base_params) == 0.0
    assert rep.loss == base_rep.loss
    assert max_diff(params, reference[1]) <= 1e-6 * param_scale(reference[1])
    # Every satellite really computed something, every micro-batch exactly once.
    assert sorted(set(rep.cell_of)) == [0] + sorted(i for i, _ in joins)
    assert all(c >= 0 for c in rep.cell_of) and len(rep.cell_of) == M
    assert sorted(s.cell_index for s in rep.snapshots) == sorted(i for i, _ in joins)
    # Cells worked at the same time: some satellite micro-batch ran while a core one was open.
    core = [(a, b) for c, a, b in rep.timeline if c == 0]
    sats = [(a, b) for c, a, b in rep.timeline if c != 0]
    assert any(a1 < b2 and a2 < b1 for a1, b1 in core for a2, b2 in sats), rep.timeline
    for s in rep.snapshots:
        assert s.bytes == cells.tree_bytes(base_params) and s.seconds > 0 and s.version == VERSION
    # New params on the core, laid out by the rules.
    jax.tree.map(_assert_sharding, tr.state.params, setup["steps"].param_shardings(cs[0].train_mesh))
    assert tr.version == VERSION + 1


def test_single_cell_train_step_matches(setup, core_alone, reference):
    cs, spec = setup["cells"], setup["spec"]
    new, metrics = setup["train_step"]
    params = jax.device_get(new.params)
    assert max_diff(params, reference[1]) <= 1e-6 * param_scale(reference[1])
    assert float(metrics["loss"]) == pytest.approx(core_alone[0].loss, rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(reference[2], rel=1e-5)
    assert int(new.policy_version) == VERSION + 1 and int(new.step) == 1
    assert float(metrics["staleness_mean"]) == pytest.approx(core_alone[0].staleness_mean, rel=1e-6)
    assert float(metrics["staleness_max"]) == core_alone[0].staleness_max
    jax.tree.map(_assert_sharding, new, spec.state_shardings(cs[0].train_mesh))


def _assert_sharding(x, s):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)


def test_staleness_metrics(core_alone, setup):
    mbs = setup["mbs"]
    tv = np.concatenate([m["target_version"].ravel() for m in mbs])
    lm = np.concatenate([m["loss_mask"].ravel() for m in mbs])
    lag = VERSION - tv[lm]
    rep = core_alone[0]
    assert rep.staleness_mean == pytest.approx(lag.mean(), rel=1e-6)
    assert rep.staleness_max == lag.max() == 2


def test_bad_versions_and_shapes_are_refused(setup):
    mbs = setup["mbs"]
    tr = fresh_trainer(setup)
    future = [dict(m) for m in mbs]
    future[5] = {**mbs[5], "target_version": np.where(mbs[5]["loss_mask"], VERSION + 1, -1)}
    with pytest.raises(ValueError, match="micro-batch 5: .*sampled by policy version 4, newer"):
        tr.start_step(future)
    unversioned = [dict(m) for m in mbs]
    unversioned[2] = {**mbs[2], "target_version": np.full_like(mbs[2]["target_version"], -1)}
    with pytest.raises(ValueError, match="micro-batch 2: a trained token has target_version -1"):
        tr.start_step(unversioned)
    short = [dict(m) for m in mbs]
    short[1] = {k: v[:, : L // 2] for k, v in mbs[1].items()}
    with pytest.raises(ValueError, match="micro-batch 1: shapes/dtypes differ"):
        tr.start_step(short)
    missing = [{k: v for k, v in m.items() if k != "advantages"} for m in mbs]
    with pytest.raises(ValueError, match="micro-batch 0: missing fields \\['advantages'\\]"):
        tr.start_step(missing)
    with pytest.raises(ValueError, match="no micro-batches"):
        tr.start_step([])


def test_a_failing_cell_fails_the_step_and_leaves_the_state(setup, core_alone):
    mbs = setup["mbs"]
    tr = fresh_trainer(setup)
    before = jax.device_get(tr.state.params)

    def on_pull(cell, i):
        if i == 3:
            raise RuntimeError("cell lost at micro-batch 3")

    step = tr.start_step(mbs, on_pull=on_pull)
    with pytest.raises(RuntimeError, match="cell lost at micro-batch 3"):
        step.wait()
    assert tr.version == VERSION
    assert max_diff(jax.device_get(tr.state.params), before) == 0.0
    rep = tr.run_step(mbs)  # the trainer is usable again, same result as before
    assert rep.loss == core_alone[0].loss


def test_join_and_leave_are_legal_in_any_order(setup, core_alone):
    """Programming errors raise; everything a scheduler can do in a race returns a value."""
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    checked = threading.Event()  # the core holds its first micro-batch until the checks are done
    step = tr.start_step(mbs, on_pull=lambda cell, i: checked.wait(WAIT_S) if cell == 0 else None)
    try:
        with pytest.raises(ValueError, match="shares devices with the core"):
            step.join(cs[0])
        with pytest.raises(ValueError, match="core cannot leave"):
            step.leave(cs[0])
        assert step.join(cs[1])
        assert step.join(cs[1])  # already training: a no-op
        assert step.leave(cs[2]).result(WAIT_S) is None  # never joined: nothing to wait for
        step.leave(cs[1])
        assert step.join(cs[1])  # rejoined (before or after its worker stopped)
        with pytest.raises(RuntimeError, match="previous step has not been waited for"):
            tr.start_step(mbs)
        with pytest.raises(RuntimeError, match="a step is in progress"):
            tr.state
    finally:
        checked.set()
    rep = step.wait()
    assert not step.join(cs[2])  # the step is over: refused, not raised
    assert step.leave(cs[1]).done()
    assert rep.loss == core_alone[0].loss and rep.failed_cells == ()
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0


def test_a_failing_satellite_hands_its_work_back(setup, core_alone):
    """A satellite that fails after pulling: its micro-batches are recomputed by the core,
    the step is the same bits, and the report names the failed cell."""
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    failed = threading.Event()

    def on_pull(cell, i):
        if cell == 2:
            failed.set()
            raise RuntimeError(f"cell 2 lost at micro-batch {i}")
        if cell == 0 and not failed.wait(WAIT_S):
            raise AssertionError("pacing: satellite never pulled")

    step = tr.start_step(mbs, on_pull=on_pull)
    assert step.join(cs[2])
    rep = step.wait()
    assert [c for c, _ in rep.failed_cells] == [2] and "cell 2 lost" in rep.failed_cells[0][1]
    assert 2 not in rep.cell_of and set(rep.cell_of) == {0}
    assert rep.loss == core_alone[0].loss
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0


def test_a_failing_satellites_delivered_work_stays_in_its_busy_time(setup, core_alone):
    """A satellite fails at its second pull with its first micro-batch dispatched: that result was
    stored at dispatch and is reduced (cell_of names the satellite), so its interval is busy time
    too (the scheduler's measured work), not an empty (-1) entry."""
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    failed = threading.Event()
    pulls: list[int] = []

    def on_pull(cell, i):
        if cell == 2:
            pulls.append(i)
            if len(pulls) == 2:
                failed.set()
                raise RuntimeError(f"cell 2 lost at micro-batch {i}")
        elif not failed.wait(WAIT_S):
            raise AssertionError("pacing: satellite never failed")

    step = tr.start_step(mbs, on_pull=on_pull)
    assert step.join(cs[2])
    rep = step.wait()
    first = pulls[0]
    assert [c for c, _ in rep.failed_cells] == [2] and rep.cell_of[first] == 2
    cell, t0, t1 = rep.timeline[first]
    assert cell == 2 and t1 > t0 and all(c != -1 for c, _, _ in rep.timeline), rep.timeline
    assert rep.loss == core_alone[0].loss
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0


def test_a_streamed_step_equals_the_whole_step(setup, core_alone):
    """Micro-batches added while the step runs (and a satellite that joins, leaves and
    rejoins meanwhile) give the same bits as the whole step at once."""
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    step = tr.start_step(mbs[:3], more=True)
    assert step.join(cs[1])
    step.add(mbs[3:7])
    step.leave(cs[1]).result(WAIT_S)
    step.add(mbs[7:])
    assert step.join(cs[1])
    with pytest.raises(ValueError, match="micro-batch 12: shapes/dtypes differ"):
        step.add([{k: v[:, : L // 2] for k, v in mbs[0].items()}])
    step.close()
    with pytest.raises(RuntimeError, match="closed"):
        step.add(mbs[:1])
    rep = step.wait()
    assert rep.num_micro_batches == M and rep.loss == core_alone[0].loss
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0


def test_busy_cell_seconds_is_the_union_of_each_cells_intervals():
    from gyre_jax.cells.elastic import busy_cell_seconds

    rng = np.random.default_rng(0)
    timeline = [(int(c), float(a), float(a + d)) for c, a, d in
                zip(rng.integers(0, 3, 40), rng.uniform(0, 10, 40), rng.uniform(0, 2, 40))]
    timeline += [(-1, 0.0, 0.0), (1, 20.0, 20.0)]  # not computed; an empty interval
    grid = np.arange(0, 13, 1e-4) + 5e-5  # midpoints of a fine grid: the reference counts covered cells
    ref = sum(1e-4 * np.any([(grid >= a) & (grid < b) for c, a, b in timeline if c == cell], axis=0).sum()
              for cell in range(3))
    assert busy_cell_seconds(timeline) == pytest.approx(ref, abs=1e-3)
    assert busy_cell_seconds([(0, 0.0, 2.0), (0, 1.0, 3.0), (1, 0.0, 1.0)]) == pytest.approx(4.0)


def test_a_streamed_steps_wait_for_data_is_not_busy_time(setup):
    """What the trainer measures as training work per row (the scheduler's work_s_per_rollout)."""
    mbs = setup["mbs"]
    tr = fresh_trainer(setup)
    three_done = threading.Event()
    done: list[int] = []
    step = tr.start_step(mbs[:3], more=True, on_done=lambda c, i: (done.append(i), len(done) == 3 and three_done.set()))
    assert three_done.wait(WAIT_S)
    idle_s = 0.5
    time.sleep(idle_s)  # the step is open and has nothing to compute: a streamed step waiting for groups
    step.add(mbs[3:])
    step.close()
    rep = step.wait()
    assert 0 < rep.busy_cell_s <= rep.seconds - idle_s, (rep.busy_cell_s, rep.seconds)


def test_a_late_normalizer_scales_the_step(setup, reference):
    """close(grad_scale=c) on rows weighted 1/c too heavily gives the normalized step."""
    mbs = setup["mbs"]
    heavy = [{**m, "loss_weights": m["loss_weights"] * 4.0} for m in mbs]  # exact in float32
    tr = fresh_trainer(setup)
    step = tr.start_step(heavy, more=True)
    step.close(grad_scale=0.25)
    rep = step.wait()
    ref_loss, ref_params, ref_grad_norm = reference
    assert rep.grad_scale == 0.25 and rep.stats["weight_sum"] == pytest.approx(1.0, rel=1e-6)
    assert rep.loss == pytest.approx(ref_loss, rel=1e-5)
    assert rep.grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)  # the scale reached the gradient
    assert max_diff(jax.device_get(tr.state.params), ref_params) <= 1e-6 * param_scale(ref_params)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_join_leave_flapping_keeps_the_step(setup, core_alone, seed):
    """Satellites join and leave at random moments, many times, from another thread."""
    cs, mbs = setup["cells"], setup["mbs"]
    rng = np.random.default_rng(seed)
    tr = fresh_trainer(setup)
    gate = threading.Semaphore(0)  # the core computes one micro-batch per chaos action

    def on_pull(cell, i):
        if cell == 0:
            assert gate.acquire(timeout=WAIT_S), "pacing: chaos thread stopped"

    step = tr.start_step(mbs, on_pull=on_pull)
    for _ in range(4 * M):
        c = cs[int(rng.integers(1, len(cs)))]
        if rng.random() < 0.5:
            step.join(c)
        else:
            fut = step.leave(c)
            if rng.random() < 0.5:
                fut.result(WAIT_S)
        gate.release()
    for _ in range(M):
        gate.release()
    rep = step.wait()
    assert rep.loss == core_alone[0].loss and rep.failed_cells == ()
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0


def test_more_cells_never_recompile_a_seen_layout(setup):
    """After every cell has run once, steps with 0..3 satellites compile nothing at all."""
    cs, steps, mbs = setup["cells"], setup["steps"], setup["mbs"]
    fresh_trainer(setup).run_step(mbs, cs[1:])  # every cell's grad step exists now
    compiles = []

    def listener(event, duration=None, **kw):
        # A compile the persistent cache answers (tests/conftest.py turns it on) skips the backend
        # compile: it counts too, or a step that recompiled would pass here.
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    try:
        for sats in (cs[1:2], cs[1:], (), (cs[3], cs[1])):
            rep = fresh_trainer(setup).run_step(mbs, sats)
            assert set(rep.cell_of) <= {0} | {c.index for c in sats}
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(listener)
    assert compiles == []
    counts = steps.compiled()
    assert {n for n in counts.values()} == {1}, counts
    assert {dev for kind, dev in counts if kind == "grad_step"} == {c.devices[0].id for c in cs}


def _assert_on_rollout_cell(pub, trainer, publisher):
    assert pub.move.kind == "to_rollout" and pub.move.bytes == cells.tree_bytes(pub.params) and pub.move.seconds > 0
    assert max_diff(pub.params, trainer.state.params) == 0.0
    jax.tree.map(_assert_sharding, pub.params, publisher.shardings(pub.cell, cells.Role.ROLLOUT))


def test_publisher_moves_new_versions_and_refuses_older(setup):
    """The one publication path: core params -> a cell's serving layout, measured, never backwards."""
    cs, spec, mbs = setup["cells"], setup["spec"], setup["mbs"]
    tr = fresh_trainer(setup)
    pub = cells.WeightPublisher(spec.logical_params, spec.abstract_params)
    for n in range(1, 3):
        tr.run_step(mbs, cs[1:2])
        for c in cs[2:]:
            _assert_on_rollout_cell(pub.publish(tr.state.params, tr.version, c, cells.Role.ROLLOUT), tr, pub)
    assert [m.version for m in pub.history] == [VERSION + 1] * 2 + [VERSION + 2] * 2
    assert pub.latest(cs[3]).version == VERSION + 2
    with pytest.raises(ValueError, match="cell 3 holds version 5; refusing older version 4"):
        pub.publish(tr.state.params, VERSION + 1, cs[3])
    with pytest.raises(ValueError, match="core holds the authoritative params"):
        pub.publish(tr.state.params, VERSION + 2, cs[3], cells.Role.CORE)


def test_a_satellite_can_leave_mid_step(setup, core_alone):
    """Leaving after one micro-batch: the cell is freed early, the step is unchanged."""
    cs, mbs = setup["cells"], setup["mbs"]
    tr = fresh_trainer(setup)
    freed = []
    go = threading.Event()  # the core waits until the satellite has left

    def on_pull(cell, i):
        if cell == 1:
            freed.append(step.leave(cs[1]))  # from the satellite's own thread, right after its first pull
            go.set()
        elif not go.wait(WAIT_S):
            raise AssertionError("pacing: satellite never pulled")

    step = tr.start_step(mbs, on_pull=on_pull)
    assert step.join(cs[1])
    assert go.wait(WAIT_S)
    assert freed[0].result(WAIT_S) is None  # the cell is free without waiting for the step
    rep = step.wait()
    assert rep.cell_of.count(1) == 1 and rep.cell_of.count(0) == M - 1
    assert max_diff(jax.device_get(tr.state.params), core_alone[1]) == 0.0
    assert rep.loss == core_alone[0].loss
