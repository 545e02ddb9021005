"""The names a rollout is recorded with: its status, and the role of each model call.

Defined here once; records, rewards, trees, the harness and the proxy import them.
This module imports nothing, so the grader subprocess and the proxy's identity
module (gyre_jax.serving.identity) can use it without numpy or jax. The values
are plain strings: they go into records, JSON logs and HTTP headers unchanged.
"""

# How a rollout ended (``RolloutOutcome.status``).
STATUS_COMPLETED = "completed"  # the agent finished; graded
STATUS_TIMEOUT = "timeout"  # the deadline hit; graded on its workspace for partial credit
STATUS_INFRA_ERROR = "infra_error"  # harness/engine failure; never trained
STATUS_VERIFIER_ERROR = "verifier_error"  # the grader crashed; never trained
# Statuses that carry a score, so the rollout is trained and counts in its group's
# baseline; failures carry none, so they can never be trained as reward 0.
SCORED_STATUSES = (STATUS_COMPLETED, STATUS_TIMEOUT)
FAILURE_STATUSES = (STATUS_INFRA_ERROR, STATUS_VERIFIER_ERROR)
STATUSES = SCORED_STATUSES + FAILURE_STATUSES

# Who made a model call (``ModelCallRecord.role``, ``TreeNode.role``, header X-Gyre-Role).
ROLE_MAIN = "main"  # the rollout's main agent (agent id 0)
ROLE_SUBAGENT = "subagent"  # a spawned sub-agent (has a parent agent)
ROLE_SUMMARY = "summary"  # a compaction call; carries the id of the agent being compacted
# The order is a priority: trajectory.select prefers main paths, then sub-agents, then summaries.
ROLES = (ROLE_MAIN, ROLE_SUBAGENT, ROLE_SUMMARY)
