"""Bring your own agent (job 'rl'): an external harness, a JSONL task set, command graders.

Commands (the default runs mini-swe-agent on examples/tasks/tasks.jsonl; it needs bubblewrap:
`apt-get install bubblewrap`, and the `harnesses` extra: `pip install -e ".[serving,harnesses]"`):

    python -m launch.main --config configs/external.py --workdir /tmp/gyre_ext
    # your task file (JSONL: id, instruction, files or repo, grader, ...; gyre_jax/agents/tasks/dataset.py):
    python -m launch.main --config configs/external.py --workdir /tmp/w --config.task.dataset=/data/tasks.jsonl
    # any agent CLI, run inside each rollout's sandbox with OPENAI_/ANTHROPIC_BASE_URL and _API_KEY set
    # (the command kind's options: --config.harness.kind_options.command.*):
    python -m launch.main --config configs/external.py --workdir /tmp/w \\
        --config.harness.kind_options.command.command='python my_agent.py --task-file {instruction_file}' \\
        --config.harness.kind_options.command.ro_paths=/opt/my_agent
    # Claude Code (installed under /opt/claude; node needs a larger address space):
    python -m launch.main --config configs/external.py --workdir /tmp/w \\
        --config.harness.kind_options.command.command='claude -p "$(cat {instruction_file})" --dangerously-skip-permissions' \\
        --config.harness.kind_options.command.ro_paths=/opt/claude \\
        --config.harness.kind_options.command.memory_bytes=34359738368
    # an agent written in Python: async def solve(task, client) (gyre_jax/agents/harnesses/python_entry.py):
    python -m launch.main --config configs/external.py --workdir /tmp/w --config.harness.kind=python \\
        --config.harness.kind_options.python.entry=my_package.my_agent:solve
    # a real checkpoint (its shape, weights, tokenizer and chat template come from the directory):
    python -m launch.main --config configs/external.py --workdir /tmp/w --config.model.hf_path=/ckpt/Qwen3-0.6B
    # the built-in example agent on the same tasks:
    python -m launch.main --config configs/external.py --workdir /tmp/w --config.harness.kind=builtin

What runs: the demo's cells, engines, proxy and trainer (configs/demo.py), but every rollout is
one mini-swe-agent process started in the rollout's bubblewrap sandbox (its own network
namespace whose only door is the proxy's unix socket), working in the workspace the task's
`files`/`repo` were laid into; every model call it makes is recorded by the proxy under the
rollout's key, the tree of its calls is rebuilt and trained. Its workspace is graded by the
task's own verdict (per-test: gyre's pytest plugin on the named tests; calls; or a command's exit
status / $GYRE_VERDICT), every grader checked at start (`--check_tasks` prints the same check:
`python -m launch.main --config configs/external.py --check_tasks`, ~20 s, every task "ok", exit 0).
Held-out eval: whole episodes of the
split=eval tasks through the same harness on a dedicated engine (eval/eval.jsonl).

The model is a tiny random byte-level transformer with a 2K context (no warm start: the task
file has no demonstrations), so it produces no useful actions and rewards stay ~0: this
config shows the machinery working end to end with an external harness. To learn, start from a
real checkpoint: ``--config.model.hf_path=/ckpt/dir`` or ``=/path/model.gguf`` here (the shape comes from
it; configs/smol_agent.py does this with SmolLM2-135M-Instruct on this host's 2 cores), or a config of
a few lines that takes a checkpoint config's sections (configs/external_qwen3_8b.py: this file with
configs/qwen3_8b.py's model, cells and train). Rerunning the same command resumes.

Expected (2 CPU cores, Dec 3 2026): about 3-5 minutes for 3 steps x 2 groups x 4 rollouts,
~3 model calls per rollout (mini-swe-agent stops after 3 format errors in a row), every
call recorded under its rollout, eval score 0.0 at the start and the end.
"""
import os

import ml_collections

from gyre_jax.rl.config import rl_config

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
MINI_SWE_AGENT = ("mini -y --exit-immediately -c " + os.path.join(_EXAMPLES, "harnesses", "mini_swe_agent.yaml")
                  + ' -t "$(cat {instruction_file})" -o /tmp/trajectory.json')


def get_config():
    c = rl_config()
    c.steps = 3
    c.checkpoint_every = 1
    c.model.max_seq_len = 2048  # mini-swe-agent's context: system + task + a few turns, in bytes
    # A real checkpoint: --config.model.hf_path=/ckpt/dir or /path/model.gguf gives the shape (the fields this file
    # leaves at the tiny model's) and keeps max_seq_len/remat/dtype/param_dtype (configs/smol_agent.py).
    c.cells.max_len = 2048
    c.cells.max_slots = 8
    c.scheduler.groups_per_step = 2
    c.scheduler.group_size = 4
    c.task.dataset = os.path.join(_EXAMPLES, "tasks", "tasks.jsonl")  # split=eval lines are the held-out set
    c.harness.kind = "command"  # builtin | python | command
    command = c.harness.kind_options.command
    command.command = MINI_SWE_AGENT
    command.ro_paths = os.path.join(_EXAMPLES, "harnesses")  # its config file, visible read-only
    command.env = ml_collections.ConfigDict(dict(
        MSWEA_CONFIGURED="true",  # no first-run setup prompt
        MSWEA_COST_TRACKING="ignore_errors",  # no price list for our model
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # litellm reads its bundled model map, never fetches one
    ))
    c.harness.max_tokens = 96  # per call (the proxy clamps larger requests to this)
    c.harness.max_turns = 8  # the built-in agent's calls, when harness.kind=builtin
    c.harness.deadline_s = 180.0  # per rollout: mini-swe-agent's start-up is seconds on a loaded machine
    c.harness.request_timeout_s = 120.0
    c.harness.system_prompt = ""  # the tasks' own (built-in agent)
    c.train.row_len = 2048
    c.sft.steps = 0  # a task file has no scripted demonstrations: start from the random init (or hf_path)
    c.eval.kind = "episodes"  # whole episodes through the same harness, at a fixed version
    c.eval.every = 3  # before the first step and after the last
    c.eval.tasks = 2
    c.eval.samples_per_task = 2
    return c
