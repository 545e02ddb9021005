"""Expert parallelism (model/moe.py): experts split over a mesh axis, tokens dispatched and combined
all-to-all inside shard_map; loss and grads equal the single-device dense reference in packed rows."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model import Transformer, init_params
from gyre_jax.model.transformer import param_logical_axes
from gyre_jax.sharding import tree_shardings
from tests.test_moe import ATOL, _loss, moe_config, tree_row


@pytest.fixture(scope="module")
def reference():
    cfg = moe_config(num_experts=8, num_experts_per_tok=3, mlp_only_layers=(0,))
    params = init_params(cfg, jax.random.key(7))
    row = tree_row()
    loss, grads = _loss(cfg.replace(moe_impl="dense"))(params, *row)
    return cfg, params, row, float(loss), grads


@pytest.mark.parametrize("shape", [{"expert": 2}, {"expert": 4}, {"data": 2, "expert": 2}])
def test_expert_parallel_equals_dense_reference(reference, shape):
    cfg, params, row, want_loss, want_grads = reference
    n = int(np.prod(list(shape.values())))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(tuple(shape.values())), tuple(shape))
    ep = cfg.replace(expert_parallel_axis="expert")
    # Params laid out by the rules table: experts split over 'expert'; rows over data x expert.
    placed = jax.device_put(params, tree_shardings(param_logical_axes(ep), mesh, params))
    with jax.set_mesh(mesh):  # the dispatch's shard_map splits the tokens over data x expert itself
        rows = jax.device_put(row, NamedSharding(mesh, PartitionSpec()))
        loss, grads = _loss(ep)(placed, *rows)
    assert placed["params"]["layers_1"]["moe"]["gate"].sharding.spec[1] == "expert"
    np.testing.assert_allclose(float(loss), want_loss, atol=ATOL, rtol=0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


def test_expert_parallel_needs_a_mesh_axis(reference):
    cfg, params, row, _, _ = reference
    with pytest.raises(ValueError, match="expert_parallel_axis='expert'"):
        _loss(cfg.replace(expert_parallel_axis="expert"))(params, *row)


@pytest.mark.slow  # ~30 CPU-s: three compiles of an 8-device step
def test_cell_grad_step_with_expert_axis_equals_one_device():
    """A cell of 8 devices laid out fsdp=2 x expert=2 x tensor=2 (CellConfig.train_expert): CellSteps'
    grad step of the policy loss (with the aux loss) equals one device's dense-reference gradient."""
    import functools

    import jax.numpy as jnp

    from gyre_jax import cells
    from gyre_jax.cells.loss import policy_loss_fn
    from gyre_jax.losses import METRIC_REDUCTIONS
    from gyre_jax.model import init_boxed
    from tests.test_long_context import _policy_batch, check_grads_close

    (cell,) = cells.split_cells(cells.CellConfig(cell_size=8, train_tensor=2, train_expert=2))
    mesh = cell.train_mesh
    assert dict(mesh.shape) == {"fsdp": 2, "expert": 2, "tensor": 2}
    model = moe_config(router_aux_loss_coef=0.01)
    opt = cells.OptimizerConfig(learning_rate=1e-3)

    def steps(m):
        spec = cells.StateSpec.create(functools.partial(init_boxed, m), cells.make_optimizer(opt, param_logical_axes(m)))
        return cells.CellSteps(spec, policy_loss_fn(m), cells.make_schedule(opt), reductions=METRIC_REDUCTIONS)

    ep = steps(model.replace(expert_parallel_axis="expert"))
    params = init_params(model, jax.random.key(0))
    mb = {k: np.asarray(v) for k, v in _policy_batch(32, 4, seed=3).items()}
    grads, stats = ep.grad_step(mesh)(jax.device_put(params, ep.param_shardings(mesh)),
                                      jax.device_put(mb, ep.batch_sharding(mesh)))
    assert ep.param_shardings(mesh)["params"]["layers"]["moe"]["up"].spec[1] == "expert"

    ref_loss = policy_loss_fn(model.replace(moe_impl="dense"))
    (want_loss, want_stats), want_grads = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(
        params, {k: jnp.asarray(v) for k, v in mb.items()})
    np.testing.assert_allclose(float(stats["loss"]), float(want_loss), rtol=ATOL, atol=ATOL)  # with the aux term
    np.testing.assert_allclose(float(stats["moe_aux_loss"]), float(want_stats["moe_aux_loss"]), rtol=ATOL)
    check_grads_close(jax.device_get(grads), jax.device_get(want_grads))


def test_expert_degree_must_fit_the_cell():
    from gyre_jax import cells
    from gyre_jax.errors import ConfigError
    from gyre_jax.rl.config import CellsConfig

    with pytest.raises(ValueError, match="train_tensor \\* train_expert=8"):
        cells.CellConfig(cell_size=4, train_tensor=2, train_expert=4)
    with pytest.raises(ConfigError, match="config.cells.train_tensor \\* train_expert=8"):
        CellsConfig(cell_size=4, train_tensor=2, train_expert=4)
    cell = cells.split_cells(cells.CellConfig(cell_size=4, train_tensor=2))[0]
    assert cell.train_mesh.axis_names == ("fsdp", "tensor")  # train_expert=1: the mesh dense models always had


@pytest.mark.slow  # ~30 CPU-s: a dense-reference and an expert-parallel gradient compile
def test_expert_parallel_replays_recorded_routing(reference):
    """Routing replay (R3): recorded experts enter before the dispatch, so over 2 expert devices the
    replayed loss and grads equal the single-device dense reference given the same records."""
    import jax.numpy as jnp

    cfg, params, (toks, pos, seg, end), _, _ = reference
    rng = np.random.default_rng(0)
    k = cfg.num_experts_per_tok
    routing = np.full(toks.shape + (cfg.routing_width,), -1, np.int16)
    rec = rng.random(toks.shape) < 0.5  # half the tokens recorded (the rest routed live)
    routing[rec] = np.stack([rng.permutation(cfg.num_experts)[:k] for _ in range(int(rec.sum()))])

    def loss(c):
        def f(p, r):
            logits = jax.nn.log_softmax(Transformer(c).apply(p, toks, pos, seg, end, routing_BxLxR=r))
            nll = -jnp.take_along_axis(logits, np.roll(toks, -1, 1)[..., None], -1)[..., 0] * (seg > 0)
            return jnp.sum(nll) / jnp.sum(seg > 0)
        return jax.jit(jax.value_and_grad(f))

    replay = cfg.replace(routing_replay=True)
    want_loss, want_grads = loss(replay.replace(moe_impl="dense"))(params, routing)
    live_loss, _ = loss(cfg.replace(moe_impl="dense"))(params, routing)
    assert abs(float(live_loss) - float(want_loss)) > 1e-3  # the records differ from the live routing
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    ep = replay.replace(expert_parallel_axis="expert")
    placed = jax.device_put(params, tree_shardings(param_logical_axes(ep), mesh, params))
    with jax.set_mesh(mesh):
        got_loss, got_grads = loss(ep)(placed, jax.device_put(routing, NamedSharding(mesh, PartitionSpec())))
    np.testing.assert_allclose(float(got_loss), float(want_loss), atol=ATOL, rtol=0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
