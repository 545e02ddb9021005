"""Learning on long, branching rollouts (job 'rl'): the 'tiny_agent' family, whole-episode eval.

Commands:
    python -m launch.main --config configs/learn.py --workdir /tmp/gyre_learn
    python -m launch.main --config configs/learn.py --workdir /tmp/gyre_learn --config.scheduler.mode=colocate
    python tools/bench_learning.py            # the three modes, same tasks, seeds and bound; learning.png

What runs: the demo's cells, engines, proxy and trainer (configs/demo.py), on the
'tiny_agent' family (gyre_jax/agents/tasks/tiny_agent.py): every episode reads its input
from in.txt, writes answer.txt, may run the task's test suite (1-30 s heavy-tailed x
run_tests_scale, in the rollout's sandbox) itself or through a sub-agent, and finishes:
2-6 model calls. The harness's context budget (context_budget_tokens) is set so that a
context that carried a test run is compacted by a summary call before the agent goes on,
so the trees the trainer packs branch in real rollouts (a compacted main path beside the
path that asked for the summary, sub-agent paths beside the main one).

The warm start is imperfect at a decision: its demonstrations test their answer in only
30% of the tasks (task.family_options.tiny_agent.demo_test_fraction), and an untested answer earns at most half the
score. RL has to find out that testing pays. The held-out eval runs whole episodes of 16
fixed tasks x 4 samples through the same harness on a dedicated engine (eval/eval.jsonl).

Expected result: ~15 min of warm start (800 SFT steps, cached with --config.sft.cache_dir), then 20 steps
of 32 rollouts (~8-20 min on 2 cores, by load); the held-out eval rises from ~0.4-0.55 at the warm start
by ~+0.1-0.2 (30 steps on an idle machine: +0.09 to +0.26 over modes and seeds; docs/results.md has every run). `python tools/bench_learning.py`
runs elastic, async and colocate and writes learning.png and one JSON line.
"""
from gyre_jax.rl.config import rl_config


def get_config():
    c = rl_config()
    c.steps = 20
    c.checkpoint_every = 5
    c.model.max_seq_len = 640  # the longest call: a summary request after a test run, ~520 bytes
    c.cells.max_len = 640
    c.task.family = "tiny_agent"
    tiny_agent = c.task.family_options.tiny_agent
    tiny_agent.ops = "copy"
    tiny_agent.max_len = 3
    tiny_agent.run_tests_scale = 0.5  # suites of 0.5-15 s (median 1.5 s): rollouts wait on their environment
    c.scheduler.groups_per_step = 4  # 32 rollouts of 2-6 calls per step
    c.harness.max_turns = 4
    c.harness.max_tokens = 120  # the longest demonstrated reply (write + spawn_subagent) is ~105 tokens
    c.harness.deadline_s = 120.0
    c.harness.system_prompt = "Answer in answer.txt; test it."  # short: the warm start teaches the tools
    c.harness.context_budget_tokens = 240  # above the skip path's contexts, below a tested one's
    c.harness.summary_request = "Summarize."
    c.harness.summary_header = "\nSummary: "
    c.harness.subagent_system_prompt = 'Sub-agent. Call: <tool>NAME {"k": "v"}</tool>; finish with a report.'
    c.harness.max_subagents = 1
    c.train.row_len = 640
    c.sft.steps = 800  # copying from a tool result emerges after ~400 steps (chars right 0.03 -> 0.32)
    c.sft.rows = 4
    c.eval.kind = "episodes"
    c.eval.every = 4
    c.eval.tasks = 16
    c.eval.samples_per_task = 4
    return c
