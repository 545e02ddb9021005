"""Cells, the sharding rules table, train-state layout and weight publication (8 CPU devices)."""
import functools

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gyre_jax import cells
from gyre_jax.cells import Role
from gyre_jax.model import init_boxed, init_params, model_config_tiny, param_logical_axes

MODEL = model_config_tiny()  # vocab 128, d_model 32, 4 heads, 2 kv heads, head_dim 8, d_ff 64

# What the rules table says for every parameter, written out by hand.
TRAIN_SPECS = {  # mesh ('fsdp', 'tensor')
    "embed": P("tensor", "fsdp"),
    "final_norm/scale": P("fsdp"),
    "layers/attn/q": P(None, "fsdp", "tensor"),
    "layers/attn/k": P(None, "fsdp", "tensor"),
    "layers/attn/v": P(None, "fsdp", "tensor"),
    "layers/attn/o": P(None, "tensor", None, "fsdp"),
    "layers/attn_norm/scale": P(None, "fsdp"),
    "layers/mlp_norm/scale": P(None, "fsdp"),
    "layers/mlp/gate": P(None, "fsdp", "tensor"),
    "layers/mlp/up": P(None, "fsdp", "tensor"),
    "layers/mlp/down": P(None, "tensor", "fsdp"),
}
SERVE_SPECS = {  # mesh ('data', 'tensor'): no fsdp axis, so 'embed' is replicated
    "embed": P("tensor"),
    "final_norm/scale": P(),
    "layers/attn/q": P(None, None, "tensor"),
    "layers/attn/k": P(None, None, "tensor"),
    "layers/attn/v": P(None, None, "tensor"),
    "layers/attn/o": P(None, "tensor"),
    "layers/attn_norm/scale": P(),
    "layers/mlp_norm/scale": P(),
    "layers/mlp/gate": P(None, None, "tensor"),
    "layers/mlp/up": P(None, None, "tensor"),
    "layers/mlp/down": P(None, "tensor"),
}


def flat(params):
    """'layers/attn/q' -> leaf, from {'params': {...}}."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["params"])[0]:
        out["/".join(k.key for k in path)] = leaf
    return out


def assert_specs(tree, mesh, want):
    got = flat(tree)
    assert sorted(got) == sorted(want)
    for name, x in got.items():
        expected = NamedSharding(mesh, want[name])
        assert x.sharding.is_equivalent_to(expected, x.ndim), f"{name}: {x.sharding.spec} != {want[name]}"


@pytest.fixture(scope="module")
def cells4():
    """Two cells of 4 devices: training mesh fsdp=2 x tensor=2, serving mesh data=2 x tensor=2."""
    return cells.split_cells(cells.CellConfig(cell_size=4, train_tensor=2, serve_tensor=2))


@pytest.fixture(scope="module")
def spec():
    opt = cells.OptimizerConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=10, weight_decay=0.1)
    return cells.StateSpec.create(functools.partial(init_boxed, MODEL), cells.make_optimizer(opt, param_logical_axes(MODEL)))


@pytest.fixture(scope="module")
def state(spec, cells4):
    return spec.state_from_params(init_params(MODEL, jax.random.key(0)), cells4[0].train_mesh, initial_version=7)


def test_split_cells_meshes_and_roles():
    cs = cells.split_cells(cells.CellConfig(cell_size=2))
    assert [[d.id for d in c.devices] for c in cs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dict(cs[1].train_mesh.shape) == {"fsdp": 2, "tensor": 1}
    assert dict(cs[1].serve_mesh.shape) == {"data": 1, "tensor": 2}
    assert list(cs[1].serve_mesh.devices.flat) == list(cs[1].devices)
    layout = cells.CellLayout.create(cs)
    assert layout.roles == (Role.CORE, Role.ROLLOUT, Role.ROLLOUT, Role.ROLLOUT)
    layout = layout.with_role(2, Role.TRAIN)
    r2m = layout.role_to_mesh()
    assert r2m[Role.CORE] == (cs[0].train_mesh,)
    assert r2m[Role.TRAIN] == (cs[2].train_mesh,)
    assert r2m[Role.ROLLOUT] == (cs[1].serve_mesh, cs[3].serve_mesh)
    assert layout.cells_in(Role.TRAIN) == (cs[2],) and layout.core is cs[0]


def test_cell_errors_are_clear():
    with pytest.raises(ValueError, match="8 devices do not divide into cells of cell_size=3"):
        cells.split_cells(cells.CellConfig(cell_size=3))
    with pytest.raises(ValueError, match="cell_size=2 is not a multiple of train_tensor=4"):
        cells.CellConfig(cell_size=2, train_tensor=4)
    with pytest.raises(ValueError, match="cell_size=4 is not a multiple of serve_tensor=3"):
        cells.CellConfig(cell_size=4, serve_tensor=3)
    with pytest.raises(ValueError, match="cell_size must be a positive int"):
        cells.CellConfig(cell_size=0)
    layout = cells.CellLayout.create(cells.split_cells(cells.CellConfig(cell_size=4)))
    with pytest.raises(ValueError, match="cell_index=0 is not a satellite"):
        layout.with_role(0, Role.TRAIN)
    with pytest.raises(ValueError, match="core is fixed to cell 0"):
        layout.with_role(1, Role.CORE)
    with pytest.raises(ValueError, match="cell 0 and only cell 0 is CORE"):
        cells.CellLayout(layout.cells, (Role.ROLLOUT, Role.CORE))


def test_rules_table_errors(cells4):
    mesh = cells4[0].train_mesh
    assert cells.mesh_spec(("layers", "embed", "mlp"), mesh) == P(None, "fsdp", "tensor")
    assert cells.mesh_spec(("batch", "length"), mesh) == P("fsdp")  # 'data' is not on this mesh
    assert cells.mesh_spec(("batch", "length"), cells4[0].serve_mesh) == P("data")  # nor 'fsdp' here
    with pytest.raises(ValueError, match="w: logical axis 'experts' has no rule"):
        cells.mesh_spec(("experts", "embed"), mesh, where="w")
    with pytest.raises(ValueError, match="mesh axis 'tensor' would shard both 'heads' and 'mlp'"):
        cells.mesh_spec(("heads", "mlp"), mesh)
    with pytest.raises(ValueError, match=r"w: dimension 1 \('mlp'\) of shape \(4, 3\) has size 3, not divisible"):
        cells.mesh_spec(("embed", "mlp"), mesh, shape=(4, 3), where="w")


def test_state_is_born_sharded_as_the_rules_say(state, spec, cells4):
    mesh = cells4[0].train_mesh
    assert_specs(state.params, mesh, TRAIN_SPECS)
    clip_state, (adam, *_rest) = state.opt_state
    assert_specs(adam.mu, mesh, TRAIN_SPECS)
    assert_specs(adam.nu, mesh, TRAIN_SPECS)
    for scalar in (state.step, state.policy_version, adam.count):
        assert scalar.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    assert int(state.policy_version) == 7 and int(state.step) == 0
    # Weight decay reaches matrices only, never the norm scales (stacked [layers, embed]).
    mask = flat(cells.matrix_mask(spec.logical_params))
    assert {k for k, v in mask.items() if not v} == {"final_norm/scale", "layers/attn_norm/scale", "layers/mlp_norm/scale"}


def test_publish_to_rollout_and_train_layouts(state, spec, cells4):
    pub = cells.WeightPublisher(spec.logical_params, spec.abstract_params)
    host = jax.device_get(state.params)
    rollout = pub.publish(state.params, 7, cells4[1], Role.ROLLOUT)
    assert_specs(rollout.params, cells4[1].serve_mesh, SERVE_SPECS)
    assert {d for x in jax.tree.leaves(rollout.params) for d in x.devices()} == set(cells4[1].devices)
    chex.assert_trees_all_equal(host, jax.device_get(rollout.params))
    nbytes = sum(x.size * 4 for x in jax.tree.leaves(host))
    assert rollout.move.bytes == nbytes and rollout.move.kind == "to_rollout" and rollout.move.seconds > 0
    snap = pub.publish(state.params, 7, cells4[1], Role.TRAIN)  # same version, new layout: allowed
    assert_specs(snap.params, cells4[1].train_mesh, TRAIN_SPECS)
    assert pub.latest(cells4[1]) is snap and [m.kind for m in pub.history] == ["to_rollout", "to_train"]
    with pytest.raises(ValueError, match="cell 1 holds version 7; refusing older version 6"):
        pub.publish(state.params, 6, cells4[1])
    with pytest.raises(ValueError, match="publish to TRAIN or ROLLOUT"):
        pub.publish(state.params, 8, cells4[1], Role.CORE)


def test_layout_that_does_not_fit_the_model_is_refused(spec):
    """4-way tensor parallel serving cannot split 2 kv heads: say which parameter."""
    cs = cells.split_cells(cells.CellConfig(cell_size=4, train_tensor=2))  # serve_tensor = 4
    with pytest.raises(ValueError, match=r"\['params'\]\['layers'\]\['attn'\]\['k'\]: dimension 2 \('kv_heads'\)"):
        cells.WeightPublisher(spec.logical_params, spec.abstract_params).shardings(cs[1], Role.ROLLOUT)


def test_optimizer_config_is_validated_and_schedule_warms_up():
    with pytest.raises(ValueError, match="OptimizerConfig.learning_rate must be > 0"):
        cells.OptimizerConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="OptimizerConfig.max_grad_norm must be > 0 or None"):
        cells.OptimizerConfig(learning_rate=1e-3, max_grad_norm=0.0)
    sched = cells.make_schedule(cells.OptimizerConfig(learning_rate=1.0, warmup_steps=4, decay_steps=8, final_lr_fraction=0.5))
    np.testing.assert_allclose([float(sched(s)) for s in (0, 2, 4, 12)], [0.0, 0.5, 1.0, 0.5], rtol=1e-6)
