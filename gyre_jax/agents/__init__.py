"""gyre_jax.agents: an example agent harness and verifiable task suites.

* ``harness``: rollouts (workspace, deadline, grading, status) run concurrently;
  ``run_rollouts`` / ``iter_rollouts`` / ``RolloutRequest`` / ``RolloutResult``.
* ``agent``: the loop (tool calls, compaction, sub-agents); ``client``: the HTTP client
  with retries; ``tools``: workspace tools and the two tool-call formats. The X-Gyre-*
  header / ``gyre:<run>:<rollout>`` API-key convention is the proxy's
  (``gyre_jax.serving.identity``); rollout statuses and call roles are the
  trajectory's (``gyre_jax.trajectory.vocab``).
* ``tasks``: task families (``repo_spec``, ``tiny``); ``graders`` / ``grader_main``:
  grading in a subprocess; ``demos``: scripted demonstrations for a warm start.

Nothing here is required by the rest of gyre_jax: any OpenAI-compatible harness works
through the proxy. Names below are imported lazily so the grader subprocess (which
imports ``gyre_jax.agents.grader_main``) does not pay for aiohttp.
"""
import importlib

_EXPORTS = {
    "HarnessConfig": "gyre_jax.agents.config",
    "RolloutRequest": "gyre_jax.agents.harness",
    "RolloutResult": "gyre_jax.agents.harness",
    "run_rollout": "gyre_jax.agents.harness",
    "run_rollouts": "gyre_jax.agents.harness",
    "iter_rollouts": "gyre_jax.agents.harness",
    "group_requests": "gyre_jax.agents.harness",
    "Task": "gyre_jax.agents.tasks.base",
    "make_task": "gyre_jax.agents.tasks",
    "demonstration": "gyre_jax.agents.demos",
    "ademonstration": "gyre_jax.agents.demos",
    "Demonstration": "gyre_jax.agents.demos",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gyre_jax.agents' has no attribute {name!r}")
