"""The RL demo (job 'rl'): the whole elastic loop on CPU on the 'tiny' tasks.

Command:
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo --config.scheduler.mode=colocate
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo --config.scheduler.mode=async

What runs: 8 host CPU devices split into 4 cells of 2; cell 0 is the core (params +
optimizer state). A tiny byte-level transformer is first WARM-STARTED BY A SHORT
SUPERVISED PHASE on scripted demonstrations of the task family (gyre_jax.rl.sft:
the ideal transcript replayed through the real agent loop), because a random
byte model never writes a well-formed tool call. Then RL: JetStream engines on
the rollout cells behind the recording proxy (real HTTP on 127.0.0.1), the
example harness running groups of rollouts of 'tiny' tasks ("copy abc" ->
answer.txt, graded in a subprocess with partial credit), the scheduler's
controller switching cells by its policy, group-normalized advantages, the
clipped policy-gradient loss in the cells' elastic step, and each new version
published to the serving cells.

Expected result: 6-13 minutes on 2 CPU cores (depending on load), training reward and
held-out eval rising by ~0.05 over the supervised warm start's (e.g. eval 0.733 -> 0.802,
v0 -> v60). Every dated measurement of this config (per mode, under load, per objective, and
why RL gains only ~0.05 on one-call tasks) is in docs/results.md; configs/learn.py is the
multi-call family where the trees branch and RL has more to learn.

After the runs, a table of every mode run so far under the workdir (wall time,
utilization by role, reward first/last) is printed.
Outputs in <workdir>/<mode>/: metrics.jsonl (per step: reward, partial credit,
failures by class, staleness, dedup factor, tokens/s, role switches),
timeline.png (cell roles over time), summary.json, the trajectory store,
workspaces and Orbax checkpoints. Rerunning the same command resumes.
Every field can be overridden, e.g. ``--config.steps=10``: this file sets none, the RL job's
defaults are the demo (gyre_jax/rl/config.py and each section's own module say what every field
does; ``python -m gyre_jax.plugins`` lists what a name picks). A config file lists only what it
changes; configs/learn.py and configs/external.py are examples.

The objective is picked by name (``--config.train.loss/advantage/weights/mismatch``; each entry's
options are ``--config.train.loss_options.NAME.OPTION=v``; the README lists every entry with its
paper; docs/results.md has each one's measured eval on this config).
"""
from gyre_jax.rl.config import rl_config


def get_config():
    return rl_config()  # the RL job's defaults: 8 CPU devices, the tiny model, 'tiny' copy tasks, 60 steps

