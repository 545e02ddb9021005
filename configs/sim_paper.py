"""Simulate the paper's largest run (48 steps, ~700K tokens/rollout) in every mode.

Command:
  python -m launch.main --config configs/sim_paper.py --workdir /tmp/sim

Expected runtime: a few minutes of CPU (5 simulations of 48 steps on 1,024 accelerators,
~4.5M events each, plus the plots); more wall time on a loaded machine.
Expected result (seed 0): report.json, report.txt, timelines.png and
timeline_<mode>.png in the workdir. Measured by tools/bench_scheduler.py on the same
rollouts (Dec 2026): colocate ~297 h, async ~218 h with the split balanced on the
first step (9 of 16 cells training; 215 h at the best split in hindsight, 8 cells),
elastic ~211 h: elastic_vs_async 1.03 (1.018 against the best split), elastic_vs_colocate
~1.41, elastic ~1.09x its lower bound, mean staleness ~0.83 (bound 2). The async modes
here take the split balanced on the whole run's work. Every preset parameter and its
source is in gyre_jax/scheduler/presets.py; tools/bench_scheduler.py runs all presets.
"""
from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.job = "simulate"  # gyre_jax.scheduler.cli:run
    c.preset = "large_run"  # gyre_jax.scheduler.presets: large_run | nl2repo | deepswe | terminalbench | ablation12 | short_uniform
    c.modes = "colocate,async,async_stream,elastic_no_stream,elastic"  # comma-separated, each from policy.MODES
    c.steps = 0  # optimizer steps; 0 = the preset's (48 for large_run)
    c.seed = 0  # seeds the sampled rollouts; every mode gets the same ones
    c.accelerators = 0  # cluster size; 0 = the preset's (1,024); the batch is resized to fill it
    c.async_train_cells = 0  # async baselines: cells fixed in training; 0 = split by the workload's training share
    c.staleness_bound = -1  # max updates between a rollout's version and its step; -1 = the preset's (2)
    c.call_merge = 0  # model calls per simulated call; 0 = the preset's (4 for large_run)
    c.plot = True  # write timelines.png and timeline_<mode>.png
    return c
