"""Context parallelism in the train step: a cell's packed rows split along their sequence over
its 'fsdp' axis (CellSteps, model.context_parallel_axis) give the one-device step.

References: CellSteps without context parallelism on one device, and an independent plain
value_and_grad of the dense-mask model with full logits (float32, 1e-5)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gyre_jax import cells
from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.cells.train_step import context_parallel_rules
from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig, loss_from_logits
from gyre_jax.model import Transformer, init_boxed, init_params, model_config_tiny, param_logical_axes
from tests.test_long_context import _policy_batch, check_grads_close

TOL = 1e-5
ROWS, ROW_LEN = 2, 64  # 4 sequence shards of 16 tokens, 2 q-tiles of 8 each
MODEL = model_config_tiny(attention_block_q=8, attention_block_k=8)
CP_MODEL = MODEL.replace(context_parallel_axis="fsdp")
OPT = cells.OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)
LOSS = PolicyLossConfig()


def _steps(model):
    spec = cells.StateSpec.create(functools.partial(init_boxed, model), cells.make_optimizer(OPT, param_logical_axes(model)))
    return spec, cells.CellSteps(spec, policy_loss_fn(model, LOSS), cells.make_schedule(OPT), reductions=METRIC_REDUCTIONS)


def _reference_grads(params, mb):
    def loss(p):
        logits = Transformer(MODEL.replace(attention_impl="dense")).apply(
            p, mb["tokens"], mb["positions"], mb["segment_ids"], mb["subtree_end"])
        return loss_from_logits(logits, mb, LOSS)[0]

    dev = jax.devices()[0]
    return jax.jit(jax.value_and_grad(loss))(jax.device_put(params, dev))


def test_context_parallel_rules():
    rules = dict(context_parallel_rules(cells.RULES, "fsdp"))
    assert rules["length"] == "fsdp" and rules["batch"] == ("data", "expert")
    with pytest.raises(ValueError, match="no 'length'"):
        context_parallel_rules((("batch", "data"),), "fsdp")


def test_grad_step_with_rows_split_over_the_cell_equals_one_device():
    """One cell of 8 devices, fsdp=4 x tensor=2: each device holds 16 tokens of every row
    (and a quarter of the weights); loss and gradients equal one device's (the slow test
    below also compares CellSteps on one device, stats and the optimizer update)."""
    (cell,) = cells.split_cells(cells.CellConfig(cell_size=8, train_tensor=2))
    mesh = cell.train_mesh
    _, cp_steps = _steps(CP_MODEL)
    assert cp_steps.context_parallel_axis == "fsdp"
    assert cp_steps.batch_sharding(mesh).spec == P(None, "fsdp")
    params = init_params(MODEL, jax.random.key(0))
    mb = {k: np.asarray(v) for k, v in _policy_batch(ROW_LEN, ROWS, seed=5).items()}
    batch = jax.device_put(mb, cp_steps.batch_sharding(mesh))
    assert {s.data.shape for s in batch["tokens"].addressable_shards} == {(ROWS, ROW_LEN // 4)}
    grads, stats = cp_steps.grad_step(mesh)(jax.device_put(params, cp_steps.param_shardings(mesh)), batch)

    want_loss, want_grads = _reference_grads(params, {k: jnp.asarray(v) for k, v in mb.items()})
    np.testing.assert_allclose(float(stats["loss"]), float(want_loss), rtol=TOL, atol=TOL)
    check_grads_close(jax.device_get(grads), jax.device_get(want_grads))


@pytest.mark.slow
def test_train_step_context_parallel_with_long_row_plan_equals_one_device():
    """The jitted train_step (2 micro-batches, optax update) with rows split 8 ways and the
    long-row memory plan on (remat + chunked logits over a sequence-sharded row) = one device."""
    (cell,) = cells.split_cells(cells.CellConfig(cell_size=8))
    model_cp = CP_MODEL.replace(long_row_len=32)
    spec, cp_steps = _steps(model_cp)
    spec1, steps1 = _steps(MODEL.replace(long_row_len=0))
    params = init_params(MODEL, jax.random.key(2))
    mbs = [_policy_batch(ROW_LEN, ROWS, seed=s) for s in (6, 7)]
    batch = {k: np.stack([np.asarray(m[k]) for m in mbs]) for k in mbs[0]}
    state = spec.state_from_params(params, cell.train_mesh, initial_version=3)
    new, metrics = cp_steps.train_step(cell.train_mesh)(state, batch)
    (one,) = cells.split_cells(cells.CellConfig(cell_size=1), jax.devices()[:1])
    state1 = spec1.state_from_params(params, one.train_mesh, initial_version=3)
    new1, metrics1 = steps1.train_step(one.train_mesh)(state1, batch)
    for k in metrics1:
        np.testing.assert_allclose(float(metrics[k]), float(metrics1[k]), rtol=TOL, atol=TOL, err_msg=k)
    check_grads_close(jax.device_get(new.params), jax.device_get(new1.params))


def test_context_parallel_axis_must_be_on_the_mesh():
    _, cp_steps = _steps(MODEL.replace(context_parallel_axis="seq"))
    (one,) = cells.split_cells(cells.CellConfig(cell_size=1), jax.devices()[:1])
    mb = {k: np.asarray(v) for k, v in _policy_batch(32, 1, seed=1).items()}
    with pytest.raises(ValueError, match="context_parallel_axis='seq' is not an axis"):
        cp_steps.grad_step(one.train_mesh)(init_params(MODEL, jax.random.key(0)), mb)
