"""The scheduler's names: what a cell is doing (its role) and how the policy runs (its mode).

Defined here once; the policy, the controller, the simulator, the RL loop's
adapters, the run summary and ``cells.mesh.Role`` import them. This module imports
nothing, so the JAX-free scheduler and simulator and the JAX side share it. The
values are plain strings: they appear unchanged in configs, JSON logs and plots.
"""

# Role of a cell, as ``CellPool.role(cell)`` reports it. The core (cell 0) is always
# in TRAIN role here; ``cells.mesh.Role.CORE`` marks it on the JAX side.
ROLLOUT = "rollout"  # serving the agents' model calls
TRAIN = "train"  # computing training micro-batches
TO_TRAIN = "to_train"  # switching: draining calls, then a params snapshot from the core
TO_ROLLOUT = "to_rollout"  # switching: loading params in the serving layout
# Out of service: a cell whose switches or training kept failing; the policy gives it no
# work (real loop only; the simulator's cells never fail).
OUT = "out"
CELL_ROLES = (ROLLOUT, TRAIN, TO_TRAIN, TO_ROLLOUT, OUT)
SERVING_ROLES = (ROLLOUT, TO_ROLLOUT)  # serving now, or about to
TRAINING_ROLES = (TRAIN, TO_TRAIN)  # training now, or about to
SWITCHING_ROLES = (TO_TRAIN, TO_ROLLOUT)
# Timelines only (simulator, plots): a cell in TRAIN role with no micro-batch to compute.
TRAIN_IDLE = "train_idle"
# How timelines draw each role (the PNGs of scheduler.plot and rl.summary, the run report's page).
ROLE_COLORS = {
    ROLLOUT: "#4c78a8",  # serving agents' model calls
    TRAIN: "#f58518",  # computing training micro-batches
    TRAIN_IDLE: "#fdd9b5",  # in train role, waiting for work or for the core's update
    TO_TRAIN: "#222222",  # switching (params snapshot from the core)
    TO_ROLLOUT: "#888888",  # switching (load serving layout)
    OUT: "#d62728",  # out of service (its switches or training kept failing)
}
ROLE_LABELS = {
    ROLLOUT: "rollout (serving)",
    TRAIN: "training",
    TRAIN_IDLE: "train role, idle",
    TO_TRAIN: "switching to train",
    TO_ROLLOUT: "switching to rollout",
    OUT: "out of service",
}

# The built-in policy modes' names (scheduler.policy's docstring says what each does). What a
# mode does is its strategy object's (scheduler.modes: get_mode(name)); ask it, not the name.
COLOCATE = "colocate"
ASYNC = "async"
ASYNC_STREAM = "async_stream"
ELASTIC_NO_STREAM = "elastic_no_stream"
ELASTIC = "elastic"
MODES = (COLOCATE, ASYNC, ASYNC_STREAM, ELASTIC_NO_STREAM, ELASTIC)
