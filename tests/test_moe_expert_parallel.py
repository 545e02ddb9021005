"""Expert parallelism (model/moe.py): experts split over a mesh axis, tokens dispatched and combined
all-to-all inside shard_map; loss and grads equal the single-device dense reference in packed rows."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model import init_params
from gyre_jax.sharding import tree_shardings
from gyre_jax.model.transformer import param_logical_axes
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
