"""gyre_jax.cells: devices split into cells, the train step, elastic training (sharding rules: gyre_jax/sharding.py).

    from gyre_jax import cells
    cs = cells.split_cells(cells.CellConfig(cell_size=2))
    layout = cells.CellLayout.create(cs)                      # cell 0 core, the rest rollout
    spec = cells.StateSpec.create(partial(init_boxed, model_cfg), cells.make_optimizer(opt_cfg, param_logical_axes(model_cfg)))
    steps = cells.CellSteps(spec, loss_fn, cells.make_schedule(opt_cfg))
    trainer = cells.ElasticTrainer(steps, layout.core, spec.init_state(rng, layout.core.train_mesh))
    step = trainer.start_step(micro_batches); step.join(cs[1]); report = step.wait()

Modules: mesh (cells, roles), train_state, train_step,
elastic (dynamic data parallelism), publish (versioned weight moves), loss (the
policy loss on the model). The publication cadence (one-step / multi-step) is the
scheduler's policy (``PolicyConfig.updates_per_publication``).
"""
from gyre_jax.cells.elastic import ElasticStep, ElasticTrainer, StepReport
from gyre_jax.cells.mesh import Cell, CellConfig, CellLayout, Role, split_cells
from gyre_jax.cells.publish import MoveStats, Published, WeightPublisher, move, tree_bytes
from gyre_jax.cells.train_state import (
    OptimizerConfig,
    StateSpec,
    TrainState,
    make_optimizer,
    make_schedule,
    matrix_mask,
    per_adapter,
)
from gyre_jax.cells.train_step import MICRO_BATCH_KEYS, CellSteps, make_grad_fn, staleness
from gyre_jax.sharding import RULES, batch_sharding, mesh_spec, tree_shardings

__all__ = [
    "MICRO_BATCH_KEYS",
    "RULES",
    "Cell",
    "CellConfig",
    "CellLayout",
    "CellSteps",
    "ElasticStep",
    "ElasticTrainer",
    "MoveStats",
    "OptimizerConfig",
    "Published",
    "Role",
    "StateSpec",
    "StepReport",
    "TrainState",
    "WeightPublisher",
    "batch_sharding",
    "make_grad_fn",
    "make_optimizer",
    "make_schedule",
    "matrix_mask",
    "per_adapter",
    "mesh_spec",
    "move",
    "split_cells",
    "staleness",
    "tree_bytes",
    "tree_shardings",
]
